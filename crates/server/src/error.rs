//! One error type for the API, converted once into an HTTP status and OpenAI's envelope
//! `{"error": {"message", "type", "param", "code"}}` (or a final SSE event mid-stream).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use flint_engine::scheduler::AdmissionError;
use flint_engine::{EngineError, InvalidParam, Param};
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 and 503).
    pub retry_after: Option<u64>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// 400 for a bad value; `param` names the field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            code: Some("invalid_value"),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400 for an output constraint that the grammar engine refused while generating: the
    /// constraint is the client's (flint checks what it can when it compiles one).
    pub fn constraint_failed(message: impl Into<String>) -> Self {
        Self { code: Some("invalid_value"), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    /// 400 for a body that is not the JSON the endpoint expects.
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self {
            code: Some("invalid_request_error"),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn context_length(message: impl Into<String>, param: &str) -> Self {
        Self {
            param: Some(param.to_string()),
            code: Some("context_length_exceeded"),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
            )
        }
    }

    pub fn model_not_found(requested: &str, served: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("The model `{requested}` does not exist. This server serves `{served}`."),
            )
        }
    }

    pub fn route_not_found(path: &str) -> Self {
        Self {
            code: Some("not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("No route for {path}."))
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("The request body exceeds the limit of {limit} bytes."),
            )
        }
    }

    pub fn overloaded(queued: usize) -> Self {
        Self {
            code: Some("server_overloaded"),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "server_overloaded",
                format!("The server is at capacity ({queued} requests queued); retry later."),
            )
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            code: Some("service_unavailable"),
            retry_after: Some(5),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", message)
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self { code: Some("internal_error"), ..Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message) }
    }

    /// The JSON body, also sent as the final event of a stream that failed after it began.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    /// The failure counter's reason label.
    pub fn failure_reason(&self) -> &'static str {
        match self.status {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => "overloaded",
            s if s.is_client_error() => "validation",
            _ => "internal",
        }
    }

    /// An engine refusal, by its type: a parameter the engine's rules reject names that
    /// parameter (as this endpoint spells it; `prompt_param` is its prompt's field).
    pub fn from_engine(e: EngineError, prompt_param: &str) -> Self {
        match e {
            EngineError::InvalidParam(p) => Self::from_param(p, prompt_param),
            EngineError::Admission(a @ AdmissionError::ContextLength { .. }) => {
                Self::context_length(a.to_string(), prompt_param)
            }
            EngineError::Admission(a @ AdmissionError::PoolTooSmall { .. }) => {
                Self::invalid("max_tokens", a.to_string())
            }
            EngineError::Admission(a) => Self::invalid(prompt_param, a.to_string()),
            EngineError::Unavailable(m) => Self::unavailable(m),
            EngineError::InvalidRequest(m) => Self::invalid(prompt_param, m),
            EngineError::Tokenizer(t) => Self::invalid(prompt_param, t.to_string()),
            EngineError::ChatTemplate(t) => Self::invalid("messages", t.to_string()),
            e => Self::internal(e.to_string()),
        }
    }

    /// A parameter the engine's rules reject, named as the endpoint spells it: chat's count of
    /// top logprobs is `top_logprobs`, and the prompt is `prompt`, `messages` or `input`.
    pub fn from_param(e: InvalidParam, prompt_param: &str) -> Self {
        let field = match e.param {
            Param::Prompt => prompt_param,
            Param::Logprobs if prompt_param != "prompt" => "top_logprobs",
            p => p.name(),
        };
        Self::invalid(field, e.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}
