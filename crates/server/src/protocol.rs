//! OpenAI request bodies (with vLLM's extensions) and their validation into engine parameters.
//! Unknown fields are ignored, as OpenAI's own clients send fields a server may not know.

use std::collections::HashMap;

use flint_engine::request::{RequestParams, MAX_N};
use flint_engine::validation::validate_params;
use flint_engine::{ModelInfo, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

use crate::error::{ApiError, ApiResult};

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields shared by chat and completions.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub stop: Option<StopField>,
    pub seed: Option<i64>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub cache_salt: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's extension: logprobs of the prompt's tokens, with this many alternatives each.
    pub prompt_logprobs: Option<i64>,
    // Output constraints, validated by `crate::structured`.
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub guided_decoding_backend: Option<Value>,
    pub guided_whitespace_pattern: Option<Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ChatRequest {
    /// Parsed separately (see [`parse_request`]) so a bad value names its field.
    #[serde(skip)]
    pub common: Common,
    pub messages: Vec<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    #[serde(skip)]
    pub common: Common,
    pub prompt: Option<Value>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
}

fn path_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> ApiError {
    let path = e.path().to_string();
    if path.is_empty() || path == "." {
        ApiError::bad_body(format!("The request body is not valid JSON for this endpoint: {}", e.inner()))
    } else {
        let param = path.split(['.', '[']).next().unwrap_or(&path).to_string();
        ApiError::invalid(&param, format!("Invalid value for `{path}`: {}", e.inner()))
    }
}

/// The body as one strict JSON object (see [`crate::json`]): 400 for anything else, and for
/// lists too long to build (counted first, see [`crate::body_counts`]).
pub fn body_object(bytes: &[u8]) -> ApiResult<Value> {
    crate::body_counts::count(bytes).check()?;
    let v = crate::json::parse_strict(bytes)
        .map_err(|e| ApiError::bad_body(format!("The request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_body("The request body must be a JSON object"));
    }
    Ok(v)
}

/// Parse a JSON body, naming the offending field when a value has the wrong type.
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> ApiResult<T> {
    serde_path_to_error::deserialize(&body_object(bytes)?).map_err(path_error)
}

/// Run `parse` over `body` on the blocking pool: counting and parsing a body of megabytes takes
/// a while (two 13.6 MB bodies held `/health` for 4.4 s when parsed on the async workers, which
/// also carry every stream).
pub async fn parse_off_async<T: Send + 'static>(
    body: axum::body::Bytes,
    parse: impl FnOnce(&[u8]) -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(move || parse(&body))
        .await
        .unwrap_or_else(|_| Err(ApiError::internal("parsing the request body panicked")))
}

/// A request type with the shared fields.
pub trait WithCommon: serde::de::DeserializeOwned {
    fn common_mut(&mut self) -> &mut Common;
}

impl WithCommon for ChatRequest {
    fn common_mut(&mut self) -> &mut Common {
        &mut self.common
    }
}

impl WithCommon for CompletionRequest {
    fn common_mut(&mut self) -> &mut Common {
        &mut self.common
    }
}

/// Parse a body of an endpoint without the shared sampling fields (`/v1/embeddings`).
pub fn parse_plain<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> ApiResult<T> {
    let v = body_object(bytes)?;
    serde_path_to_error::deserialize(&v).map_err(path_error)
}

/// Parse a chat or completions body: its own fields and the shared ones, each from the same JSON
/// object (serde's `flatten` would lose the name of a field with a bad value).
pub fn parse_request<T: WithCommon>(bytes: &[u8]) -> ApiResult<T> {
    let v = body_object(bytes)?;
    let mut t: T = serde_path_to_error::deserialize(&v).map_err(path_error)?;
    *t.common_mut() = serde_path_to_error::deserialize(&v).map_err(path_error)?;
    Ok(t)
}

fn non_negative(name: &str, v: Option<i64>) -> ApiResult<Option<usize>> {
    match v {
        None => Ok(None),
        Some(x) if x >= 0 => Ok(Some(x as usize)),
        Some(x) => Err(ApiError::invalid(name, format!("`{name}` must be non-negative, got {x}"))),
    }
}

impl Common {
    /// The request's parameters, checked by the engine's rules
    /// ([`flint_engine::validation`]); this only reads the JSON's shape. `max_tokens` (which needs
    /// the prompt's length) and logprobs (whose fields differ between endpoints) are set later.
    pub fn to_params(&self, info: &ModelInfo, prompt_param: &str) -> ApiResult<RequestParams> {
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_N as i64).contains(&n) => n as usize,
            Some(n) => return Err(ApiError::invalid("n", format!("`n` must be between 1 and {MAX_N}, got {n}"))),
        };
        if let Some(b) = self.best_of {
            if b != n as i64 {
                return Err(ApiError::invalid(
                    "best_of",
                    format!("`best_of` is not supported unless it equals `n` ({n}); got {b}"),
                ));
            }
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid("top_k", format!("`top_k` must be -1 (off) or positive, got {k}")))
            }
        };
        crate::limits::check_logit_bias(self.logit_bias.as_ref().map_or(0, HashMap::len))?;
        let mut logit_bias = Vec::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            // Digits only: Rust's parser would also take "+5" for 5.
            let digits = !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit());
            let id: u32 = k.parse().ok().filter(|_| digits).ok_or_else(|| {
                ApiError::invalid("logit_bias", format!("`logit_bias` keys must be token ids, got {k:?}"))
            })?;
            logit_bias.push((id, v as f32));
        }
        logit_bias.sort_by_key(|(id, _)| *id);
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        crate::limits::check_stop(&stop)?;
        let stop_token_ids = self
            .stop_token_ids
            .iter()
            .flatten()
            .map(|&t| {
                u32::try_from(t).map_err(|_| {
                    ApiError::invalid("stop_token_ids", format!("`stop_token_ids` entry {t} is not a token id"))
                })
            })
            .collect::<ApiResult<Vec<u32>>>()?;
        // Out-of-range floats become NaN or infinity here and fail the engine's range checks.
        let f = |v: Option<f64>, default: f32| v.map_or(default, |x| x as f32);
        let params = RequestParams {
            sampling: SamplingParams {
                temperature: f(self.temperature, 1.0),
                top_p: f(self.top_p, 1.0),
                top_k,
                min_p: f(self.min_p, 0.0),
                presence_penalty: f(self.presence_penalty, 0.0),
                frequency_penalty: f(self.frequency_penalty, 0.0),
                repetition_penalty: f(self.repetition_penalty, 1.0),
                logit_bias,
                seed: self.seed.map(|s| s as u64),
            },
            n,
            max_tokens: 0,
            min_tokens: non_negative("min_tokens", self.min_tokens)?.unwrap_or(0),
            stop,
            stop_token_ids,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            logprobs: None,
            prompt_logprobs: None,
            cache_salt: self.cache_salt.clone(),
            structured: None,
            pooling: None,
        };
        // The cheap rules now, before a prompt is rendered and tokenized; the engine applies
        // the same function again (with the prompt) when the request is submitted.
        validate_params(&params, info).map_err(|e| ApiError::from_param(e, prompt_param))?;
        Ok(params)
    }

    /// `max_completion_tokens` (the newer name) or `max_tokens`; default: what the context has left.
    /// `zero_ok`: 0 is allowed (completions' `echo` scoring a prompt).
    pub fn max_tokens(&self, prompt_len: usize, max_model_len: usize, zero_ok: bool) -> ApiResult<usize> {
        let (name, v) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => ("max_completion_tokens", Some(v)),
            (None, v) => ("max_tokens", v),
        };
        match v {
            None => Ok(max_model_len.saturating_sub(prompt_len).max(1)),
            Some(v) if v >= 1 || (v == 0 && zero_ok) => Ok(v as usize),
            Some(0) => Err(ApiError::invalid(
                name,
                format!("`{name}` must be at least 1 (0 only with `echo`, to score the prompt)"),
            )),
            Some(v) => Err(ApiError::invalid(name, format!("`{name}` must be at least 1, got {v}"))),
        }
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }
}

/// An integer count of logprobs, 0 to `max` (the server's `--max-logprobs`).
fn logprob_count(name: &str, v: Option<i64>, max: usize) -> ApiResult<Option<usize>> {
    match v {
        None => Ok(None),
        Some(k) if (0..=max as i64).contains(&k) => Ok(Some(k as usize)),
        Some(k) => {
            Err(ApiError::invalid(name, format!("`{name}` must be between 0 and {max} (--max-logprobs), got {k}")))
        }
    }
}

/// Completions' logprobs (an integer, at most `max`).
pub fn completion_logprobs(v: Option<i64>, max: usize) -> ApiResult<Option<usize>> {
    logprob_count("logprobs", v, max)
}

/// vLLM's `prompt_logprobs` (at most `max`), not with streaming.
pub fn prompt_logprobs(c: &Common, max: usize) -> ApiResult<Option<usize>> {
    let k = logprob_count("prompt_logprobs", c.prompt_logprobs, max)?;
    if k.is_some() && c.stream() {
        return Err(ApiError::invalid("prompt_logprobs", "`prompt_logprobs` is not supported with `stream`"));
    }
    Ok(k)
}

/// Chat's `logprobs` (bool) and `top_logprobs` (0..=`max`, only with `logprobs`).
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>, max: usize) -> ApiResult<Option<usize>> {
    let top = logprob_count("top_logprobs", top, max)?;
    match (logprobs.unwrap_or(false), top) {
        (true, t) => Ok(Some(t.unwrap_or(0))),
        (false, Some(t)) if t > 0 => Err(ApiError::invalid("top_logprobs", "`top_logprobs` requires `logprobs: true`")),
        (false, _) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ModelInfo {
        ModelInfo { vocab_size: 128, valid_vocab: 100, eos_token_ids: vec![0] }
    }

    #[test]
    fn bad_values_name_their_parameter() {
        let bad = |body: &str| {
            let r: ApiResult<ChatRequest> = parse_request(body.as_bytes());
            let req = match r {
                Ok(req) => req,
                Err(e) => return e,
            };
            req.common.to_params(&info(), "messages").err().unwrap_or_else(|| ApiError::internal("accepted"))
        };
        assert_eq!(bad(r#"{"messages":[],"temperature":"hot"}"#).param.as_deref(), Some("temperature"));
        assert_eq!(bad(r#"{"messages":[],"temperature":3}"#).param.as_deref(), Some("temperature"));
        assert_eq!(bad(r#"{"messages":[],"top_p":0}"#).param.as_deref(), Some("top_p"));
        assert_eq!(bad(r#"{"messages":[],"n":0}"#).param.as_deref(), Some("n"));
        assert_eq!(bad(r#"{"messages":[],"n":2,"best_of":3}"#).param.as_deref(), Some("best_of"));
        assert_eq!(bad(r#"{"messages":[],"logit_bias":{"x":1}}"#).param.as_deref(), Some("logit_bias"));
        assert_eq!(bad(r#"{"messages":[],"logit_bias":{"500":1}}"#).param.as_deref(), Some("logit_bias"));
        assert_eq!(bad(r#"{"messages":[],"presence_penalty":-3}"#).param.as_deref(), Some("presence_penalty"));
        assert_eq!(bad(r#"{"messages":[],"top_k":-2}"#).param.as_deref(), Some("top_k"));
        assert_eq!(bad(r#"{"messages":"x"}"#).param.as_deref(), Some("messages"));
        assert_eq!(bad("not json").status, axum::http::StatusCode::BAD_REQUEST);
    }

    #[test]
    fn unknown_fields_and_extensions_are_accepted() {
        let r: ChatRequest = parse_request(
            br#"{"messages":[],"user":"u","metadata":{"a":1},"store":false,"service_tier":"auto","top_k":5,
                "min_p":0.1,"repetition_penalty":1.1,"stop":"x","best_of":1,"seed":3,"logit_bias":{"7":-100}}"#,
        )
        .unwrap();
        let p = r.common.to_params(&info(), "messages").unwrap();
        assert_eq!(p.sampling.top_k, 5);
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert_eq!(p.sampling.logit_bias, vec![(7, -100.0)]);
        assert_eq!(p.sampling.temperature, 1.0, "OpenAI's default temperature is 1");
    }

    #[test]
    fn max_tokens_defaults_to_the_rest_of_the_context() {
        let c = Common::default();
        assert_eq!(c.max_tokens(10, 100, false).unwrap(), 90);
        let c = Common { max_tokens: Some(0), ..Default::default() };
        assert_eq!(c.max_tokens(10, 100, false).unwrap_err().param.as_deref(), Some("max_tokens"));
        let c = Common { max_tokens: Some(5), max_completion_tokens: Some(7), ..Default::default() };
        assert_eq!(c.max_tokens(10, 100, false).unwrap(), 7);
    }

    #[test]
    fn chat_logprob_rules() {
        assert_eq!(chat_logprobs(Some(true), Some(3), 20).unwrap(), Some(3));
        assert_eq!(chat_logprobs(None, None, 20).unwrap(), None);
        assert!(chat_logprobs(None, Some(2), 20).is_err());
        assert!(chat_logprobs(Some(true), Some(21), 20).is_err());
        assert_eq!(chat_logprobs(Some(true), Some(21), 50).unwrap(), Some(21));
        assert!(completion_logprobs(Some(-1), 20).is_err());
        let c = Common { max_tokens: Some(0), ..Default::default() };
        assert_eq!(c.max_tokens(10, 100, true).unwrap(), 0);
        let c = Common { prompt_logprobs: Some(2), stream: Some(true), ..Default::default() };
        assert_eq!(prompt_logprobs(&c, 20).unwrap_err().param.as_deref(), Some("prompt_logprobs"));
    }
}
