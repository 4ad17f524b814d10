//! The router: API-key check, body limit, the small endpoints (health, models, version, metrics,
//! tokenize, detokenize) and the OpenAI-shaped 404 for unknown routes.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api_types::misc::{
    DetokenizeResponse, FaultInjected, Health, ModelCard, ModelList, TokenizeResponse, TokenizerInfo, Version,
    WorkerHealth,
};
use crate::chat::{chat_completions, check_model, normalize_messages};
use crate::completions::completions;
use crate::error::{ApiError, ApiResult};
use crate::generation::respond;
use crate::prompt_tokens::encode_bounded;
use crate::protocol::parse_body;
use crate::state::SharedState;

pub fn router(state: SharedState) -> Router {
    let hooks = if state.cfg.test_hooks {
        Router::new().route("/debug/workers/{index}/fault", post(fault_worker))
    } else {
        Router::new()
    };
    hooks
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(crate::responses::responses))
        .route("/v1/embeddings", post(crate::embeddings::embeddings))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/version", get(version))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost first on the way in: the API key, then the body (never read for a client
        // without the key).
        .layer(middleware::from_fn_with_state(state.clone(), crate::body::read_body))
        // The body middleware already enforces the limit; the extractors must not apply their
        // own smaller default on top.
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Constant-time comparison: the time taken does not reveal how much of a guessed key matched.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}

/// API key on every route but `/health` and `/metrics`: probes and scrapers (Kubernetes, an
/// inference gateway's endpoint picker, Prometheus) carry no credentials, and vLLM asks for the
/// key on its `/v1` routes only.
async fn guard(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.cfg.api_key {
        if !matches!(req.uri().path(), "/health" | "/metrics") {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            if !same_key(given.trim().as_bytes(), key.as_bytes()) {
                state.metrics.failed("validation");
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

async fn not_found(uri: Uri) -> Response {
    ApiError::route_not_found(uri.path()).into_response()
}

async fn method_not_allowed(uri: Uri) -> Response {
    let mut e = ApiError::route_not_found(uri.path());
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e.message = format!("Method not allowed for {}.", uri.path());
    e.code = Some("method_not_allowed");
    e.into_response()
}

/// 200 while any worker serves (`"degraded"` when some have stopped), 503 otherwise.
async fn health(State(state): State<SharedState>) -> Response {
    match state.model() {
        Ok(m) => {
            let workers =
                m.router.workers().into_iter().map(|w| WorkerHealth { name: w.name, healthy: w.healthy }).collect();
            let (live, total) = m.router.live_workers();
            let status = if live == total { "ok" } else { "degraded" };
            (StatusCode::OK, Json(Health { status, workers })).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// Test hook (`--enable-test-hooks` only): worker `i`'s step loop panics, as a bug would.
async fn fault_worker(State(state): State<SharedState>, Path(i): Path<usize>) -> Response {
    let m = match state.model_for_shutdown() {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    match m.router.inject_fault(i) {
        Ok(()) => (StatusCode::ACCEPTED, Json(FaultInjected { worker: i, fault: "injected" })).into_response(),
        Err(e) => ApiError::invalid("worker", e.to_string()).into_response(),
    }
}

async fn version(State(state): State<SharedState>) -> Json<Version> {
    let devices = state.model().ok().map(|m| m.devices.clone());
    Json(Version { version: env!("CARGO_PKG_VERSION"), devices })
}

async fn models(State(state): State<SharedState>) -> Response {
    let max_model_len = state.model().ok().map(|m| m.max_model_len);
    let card = ModelCard::new(&state.cfg.served_model_name, state.started_unix, max_model_len);
    Json(ModelList { object: "list", data: vec![card] }).into_response()
}

async fn model_by_id(State(state): State<SharedState>, Path(id): Path<String>) -> Response {
    if id != state.cfg.served_model_name {
        return ApiError::model_not_found(&id, &state.cfg.served_model_name).into_response();
    }
    let max_model_len = state.model().ok().map(|m| m.max_model_len);
    Json(ModelCard::new(&id, state.started_unix, max_model_len)).into_response()
}

async fn metrics(State(state): State<SharedState>) -> Response {
    // Also during the shutdown grace, while requests still run.
    let model = state.model_for_shutdown().ok();
    let stats = model.as_ref().map(|m| m.router.stats()).unwrap_or_default();
    let workers = model.as_ref().map(|m| m.router.workers()).unwrap_or_default();
    let compiles = model.as_ref().map(|m| m.router.grammars().compile_stats());
    let text = state.metrics.render(stats, workers, model.as_ref().map(|m| m.cache.clone()), compiles);
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    tools: Option<Vec<Value>>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    return_token_strs: Option<bool>,
}

/// Run request work that may take CPU time (rendering, tokenizing, detokenizing) on the blocking
/// pool, so `/health` and streams on the async workers never wait behind it.
async fn off_async<F, T>(state: &SharedState, work: F) -> Response
where
    F: FnOnce() -> ApiResult<T> + Send + 'static,
    T: Serialize + Send + 'static,
{
    let result = match tokio::task::spawn_blocking(work).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::internal("the request's worker panicked")),
    };
    respond(state, result.map(|v| Json(v).into_response()))
}

async fn tokenize(State(state): State<SharedState>, body: Bytes) -> Response {
    let st = state.clone();
    off_async(&state, move || {
        let model = st.model()?;
        let req: TokenizeRequest = parse_body(&body)?;
        check_model(&st, req.model.as_deref())?;
        crate::limits::check_tools(req.tools.as_deref().unwrap_or_default())?;
        let (text, rendered) = match (&req.prompt, &req.messages) {
            (Some(p), None) => (p.clone(), false),
            (None, Some(m)) => {
                let template = model
                    .chat_template
                    .as_ref()
                    .ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
                let tools = req.tools.as_ref().filter(|t| !t.is_empty()).map(|t| Value::Array(t.clone()));
                let kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
                let text = template
                    .render(&normalize_messages(m)?, tools.as_ref(), req.add_generation_prompt.unwrap_or(true), &kwargs)
                    .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
                (text, true)
            }
            _ => return Err(ApiError::invalid("prompt", "send exactly one of `prompt` or `messages`")),
        };
        let add_special = req.add_special_tokens.unwrap_or(!rendered);
        // Text the model could never take is refused as a prompt would be, without tokenizing it all.
        let param = if rendered { "messages" } else { "prompt" };
        let ids =
            encode_bounded(&model.tokenizer, &text, add_special, model.max_model_len).map_err(|e| e.into_api(param))?;
        let token_strs = req
            .return_token_strs
            .unwrap_or(false)
            .then(|| ids.iter().map(|&i| model.tokenizer.id_to_token(i)).collect());
        Ok(TokenizeResponse {
            count: ids.len(),
            max_model_len: model.max_model_len,
            tokens: ids,
            prompt: rendered.then_some(text),
            token_strs,
        })
    })
    .await
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    /// Required: a body without ids is a mistake, not an empty text.
    tokens: Vec<i64>,
}

async fn tokenizer_info(State(state): State<SharedState>) -> Response {
    let info = state.model().map(|m| {
        let template = m.chat_template.as_ref();
        let eos_ids = m.router.model_info().eos_token_ids.clone();
        // The template's own EOS (Qwen's `<|im_end|>`) is the one a chat turn ends with.
        let eos = template
            .and_then(|t| t.eos_token().map(str::to_string))
            .or_else(|| eos_ids.first().and_then(|&id| m.tokenizer.id_to_token(id)));
        TokenizerInfo {
            tokenizer_class: "PreTrainedTokenizerFast",
            eos_token: eos,
            bos_token: template.and_then(|t| t.bos_token().map(str::to_string)),
            pad_token: None,
            chat_template: template.map(|t| t.source().to_string()),
            model_max_length: m.max_model_len,
            vocab_size: m.tokenizer.len(),
            eos_token_ids: eos_ids,
        }
    });
    respond(&state, info.map(|i| Json(i).into_response()))
}

async fn detokenize(State(state): State<SharedState>, body: Bytes) -> Response {
    let st = state.clone();
    off_async(&state, move || {
        let model = st.model()?;
        let req: DetokenizeRequest = parse_body(&body)?;
        check_model(&st, req.model.as_deref())?;
        let vocab = model.router.model_info().vocab_size;
        let ids = req
            .tokens
            .iter()
            .map(|&t| {
                u32::try_from(t)
                    .ok()
                    .filter(|&t| (t as usize) < vocab)
                    .ok_or_else(|| ApiError::invalid("tokens", format!("{t} is not a token id of this model")))
            })
            .collect::<ApiResult<Vec<u32>>>()?;
        let text = model.tokenizer.decode(&ids, false).map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok(DetokenizeResponse { prompt: text })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::same_key;

    #[test]
    fn key_comparison() {
        assert!(same_key(b"secret", b"secret"));
        assert!(!same_key(b"secret", b"secreT"));
        assert!(!same_key(b"secret", b"secret1"));
        assert!(!same_key(b"", b"x"));
        assert!(same_key(b"", b""));
    }
}
