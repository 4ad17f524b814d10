//! `POST /v1/completions`: one or many prompts (text or token ids), `n` samples each, with
//! integer `logprobs` and `echo` (the prompt's own logprobs, as evaluation harnesses use).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use flint_engine::sampler::TokenLogprobs;
use flint_engine::SampleOutput;
use serde_json::Value;

use crate::api_types::completion::{Completion, CompletionChoice, CompletionChunkChoice, CompletionLogprobs};
use crate::api_types::Usage;
use crate::chat::check_model;
use crate::error::{ApiError, ApiResult};
use crate::generation::{collect, respond, sse, submit, Chunk, Formatter, StreamCtx};
use crate::output::{finish_reason, new_id, now_unix, stop_reason, vllm_prompt_logprobs, Outcome, Timer};
use crate::prompt_tokens::encode_bounded;
use crate::protocol::{completion_logprobs, parse_off_async, parse_request, prompt_logprobs, CompletionRequest};
use crate::request_span::Arrival;
use crate::state::{ServingModel, SharedState};

pub async fn completions(State(state): State<SharedState>, headers: HeaderMap, body: Bytes) -> Response {
    let arrival = Arrival::new(&state, &headers);
    respond(&state, run(&state, arrival, body).await)
}

/// `prompt` as given: texts still to tokenize, or token ids (already checked).
pub(crate) enum Prompts {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

impl Prompts {
    pub(crate) fn len(&self) -> usize {
        match self {
            Prompts::Texts(t) => t.len(),
            Prompts::Ids(i) => i.len(),
        }
    }
}

/// `prompt` as string, list of strings, token ids, or list of token-id lists: its shape and token
/// ids checked, cheaply, before the request is admitted; texts are tokenized later.
pub(crate) fn parse_prompts(prompt: Option<Value>) -> ApiResult<Prompts> {
    let bad = |m: &str| ApiError::invalid("prompt", m.to_string());
    let shape = "`prompt` must be a string, a list of strings, token ids or lists of token ids";
    let ids = |v: &[Value]| -> ApiResult<Vec<u32>> {
        v.iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| bad("token ids must be non-negative integers"))
            })
            .collect()
    };
    let out = match prompt {
        None => return Err(bad("`prompt` is required")),
        Some(Value::String(s)) => Prompts::Texts(vec![s]),
        Some(Value::Array(items)) => match items.first() {
            None => return Err(bad("`prompt` must not be empty")),
            Some(Value::String(_)) => Prompts::Texts(
                items
                    .into_iter()
                    .map(|p| match p {
                        Value::String(s) => Ok(s),
                        _ => Err(bad("a list of prompts must hold only strings")),
                    })
                    .collect::<ApiResult<_>>()?,
            ),
            Some(Value::Number(_)) => Prompts::Ids(vec![ids(&items)?]),
            Some(Value::Array(_)) => Prompts::Ids(
                items
                    .iter()
                    .map(|p| {
                        p.as_array()
                            .ok_or_else(|| bad("a list of token lists must hold only lists"))
                            .and_then(|a| ids(a))
                    })
                    .collect::<ApiResult<_>>()?,
            ),
            Some(_) => return Err(bad(shape)),
        },
        Some(_) => return Err(bad(shape)),
    };
    if let Prompts::Ids(ids) = &out {
        if ids.iter().any(Vec::is_empty) {
            return Err(bad("a prompt has no tokens"));
        }
    }
    Ok(out)
}

/// The token ids of every prompt (texts tokenized, bounded by the context length).
pub(crate) fn tokenize(model: &ServingModel, prompts: Prompts) -> ApiResult<Vec<Vec<u32>>> {
    let texts = match prompts {
        Prompts::Ids(ids) => return Ok(ids),
        Prompts::Texts(t) => t,
    };
    let mut out = Vec::with_capacity(texts.len());
    for t in &texts {
        // With special tokens, as vLLM's completions: a tokenizer that adds a BOS (Llama 3's)
        // puts it first; Qwen's adds nothing.
        let ids = encode_bounded(&model.tokenizer, t, true, model.max_model_len).map_err(|e| e.into_api("prompt"))?;
        if ids.is_empty() {
            return Err(ApiError::invalid("prompt", "a prompt encodes to no tokens"));
        }
        out.push(ids);
    }
    Ok(out)
}

/// The echoed prompt's logprob columns (the first token has none).
fn echo_logprobs(
    model: &ServingModel,
    prompt: &[u32],
    plps: Option<&Vec<Option<TokenLogprobs>>>,
    lp: &mut CompletionLogprobs,
) -> usize {
    let mut offset = 0;
    for (i, &t) in prompt.iter().enumerate() {
        let entry = plps.and_then(|v| v.get(i)).and_then(Option::as_ref);
        offset = lp.push(&model.tokenizer, t, entry, offset);
    }
    offset
}

async fn run(state: &SharedState, arrival: Arrival, body: Bytes) -> ApiResult<Response> {
    let model = state.model()?;
    let req: CompletionRequest = parse_off_async(body, parse_request).await?;
    check_model(state, req.common.model.as_deref())?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    let echo = req.echo.unwrap_or(false);
    let mut params = req.common.to_params(model.router.model_info(), "prompt")?;
    let max_logprobs = state.cfg.max_logprobs;
    params.logprobs = completion_logprobs(req.logprobs, max_logprobs)?;
    let prompt_lps = prompt_logprobs(&req.common, max_logprobs)?;
    // `echo` with `max_tokens: 0` scores the prompt: its logprobs, nothing generated.
    let scoring = echo && req.common.max_tokens(0, model.max_model_len, true)? == 0;
    if echo {
        params.prompt_logprobs = params.logprobs.or(scoring.then_some(0));
    }
    params.prompt_logprobs = params.prompt_logprobs.max(prompt_lps);
    req.common.max_tokens(0, model.max_model_len, echo)?;
    if let Some(r) = crate::structured::requested(&req.common)? {
        params.structured = Some(crate::structured::compile(&model, r, None, state.cfg.grammar_compile_timeout).await?);
    }
    let prompts = parse_prompts(req.prompt)?;
    // Admitted by its sequence count before any prompt is tokenized.
    let mut guard = state.admit(&model, prompts.len().saturating_mul(params.n), "prompt")?;
    let m = model.clone();
    let prompts = tokio::task::spawn_blocking(move || tokenize(&m, prompts))
        .await
        .map_err(|_| ApiError::internal("prompt tokenization panicked"))??;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    params.max_tokens = req.common.max_tokens(longest, model.max_model_len, echo)?;
    let id = new_id("cmpl");
    let n = params.n;
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let mut jobs = submit(&model, &id, prompts.clone(), &params, "prompt", &mut guard)?;
    let mut timer = Timer::new(&arrival, n * prompts.len());
    timer.trace(&arrival, &id, &params, &state.cfg.served_model_name);
    let created = now_unix();
    let ctx = StreamCtx {
        state: state.clone(),
        model: model.clone(),
        id: id.clone(),
        created,
        n,
        include_usage: req.common.include_usage(),
        prompt_tokens,
        object: "text_completion",
    };
    if req.common.stream() {
        let fmt = CompletionStream {
            echo,
            logprobs: params.logprobs.is_some(),
            prompts,
            n,
            choices: vec![StreamChoice::default(); n * jobs.len()],
            prompt_logprobs: vec![None; jobs.len()],
        };
        return Ok(sse(ctx, jobs, guard, timer, Box::new(fmt)));
    }
    let choices = collect(state, &mut jobs, n, &mut timer, &mut guard).await?;
    let eos = &model.router.model_info().eos_token_ids;
    let (mut out, mut completion) = (Vec::with_capacity(choices.len()), 0);
    for (i, c) in choices.iter().enumerate() {
        let prompt = &prompts[i / n];
        completion += c.token_ids.len();
        let fin = c
            .finished
            .clone()
            .unwrap_or(flint_engine::Finished { reason: flint_engine::FinishReason::Error, stop: None });
        let mut text = String::new();
        let mut lp = CompletionLogprobs::default();
        let mut offset = 0;
        if echo {
            text = model.tokenizer.decode(prompt, false).unwrap_or_default();
            // Prompt logprobs come with the first sample of each prompt.
            let plps = choices[i - i % n].prompt_logprobs.as_ref();
            offset = echo_logprobs(&model, prompt, plps, &mut lp);
        }
        text.push_str(&c.text);
        for (t, l) in c.token_ids.iter().zip(&c.logprobs) {
            offset = lp.push(&model.tokenizer, *t, Some(l), offset);
        }
        let prompt_logprobs = prompt_lps.map(|k| {
            let plps = choices[i - i % n].prompt_logprobs.as_ref();
            vllm_prompt_logprobs(&model.tokenizer, prompt, plps, k)
        });
        out.push(CompletionChoice {
            index: i,
            text,
            logprobs: params.logprobs.map(|_| lp),
            finish_reason: finish_reason(&fin, false),
            stop_reason: stop_reason(&fin, eos),
            prompt_logprobs,
        });
    }
    let cached = choices.iter().step_by(n).map(|c| c.cached_tokens).sum();
    let reason = out.first().map_or("stop", |c| match c.finish_reason {
        "length" => "length",
        "abort" => "abort",
        _ => "stop",
    });
    let outcome = Outcome {
        id: &id,
        prompt_tokens,
        completion_tokens: completion,
        cached_tokens: cached,
        sequences: n * prompts.len(),
        reason,
    };
    timer.finish(&state.metrics, outcome);
    let body = Completion {
        id: &id,
        object: "text_completion",
        created,
        model: &state.cfg.served_model_name,
        choices: out,
        usage: Usage::new(prompt_tokens, completion, cached),
    };
    Ok(Json(body).into_response())
}

#[derive(Debug, Default, Clone)]
struct StreamChoice {
    started: bool,
    offset: usize,
    completion: usize,
    cached: usize,
    reason: Option<&'static str>,
}

struct CompletionStream {
    echo: bool,
    logprobs: bool,
    prompts: Vec<Vec<u32>>,
    n: usize,
    choices: Vec<StreamChoice>,
    /// Per job: its prompt's logprobs, which arrive with sample 0's first event (before the
    /// siblings', which start from sample 0's cached prompt).
    prompt_logprobs: Vec<Option<Vec<Option<TokenLogprobs>>>>,
}

impl Formatter for CompletionStream {
    fn prelude(&mut self, _ctx: &StreamCtx) -> Vec<Chunk> {
        Vec::new()
    }

    fn on_output(&mut self, ctx: &StreamCtx, job: usize, o: SampleOutput) -> Vec<Chunk> {
        let idx = job * self.n + o.index;
        let (echo, logprobs) = (self.echo, self.logprobs);
        if let (Some(p), Some(slot)) = (&o.prompt_logprobs, self.prompt_logprobs.get_mut(job)) {
            *slot = Some(p.clone());
        }
        let plps = self.prompt_logprobs.get(job).cloned().flatten();
        let Some(st) = self.choices.get_mut(idx) else { return Vec::new() };
        let tok = &ctx.model.tokenizer;
        let mut text = String::new();
        let mut lp = CompletionLogprobs::default();
        if echo && !st.started {
            // The echoed prompt opens each choice; its logprobs arrive with sample 0's first event.
            let prompt = &self.prompts[job];
            text = tok.decode(prompt, false).unwrap_or_default();
            st.offset = echo_logprobs(&ctx.model, prompt, plps.as_ref(), &mut lp);
        }
        st.started = true;
        st.completion += o.token_ids.len();
        st.cached = o.cached_tokens;
        text.push_str(&o.text);
        for (t, l) in o.token_ids.iter().zip(&o.logprobs) {
            st.offset = lp.push(tok, *t, Some(l), st.offset);
        }
        let fin = o.finished.as_ref().map(|f| {
            let r = finish_reason(f, false);
            st.reason = Some(r);
            (r, stop_reason(f, &ctx.model.router.model_info().eos_token_ids))
        });
        if text.is_empty() && fin.is_none() && o.logprobs.is_empty() {
            return Vec::new();
        }
        let choice = CompletionChunkChoice {
            index: idx,
            text,
            logprobs: logprobs.then_some(lp),
            finish_reason: fin.as_ref().map(|f| f.0),
            stop_reason: fin.map(|f| f.1),
        };
        vec![Chunk::new(&ctx.chunk(vec![choice]))]
    }

    fn summary(&self) -> (usize, usize, &'static str) {
        let completion = self.choices.iter().map(|c| c.completion).sum();
        let cached = self.choices.iter().step_by(self.n.max(1)).map(|c| c.cached).sum();
        (completion, cached, self.choices.first().and_then(|c| c.reason).unwrap_or("stop"))
    }
}
