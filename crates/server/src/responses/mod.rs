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
use serde_json::{json, Value};

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
    respond(&state, run(&state, arrival, &body).await)
}

/// The response object, at creation (`in_progress`, no output) or at the end.
struct Envelope {
    id: String,
    created: u64,
    model: String,
    request: Value,
}

impl Envelope {
    fn object(&self, status: &str, output: Vec<Value>, usage: Option<Value>, incomplete: bool) -> Value {
        let r = &self.request;
        let get = |k: &str| r.get(k).cloned().unwrap_or(Value::Null);
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": null,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": get("instructions"),
            "max_output_tokens": get("max_output_tokens"),
            "temperature": r.get("temperature").cloned().unwrap_or(json!(1.0)),
            "top_p": r.get("top_p").cloned().unwrap_or(json!(1.0)),
            "tools": r.get("tools").cloned().unwrap_or(json!([])),
            "tool_choice": r.get("tool_choice").cloned().unwrap_or(json!("auto")),
            "parallel_tool_calls": r.get("parallel_tool_calls").cloned().unwrap_or(json!(true)),
            "text": r.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
            "reasoning": {"effort": null, "summary": null},
            "store": false,
            "previous_response_id": null,
            "truncation": "disabled",
            "metadata": r.get("metadata").cloned().unwrap_or(json!({})),
            "usage": usage,
        })
    }
}

fn usage(prompt: usize, output: usize, cached: usize, reasoning: usize) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + output,
    })
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": [text_part(text)]})
}

fn call_item(call: &ToolCall, status: &str, arguments: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", call.id.trim_start_matches("call_")), "call_id": call.id,
        "name": call.name, "arguments": arguments, "status": status})
}

async fn run(state: &SharedState, arrival: Arrival, body: &[u8]) -> ApiResult<Response> {
    let model = state.model()?;
    let request = crate::protocol::body_object(body)?;
    let req = to_chat(&request)?;
    let stream = request.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let PreparedChat { prompt, params, parse_tools, mut guard, .. } =
        prepare(state, &model, req).await.map_err(rename)?;
    let reasoning = state.cfg.reasoning_parser;
    let id = new_id("resp");
    let prompt_len = prompt.len();
    let mut jobs = submit(&model, &id, vec![prompt], &params, "input", &mut guard)?;
    let mut timer = Timer::new(&arrival, 1);
    timer.trace(&arrival, &id, &params, &state.cfg.served_model_name);
    let env = Envelope { id: id.clone(), created: now_unix(), model: state.cfg.served_model_name.clone(), request };
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
    let u = usage(prompt_len, c.token_ids.len(), c.cached_tokens, reasoning_tokens);
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
    Ok(Json(env.object(status, output, Some(u), incomplete)).into_response())
}
