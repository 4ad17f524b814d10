//! `POST /v1/responses`: OpenAI's Responses API, as the openai SDK's `client.responses.create`
//! and newer agent frameworks call it. Stateless: nothing is stored, so `previous_response_id`
//! (and `store: true`) are refused. A request is translated into a chat request — `instructions`
//! and `input` items into messages (`function_call` / `function_call_output` into the assistant's
//! tool calls and tool results), `text.format` into `response_format`, flat function tools into
//! chat tools — and runs through the chat path (`chat::prepare`): the same template, validation,
//! constraints, tool parsing and reasoning split. Output comes back as typed items (`reasoning`,
//! `message`, `function_call`), streamed as the API's typed events.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use flint_engine::{FinishReason, SampleOutput};
use serde_json::{json, Map, Value};

use crate::chat::{prepare, PreparedChat};
use crate::error::{ApiError, ApiResult};
use crate::generation::{collect, respond, sse, submit, Formatter, StreamCtx};
use crate::output::{new_id, now_unix, Outcome, Timer};
use crate::protocol::{parse_request, ChatRequest};
use crate::reasoning::{ReasoningSplit, Split};
use crate::request_span::Arrival;
use crate::state::SharedState;
use crate::tools::{extract, ToolCall, ToolStream};

pub async fn responses(State(state): State<SharedState>, headers: HeaderMap, body: Bytes) -> Response {
    let arrival = Arrival::new(&state, &headers);
    respond(&state, run(&state, arrival, &body).await)
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

/// Text of a message's content: a string, or a list of `input_text` / `output_text` parts.
fn content_text(i: usize, c: &Value) -> ApiResult<String> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(
                            "input",
                            format!(
                                "input[{i}]: content part type {:?} is not supported (text only)",
                                kind.unwrap_or("?")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad("input", format!("input[{i}]: `content` must be a string or a list of text parts"))),
    }
}

/// `instructions` and `input` as chat messages.
fn messages(v: &Value) -> ApiResult<Vec<Value>> {
    let mut out = Vec::new();
    match v.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(bad("instructions", "`instructions` must be a string")),
    }
    let items = match v.get("input") {
        Some(Value::String(s)) => return Ok([out, vec![json!({"role": "user", "content": s})]].concat()),
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) => return Err(bad("input", "`input` is required")),
        Some(_) => return Err(bad("input", "`input` must be a string or a list of items")),
    };
    for (i, item) in items.iter().enumerate() {
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        let field = |k: &str| -> ApiResult<String> {
            item.get(k)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| bad("input", format!("input[{i}] ({kind}): `{k}` must be a string")))
        };
        match kind {
            "message" => {
                let role = field("role")?;
                if !["user", "system", "developer", "assistant"].contains(&role.as_str()) {
                    return Err(bad("input", format!("input[{i}]: unknown role {role:?}")));
                }
                let content = content_text(i, item.get("content").unwrap_or(&Value::Null))?;
                out.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call = json!({"id": field("call_id")?, "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls of one turn gather on one assistant message, as chat clients send them.
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
                            calls.push(call);
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => {
                        return Err(bad("input", format!("input[{i}] (function_call_output): `output` is required")))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": field("call_id")?, "content": output}));
            }
            // The template drops earlier reasoning from the prompt anyway.
            "reasoning" => {}
            "item_reference" => {
                return Err(bad(
                    "input",
                    format!("input[{i}]: item references need stored responses; flint stores none"),
                ))
            }
            other => return Err(bad("input", format!("input[{i}]: item type {other:?} is not supported"))),
        }
    }
    Ok(out)
}

/// Function tools, flat as the Responses API defines them, in chat's nested shape.
fn tools(v: &Value) -> ApiResult<Option<Value>> {
    let Some(list) = v.get("tools").filter(|t| !t.is_null()) else { return Ok(None) };
    let list = list.as_array().ok_or_else(|| bad("tools", "`tools` must be a list"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut f = Map::new();
                for k in ["name", "description", "parameters", "strict"] {
                    if let Some(x) = t.get(k).filter(|x| !x.is_null()) {
                        f.insert(k.into(), x.clone());
                    }
                }
                out.push(json!({"type": "function", "function": f}));
            }
            other => {
                return Err(bad(
                    "tools",
                    format!("tools[{i}]: type {:?} is not supported (function only)", other.unwrap_or("?")),
                ))
            }
        }
    }
    Ok(Some(Value::Array(out)))
}

fn tool_choice(v: &Value) -> ApiResult<Option<Value>> {
    match v.get("tool_choice") {
        None | Some(Value::Null) => Ok(None),
        Some(s @ Value::String(_)) => Ok(Some(s.clone())),
        Some(o @ Value::Object(_)) => {
            match (o.get("type").and_then(Value::as_str), o.get("name").and_then(Value::as_str)) {
                (Some("function"), Some(name)) => Ok(Some(json!({"type": "function", "function": {"name": name}}))),
                _ => Err(bad(
                    "tool_choice",
                    format!("`tool_choice` {o} must be a mode or {{\"type\": \"function\", \"name\": …}}"),
                )),
            }
        }
        Some(other) => Err(bad("tool_choice", format!("`tool_choice` {other} is not valid"))),
    }
}

/// `text.format` as chat's `response_format`.
fn response_format(v: &Value) -> ApiResult<Option<Value>> {
    let Some(f) = v.pointer("/text/format").filter(|f| !f.is_null()) else { return Ok(None) };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut js = Map::new();
            for k in ["name", "schema", "strict", "description"] {
                if let Some(x) = f.get(k) {
                    js.insert(k.into(), x.clone());
                }
            }
            if !js.contains_key("schema") {
                return Err(bad("text", "`text.format.schema` is required for json_schema"));
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        other => Err(bad("text", format!("`text.format.type` {:?} is not supported", other.unwrap_or("?")))),
    }
}

/// The chat request a Responses request stands for; refuses what a stateless server cannot do.
fn to_chat(v: &Value) -> ApiResult<ChatRequest> {
    if v.get("previous_response_id").is_some_and(|p| !p.is_null()) {
        return Err(bad(
            "previous_response_id",
            "flint stores no responses (store: false); send the whole conversation as `input` instead",
        ));
    }
    if v.get("conversation").is_some_and(|p| !p.is_null()) {
        return Err(bad("conversation", "flint stores no conversations; send the whole conversation as `input`"));
    }
    if v.get("store") == Some(&Value::Bool(true)) {
        return Err(bad("store", "flint does not store responses; send `store: false` (or leave it out)"));
    }
    if v.get("background") == Some(&Value::Bool(true)) {
        return Err(bad("background", "background responses need storage; flint answers in the foreground"));
    }
    if let Some(t) = v.get("truncation").and_then(Value::as_str).filter(|t| *t != "disabled") {
        return Err(bad("truncation", format!("`truncation` {t:?} is not supported; a prompt too long is a 400")));
    }
    let mut chat = json!({"messages": messages(v)?});
    for (from, to) in [
        ("model", "model"),
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("seed", "seed"),
        ("top_logprobs", "top_logprobs"),
    ] {
        if let Some(x) = v.get(from).filter(|x| !x.is_null()) {
            chat[to] = x.clone();
        }
    }
    if chat.get("top_logprobs").is_some() {
        chat["logprobs"] = json!(true);
    }
    if let Some(t) = tools(v)? {
        chat["tools"] = t;
    }
    if let Some(t) = tool_choice(v)? {
        chat["tool_choice"] = t;
    }
    if let Some(f) = response_format(v)? {
        chat["response_format"] = f;
    }
    let bytes = serde_json::to_vec(&chat).map_err(|e| ApiError::internal(e.to_string()))?;
    parse_request(&bytes).map_err(rename)
}

/// A chat field's error, named as the Responses API names the field.
fn rename(mut e: ApiError) -> ApiError {
    let renamed = match e.param.as_deref() {
        Some("messages") => "input",
        Some("max_tokens") => "max_output_tokens",
        Some("response_format") => "text",
        _ => return e,
    };
    e.param = Some(renamed.into());
    e
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
        let fmt = ResponsesStream {
            env,
            seq: 0,
            parse_tools,
            reasoning: reasoning.map(ReasoningSplit::new),
            tools: ToolStream::default(),
            open: Open::None,
            output: Vec::new(),
            completion: 0,
            cached: 0,
            finish: None,
        };
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

/// The output item being streamed.
enum Open {
    None,
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
}

struct ResponsesStream {
    env: Envelope,
    /// `sequence_number` of the next event.
    seq: u64,
    parse_tools: bool,
    reasoning: Option<ReasoningSplit>,
    tools: ToolStream,
    open: Open,
    /// Finished output items, in order.
    output: Vec<Value>,
    completion: usize,
    cached: usize,
    finish: Option<FinishReason>,
}

impl ResponsesStream {
    fn ev(&mut self, kind: &str, mut body: Value) -> Value {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        body
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    /// Close the open item: its `done` events, and it joins the output.
    fn close(&mut self, out: &mut Vec<Value>) {
        let i = self.index();
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => {}
            Open::Reasoning { id, text } => {
                let e = self.ev(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "text": text}),
                );
                out.push(e);
                let item = reasoning_item(&id, &text);
                let e = self.ev("response.output_item.done", json!({"output_index": i, "item": item}));
                out.push(e);
                self.output.push(item);
            }
            Open::Message { id, text } => {
                let e = self.ev(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "text": text, "logprobs": []}),
                );
                out.push(e);
                let e = self.ev(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": i, "content_index": 0, "part": text_part(&text)}),
                );
                out.push(e);
                let item = message_item(&id, &text, "completed");
                let e = self.ev("response.output_item.done", json!({"output_index": i, "item": item}));
                out.push(e);
                self.output.push(item);
            }
        }
    }

    fn reasoning_delta(&mut self, delta: &str, out: &mut Vec<Value>) {
        if !matches!(self.open, Open::Reasoning { .. }) {
            self.close(out);
            let id = new_id("rs");
            let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress"});
            let e = self.ev("response.output_item.added", json!({"output_index": self.index(), "item": item}));
            out.push(e);
            self.open = Open::Reasoning { id, text: String::new() };
        }
        let i = self.index();
        if let Open::Reasoning { id, text } = &mut self.open {
            text.push_str(delta);
            let id = id.clone();
            let e = self.ev(
                "response.reasoning_text.delta",
                json!({"item_id": id, "output_index": i, "content_index": 0, "delta": delta}),
            );
            out.push(e);
        }
    }

    fn text_delta(&mut self, delta: &str, out: &mut Vec<Value>) {
        if !matches!(self.open, Open::Message { .. }) {
            self.close(out);
            let id = new_id("msg");
            let item =
                json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []});
            let i = self.index();
            let e = self.ev("response.output_item.added", json!({"output_index": i, "item": item}));
            out.push(e);
            let e = self.ev(
                "response.content_part.added",
                json!({"item_id": id, "output_index": i, "content_index": 0, "part": text_part("")}),
            );
            out.push(e);
            self.open = Open::Message { id, text: String::new() };
        }
        let i = self.index();
        if let Open::Message { id, text } = &mut self.open {
            text.push_str(delta);
            let id = id.clone();
            let e = self.ev(
                "response.output_text.delta",
                json!({"item_id": id, "output_index": i, "content_index": 0, "delta": delta, "logprobs": []}),
            );
            out.push(e);
        }
    }

    fn call(&mut self, call: &ToolCall, out: &mut Vec<Value>) {
        self.close(out);
        let i = self.index();
        let added = call_item(call, "in_progress", "");
        let item_id = added["id"].clone();
        let e = self.ev("response.output_item.added", json!({"output_index": i, "item": added}));
        out.push(e);
        let e = self.ev(
            "response.function_call_arguments.delta",
            json!({"item_id": item_id, "output_index": i, "delta": call.arguments}),
        );
        out.push(e);
        let e = self.ev(
            "response.function_call_arguments.done",
            json!({"item_id": item_id, "output_index": i, "arguments": call.arguments}),
        );
        out.push(e);
        let item = call_item(call, "completed", &call.arguments);
        let e = self.ev("response.output_item.done", json!({"output_index": i, "item": item}));
        out.push(e);
        self.output.push(item);
    }
}

impl Formatter for ResponsesStream {
    fn prelude(&mut self, _ctx: &StreamCtx) -> Vec<Value> {
        let r = self.env.object("in_progress", Vec::new(), None, false);
        let created = self.ev("response.created", json!({"response": r}));
        let progress = self.ev("response.in_progress", json!({"response": r}));
        vec![created, progress]
    }

    fn on_output(&mut self, ctx: &StreamCtx, _job: usize, o: SampleOutput) -> Vec<Value> {
        self.completion += o.token_ids.len();
        self.cached = o.cached_tokens;
        let mut out = Vec::new();
        let Split { reasoning: thought, content: text } = match self.reasoning.as_mut() {
            Some(r) => r.take(&ctx.model.tokenizer, &o.token_ids, &o.text, o.finished.is_some()),
            None => Split { reasoning: String::new(), content: o.text.clone() },
        };
        if !thought.is_empty() {
            self.reasoning_delta(&thought, &mut out);
        }
        let (mut content, mut calls) = (text.clone(), Vec::new());
        if self.parse_tools {
            let d = self.tools.push(&text, &ctx.id, 0);
            (content, calls) = (d.content, d.calls);
            if o.finished.is_some() {
                content.push_str(&self.tools.finish());
            }
        }
        if !content.is_empty() {
            self.text_delta(&content, &mut out);
        }
        for call in &calls {
            self.call(call, &mut out);
        }
        if let Some(f) = &o.finished {
            self.finish = Some(f.reason);
            if self.output.is_empty() && matches!(self.open, Open::None) && calls.is_empty() {
                // An empty answer is still a message.
                self.text_delta("", &mut out);
            }
            self.close(&mut out);
        }
        out
    }

    fn summary(&self) -> (usize, usize, &'static str) {
        let reason = if self.finish == Some(FinishReason::Length) { "length" } else { "stop" };
        (self.completion, self.cached, reason)
    }

    fn epilogue(&mut self, ctx: &StreamCtx, _usage: &Value) -> Vec<Value> {
        let incomplete = self.finish == Some(FinishReason::Length);
        let reasoning = self.reasoning.as_ref().map_or(0, ReasoningSplit::reasoning_tokens);
        let u = usage(ctx.prompt_tokens, self.completion, self.cached, reasoning);
        let (status, kind) =
            if incomplete { ("incomplete", "response.incomplete") } else { ("completed", "response.completed") };
        let r = self.env.object(status, self.output.clone(), Some(u), incomplete);
        vec![self.ev(kind, json!({"response": r}))]
    }

    fn done_marker(&self) -> bool {
        false
    }

    fn event_name(&self, chunk: &Value) -> Option<String> {
        chunk.get("type").and_then(Value::as_str).map(str::to_string)
    }

    fn error_event(&mut self, e: &ApiError) -> Value {
        self.ev("error", json!({"code": e.code, "message": e.message, "param": e.param}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> ApiResult<ChatRequest> {
        to_chat(&v)
    }

    #[test]
    fn input_items_become_messages() {
        let v = json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "22C"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 22C."}]}
            ]
        });
        let m = messages(&v).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1]["content"], "Weather?");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2, "one turn's calls on one message");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "c1", "content": "22C"}));
        assert_eq!(m[4]["content"], "It is 22C.");
        assert_eq!(messages(&json!({"input": "Hi"})).unwrap(), vec![json!({"role": "user", "content": "Hi"})]);
    }

    #[test]
    fn fields_map_to_chat_and_refusals_name_theirs() {
        let c = chat(json!({"input": "Hi", "max_output_tokens": 7, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "f"}}))
        .unwrap();
        assert_eq!(c.common.max_tokens, Some(7));
        assert_eq!(c.common.response_format.as_ref().unwrap()["json_schema"]["schema"], json!({"type": "object"}));
        assert_eq!(c.tools.as_ref().unwrap()[0]["function"]["strict"], true);
        assert_eq!(c.tool_choice.as_ref().unwrap()["function"]["name"], "f");
        let param = |v: Value| chat(v).err().and_then(|e| e.param);
        assert_eq!(
            param(json!({"input": "Hi", "previous_response_id": "resp_1"})).as_deref(),
            Some("previous_response_id")
        );
        assert_eq!(param(json!({"input": "Hi", "store": true})).as_deref(), Some("store"));
        assert_eq!(param(json!({"input": "Hi", "tools": [{"type": "web_search"}]})).as_deref(), Some("tools"));
        assert_eq!(param(json!({"input": [{"type": "item_reference", "id": "x"}]})).as_deref(), Some("input"));
        assert_eq!(
            param(json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})).as_deref(),
            Some("input")
        );
        assert_eq!(param(json!({})).as_deref(), Some("input"));
        assert_eq!(param(json!({"input": "Hi", "max_output_tokens": "x"})).as_deref(), Some("max_output_tokens"));
        assert!(chat(json!({"input": "Hi", "store": false})).is_ok());
    }
}
