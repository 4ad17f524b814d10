//! `POST /v1/responses`: OpenAI's Responses API, as the openai SDK's `client.responses.create`
//! and newer agent frameworks call it. Stateless: nothing is stored, so `previous_response_id`
//! (and `store: true`) are refused. A request is translated into a chat request (`request`)
//! and runs through the chat path (`chat::prepare`): the same template, validation, constraints,
//! tool parsing and reasoning split. Output comes back as typed items (`reasoning`, `message`,
//! `function_call`): here as one response object, or streamed as the API's typed events
//! (`stream`).

mod request;
mod stream;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use flint_engine::FinishReason;
use serde_json::{json, Map, Value};

use crate::api_types::responses::{
    ContentPart, IncompleteDetails, OutputItem, ReasoningConfig, ReasoningContent, ResponseObject, ResponseUsage,
};
use crate::api_types::Null;
use crate::chat::{prepare, PreparedChat};
use crate::error::ApiResult;
use crate::generation::{collect, respond, sse, submit, StreamCtx};
use crate::output::{new_id, now_unix, Outcome, Timer};
use crate::reasoning::ReasoningSplit;
use crate::request_span::Arrival;
use crate::state::SharedState;
use crate::tools::{extract, ToolCall};
use request::{rename, to_chat};
use stream::ResponsesStream;

pub async fn responses(State(state): State<SharedState>, headers: HeaderMap, body: Bytes) -> Response {
    let arrival = Arrival::new(&state, &headers);
    respond(&state, run(&state, arrival, body).await)
}

/// What every response object of a request shares: its id and the request's settings, echoed
/// as the client sent them or as their defaults.
struct Envelope {
    id: String,
    created: u64,
    model: String,
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: Value,
    text: Value,
    metadata: Value,
}

impl Envelope {
    fn new(id: String, created: u64, model: String, request: &Value) -> Self {
        let get = |k: &str, default: Value| request.get(k).cloned().unwrap_or(default);
        Self {
            id,
            created,
            model,
            instructions: get("instructions", Value::Null),
            max_output_tokens: get("max_output_tokens", Value::Null),
            temperature: get("temperature", Value::from(1.0)),
            top_p: get("top_p", Value::from(1.0)),
            tools: get("tools", Value::Array(Vec::new())),
            tool_choice: get("tool_choice", Value::from("auto")),
            parallel_tool_calls: get("parallel_tool_calls", Value::Bool(true)),
            text: get("text", json!({"format": {"type": "text"}})),
            metadata: get("metadata", Value::Object(Map::new())),
        }
    }

    /// The response object, at creation (`in_progress`, no output) or at the end (`completed`,
    /// or `incomplete` when it ran out of `max_output_tokens`).
    fn object<'a>(
        &'a self,
        status: &'static str,
        output: &'a [OutputItem],
        usage: Option<ResponseUsage>,
    ) -> ResponseObject<'a> {
        ResponseObject {
            id: &self.id,
            object: "response",
            created_at: self.created,
            status,
            model: &self.model,
            output,
            error: Null,
            incomplete_details: (status == "incomplete").then_some(IncompleteDetails { reason: "max_output_tokens" }),
            instructions: &self.instructions,
            max_output_tokens: &self.max_output_tokens,
            temperature: &self.temperature,
            top_p: &self.top_p,
            tools: &self.tools,
            tool_choice: &self.tool_choice,
            parallel_tool_calls: &self.parallel_tool_calls,
            text: &self.text,
            reasoning: ReasoningConfig::default(),
            store: false,
            previous_response_id: Null,
            truncation: "disabled",
            metadata: &self.metadata,
            usage,
        }
    }
}

fn reasoning_item(id: &str, text: &str) -> OutputItem {
    OutputItem::Reasoning {
        id: id.to_string(),
        summary: [],
        content: vec![ReasoningContent::ReasoningText { text: text.to_string() }],
        status: "completed",
    }
}

fn message_item(id: &str, text: &str, status: &'static str) -> OutputItem {
    OutputItem::Message { id: id.to_string(), status, role: "assistant", content: vec![ContentPart::text(text)] }
}

/// A function call item's own id, after its call's.
fn call_item_id(call: &ToolCall) -> String {
    format!("fc_{}", call.id.trim_start_matches("call_"))
}

fn call_item(call: &ToolCall, status: &'static str, arguments: &str) -> OutputItem {
    OutputItem::FunctionCall {
        id: call_item_id(call),
        call_id: call.id.clone(),
        name: call.name.clone(),
        arguments: arguments.to_string(),
        status,
    }
}

async fn run(state: &SharedState, arrival: Arrival, body: Bytes) -> ApiResult<Response> {
    let model = state.model()?;
    let (request, req) = crate::protocol::parse_off_async(body, |b| {
        let request = crate::protocol::body_object(b)?;
        let req = to_chat(&request)?;
        Ok((request, req))
    })
    .await
    .map_err(rename)?;
    let stream = request.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let PreparedChat { prompt, params, parse_tools, mut guard, .. } =
        prepare(state, &model, req).await.map_err(rename)?;
    let reasoning = state.cfg.reasoning_parser;
    let id = new_id("resp");
    let prompt_len = prompt.len();
    let mut jobs = submit(&model, &id, vec![prompt], &params, "input", &mut guard)?;
    let mut timer = Timer::new(&arrival, 1);
    timer.trace(&arrival, &id, &params, &state.cfg.served_model_name);
    let env = Envelope::new(id.clone(), now_unix(), state.cfg.served_model_name.clone(), &request);
    if stream {
        let ctx = StreamCtx {
            state: state.clone(),
            model: model.clone(),
            id: id.clone(),
            created: env.created,
            n: 1,
            include_usage: false,
            prompt_tokens: prompt_len,
            object: "response",
        };
        let fmt = ResponsesStream::new(env, parse_tools, reasoning.map(ReasoningSplit::new));
        return Ok(sse(ctx, jobs, guard, timer, Box::new(fmt)));
    }
    let choices = collect(state, &mut jobs, 1, &mut timer, &mut guard).await?;
    let c = choices.into_iter().next().unwrap_or_default();
    let (text, thought, reasoning_tokens) = match reasoning {
        Some(p) => {
            let (split, n) = ReasoningSplit::split_all(p, &model.tokenizer, &c.text, &c.token_ids);
            (split.content, split.reasoning, n)
        }
        None => (c.text.clone(), String::new(), 0),
    };
    let (content, calls) = if parse_tools { extract(&text, &id, 0) } else { (Some(text), Vec::new()) };
    let mut output = Vec::new();
    if !thought.is_empty() {
        output.push(reasoning_item(&new_id("rs"), &thought));
    }
    if let Some(t) = content.filter(|t| !t.is_empty() || calls.is_empty()) {
        output.push(message_item(&new_id("msg"), &t, "completed"));
    }
    output.extend(calls.iter().map(|call| call_item(call, "completed", &call.arguments)));
    let incomplete = c.finished.as_ref().is_some_and(|f| f.reason == FinishReason::Length);
    let usage = ResponseUsage::new(prompt_len, c.token_ids.len(), c.cached_tokens, reasoning_tokens);
    let status = if incomplete { "incomplete" } else { "completed" };
    let reason = if incomplete { "length" } else { "stop" };
    let outcome = Outcome {
        id: &id,
        prompt_tokens: prompt_len,
        completion_tokens: c.token_ids.len(),
        cached_tokens: c.cached_tokens,
        sequences: 1,
        reason,
    };
    timer.finish(&state.metrics, outcome);
    Ok(Json(env.object(status, &output, Some(usage))).into_response())
}
