//! `POST /v1/embeddings`: one vector per input (a string, a list of strings, token ids or lists
//! of token ids), pooled by the engine from the prompt's final hidden states as the server was
//! started to pool (`--runner pooling`, `--pooler-config`). `dimensions` keeps the first that
//! many numbers and renormalises (Matryoshka models); `encoding_format: base64` sends the f32
//! bytes. The inputs run through the same scheduler as generation requests, one sequence each.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use flint_engine::pooling::PoolingParams;
use flint_engine::RequestParams;
use serde::Deserialize;
use serde_json::Value;

use crate::api_types::embedding::{EmbeddingData, EmbeddingList, EmbeddingUsage, EmbeddingVector};
use crate::body_counts::MAX_PROMPTS;
use crate::chat::check_model;
use crate::completions::{parse_prompts, tokenize};
use crate::error::{ApiError, ApiResult};
use crate::generation::{collect, respond, submit};
use crate::output::{new_id, Timer};
use crate::protocol::{parse_off_async, parse_plain};
use crate::request_span::Arrival;
use crate::state::SharedState;

/// The body. Unknown fields are ignored, as OpenAI's own and vLLM's servers do (`user`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: Option<Value>,
    pub encoding_format: Option<String>,
    pub dimensions: Option<i64>,
}

pub async fn embeddings(State(state): State<SharedState>, headers: HeaderMap, body: Bytes) -> Response {
    let arrival = Arrival::new(&state, &headers);
    respond(&state, run(&state, arrival, body).await)
}

async fn run(state: &SharedState, arrival: Arrival, body: Bytes) -> ApiResult<Response> {
    let model = state.model()?;
    let req: EmbeddingRequest = parse_off_async(body, parse_plain).await?;
    check_model(state, req.model.as_deref())?;
    let Some(config) = state.cfg.pooler else {
        return Err(ApiError::invalid(
            "model",
            "this server generates text and does not serve embeddings: start it with `flint serve --runner pooling` \
             (optionally `--pooler-config '{\"pooling_type\": \"MEAN\"}'`) to serve /v1/embeddings",
        ));
    };
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    let dimensions = match req.dimensions {
        None => None,
        Some(d) if d >= 1 && d as u64 <= model.hidden_size as u64 => Some(d as usize),
        Some(d) => {
            return Err(ApiError::invalid(
                "dimensions",
                format!("`dimensions` must be between 1 and the model's {} dimensions, got {d}", model.hidden_size),
            ))
        }
    };
    let inputs = parse_prompts(req.input).map_err(|e| rename(e, "input"))?;
    if inputs.len() > MAX_PROMPTS {
        return Err(ApiError::invalid("input", format!("at most {MAX_PROMPTS} inputs, got {}", inputs.len())));
    }
    let mut guard = state.admit(&model, inputs.len(), "input")?;
    let m = model.clone();
    let inputs = tokio::task::spawn_blocking(move || tokenize(&m, inputs))
        .await
        .map_err(|_| ApiError::internal("input tokenization panicked"))?
        .map_err(|e| rename(e, "input"))?;
    let params =
        RequestParams { max_tokens: 0, pooling: Some(PoolingParams { config, dimensions }), ..Default::default() };
    let id = new_id("embd");
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let mut jobs = submit(&model, &id, inputs, &params, "input", &mut guard)?;
    let mut timer = Timer::new(&arrival, jobs.len());
    let choices = collect(state, &mut jobs, 1, &mut timer, &mut guard).await?;
    let mut data = Vec::with_capacity(choices.len());
    for (index, c) in choices.into_iter().enumerate() {
        let v = c.embedding.ok_or_else(|| ApiError::internal("an input ended without its embedding"))?;
        let embedding = if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            EmbeddingVector::Float(v)
        };
        data.push(EmbeddingData { object: "embedding", index, embedding });
    }
    let usage = EmbeddingUsage { prompt_tokens, total_tokens: prompt_tokens };
    let list = EmbeddingList { object: "list", data, model: state.cfg.served_model_name.clone(), usage };
    Ok(Json(list).into_response())
}

/// The completions helpers name their parameter `prompt`; here it is `input`.
fn rename(mut e: ApiError, param: &'static str) -> ApiError {
    if e.param.as_deref() == Some("prompt") {
        e.param = Some(param.into());
        e.message = e.message.replace("`prompt`", "`input`").replace("a prompt", "an input");
    }
    e
}
