//! `POST /v1/chat/completions`: messages rendered with the model's chat template (tools passed
//! in, `<tool_call>` output parsed back), answered as JSON or as a stream of chunks.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use flint_engine::SampleOutput;
use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::generation::{collect, log_request, respond, sse, submit, Formatter, StreamCtx};
use crate::output::{chat_logprob, finish_reason, new_id, now_unix, stop_reason, usage, Timer};
use crate::prompt_tokens::encode_bounded;
use crate::protocol::{chat_logprobs, parse_request, ChatRequest};
use crate::state::{ServingModel, SharedState};
use crate::tools::{extract, ToolStream};

pub async fn chat_completions(State(state): State<SharedState>, body: Bytes) -> Response {
    respond(&state, run(&state, &body).await)
}

/// Check a request's `model` against the served name.
pub fn check_model(state: &SharedState, requested: Option<&str>) -> ApiResult<()> {
    match requested {
        Some(m) if m != state.cfg.served_model_name => Err(ApiError::model_not_found(m, &state.cfg.served_model_name)),
        _ => Ok(()),
    }
}

/// Validate the messages and shape them as the template expects: text parts joined, tool-call
/// arguments given as objects (Qwen templates `tojson` them).
pub fn normalize_messages(messages: &[Value]) -> ApiResult<Vec<Value>> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must contain at least one message"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let bad = |what: String| ApiError::invalid("messages", format!("messages[{i}]: {what}"));
        let Some(obj) = m.as_object() else { return Err(bad("must be an object".into())) };
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| bad("`role` is missing".into()))?;
        if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
            return Err(bad(format!("unknown role {role:?}")));
        }
        let mut msg = obj.clone();
        if role == "developer" {
            msg.insert("role".into(), json!("system"));
        }
        match obj.get("content") {
            // An assistant turn that only called tools has no content; templates expect a string.
            None | Some(Value::Null) => {
                msg.insert("content".into(), json!(""));
            }
            Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(bad(format!(
                                "content part type {:?} is not supported (text only)",
                                kind.unwrap_or("?")
                            )))
                        }
                    }
                }
                msg.insert("content".into(), json!(text));
            }
            Some(_) => return Err(bad("`content` must be a string or a list of text parts".into())),
        }
        if let Some(Value::Array(calls)) = obj.get("tool_calls") {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    if let Some(Value::String(a)) = c.pointer("/function/arguments").cloned() {
                        if let Ok(parsed) = serde_json::from_str::<Value>(&a) {
                            c["function"]["arguments"] = parsed;
                        }
                    }
                    c
                })
                .collect();
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

/// Whether output should be parsed for tool calls; refuses choices flint cannot enforce.
fn tool_mode(req: &ChatRequest) -> ApiResult<bool> {
    crate::limits::check_tools(req.tools.as_deref().unwrap_or_default())?;
    let has_tools = req.tools.as_ref().is_some_and(|t| !t.is_empty());
    match &req.tool_choice {
        None => Ok(has_tools),
        Some(Value::String(s)) if s == "auto" => Ok(has_tools),
        Some(Value::String(s)) if s == "none" => Ok(false),
        Some(other) => Err(ApiError::invalid(
            "tool_choice",
            format!(
                "`tool_choice` {other} is not supported: flint does not constrain decoding; use \"auto\" or \"none\""
            ),
        )),
    }
}

fn render_prompt(model: &ServingModel, req: &ChatRequest) -> ApiResult<Vec<u32>> {
    let template = model.chat_template.as_ref().ok_or_else(|| {
        ApiError::invalid("messages", "this model has no chat template; use /v1/completions with a prompt")
    })?;
    if let Some(f) = &req.response_format {
        if f.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::invalid("response_format", "only `{\"type\": \"text\"}` is supported"));
        }
    }
    let messages = normalize_messages(&req.messages)?;
    let tools = req.tools.as_ref().filter(|t| !t.is_empty()).map(|t| Value::Array(t.clone()));
    let continue_final = req.continue_final_message.unwrap_or(false);
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(!continue_final);
    if continue_final && add_generation_prompt {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` cannot both be true",
        ));
    }
    let kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    let mut text = template
        .render(&messages, tools.as_ref(), add_generation_prompt, &kwargs)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    if continue_final {
        // Cut after the final message's content so the model continues it.
        let last = messages.last().and_then(|m| m.get("content")).and_then(Value::as_str).unwrap_or("");
        if let Some(pos) = text.rfind(last).filter(|_| !last.is_empty()) {
            text.truncate(pos + last.len());
        }
    }
    encode_bounded(&model.tokenizer, &text, false, model.max_model_len).map_err(|e| e.into_api("messages"))
}

async fn run(state: &SharedState, body: &[u8]) -> ApiResult<Response> {
    let arrival = Instant::now();
    let model = state.model()?;
    let req: ChatRequest = parse_request(body)?;
    check_model(state, req.common.model.as_deref())?;
    let parse_tools = tool_mode(&req)?;
    // Everything cheap is checked before the prompt is rendered and tokenized, and the request
    // holds its place in the admission count while that runs.
    let mut params = req.common.to_params(model.engine.model_info().valid_vocab)?;
    params.logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
    req.common.max_tokens(0, model.max_model_len)?;
    let mut guard = state.admit(&model, params.n, "n")?;
    // Template rendering and tokenizing can take a while on big inputs: off the async workers.
    let m = model.clone();
    let (req, prompt) = tokio::task::spawn_blocking(move || {
        let prompt = render_prompt(&m, &req);
        (req, prompt)
    })
    .await
    .map_err(|_| ApiError::internal("prompt rendering panicked"))?;
    let prompt = prompt?;
    params.max_tokens = req.common.max_tokens(prompt.len(), model.max_model_len)?;
    let id = new_id("chatcmpl");
    let n = params.n;
    let prompt_len = prompt.len();
    let mut jobs = submit(&model, &id, vec![prompt], &params, "messages", &mut guard)?;
    let mut timer = Timer::new(arrival, n);
    let created = now_unix();
    let ctx = StreamCtx {
        state: state.clone(),
        model: model.clone(),
        id: id.clone(),
        created,
        n,
        include_usage: req.common.include_usage(),
        prompt_tokens: prompt_len,
        object: "chat.completion.chunk",
    };
    if req.common.stream() {
        let fmt =
            ChatStream { parse_tools, logprobs: params.logprobs.is_some(), choices: vec![ChoiceState::default(); n] };
        return Ok(sse(ctx, jobs, guard, timer, Box::new(fmt)));
    }
    let choices = collect(state, &mut jobs, n, &mut timer, &mut guard).await?;
    let eos = &model.engine.model_info().eos_token_ids;
    let mut out = Vec::with_capacity(n);
    let (mut completion, mut reason0) = (0, "stop");
    for (i, c) in choices.iter().enumerate() {
        completion += c.token_ids.len();
        let fin = c
            .finished
            .clone()
            .unwrap_or(flint_engine::Finished { reason: flint_engine::FinishReason::Error, stop: None });
        let (content, calls) = if parse_tools { extract(&c.text, &id, i) } else { (Some(c.text.clone()), Vec::new()) };
        let mut message = json!({"role": "assistant", "content": content});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls.iter().map(|c| c.to_json(None)).collect());
        }
        let reason = finish_reason(&fin, !calls.is_empty());
        if i == 0 {
            reason0 = reason;
        }
        let logprobs = params.logprobs.map(
            |_| json!({"content": c.logprobs.iter().map(|lp| chat_logprob(&model.tokenizer, lp)).collect::<Vec<_>>()}),
        );
        out.push(json!({
            "index": i,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": stop_reason(&fin, eos),
        }));
    }
    let cached = choices.first().map_or(0, |c| c.cached_tokens);
    state.metrics.finished(reason0, timer.elapsed());
    log_request(&id, prompt_len, completion, cached, &timer, reason0);
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": state.cfg.served_model_name,
        "choices": out,
        "usage": usage(prompt_len, completion, cached),
    }))
    .into_response())
}

#[derive(Debug, Default, Clone)]
struct ChoiceState {
    tools: ToolStream,
    completion: usize,
    cached: usize,
    reason: Option<&'static str>,
}

struct ChatStream {
    parse_tools: bool,
    logprobs: bool,
    choices: Vec<ChoiceState>,
}

fn chunk(ctx: &StreamCtx, choice: Value) -> Value {
    ctx.chunk(vec![choice])
}

impl Formatter for ChatStream {
    fn prelude(&mut self, ctx: &StreamCtx) -> Vec<Value> {
        (0..ctx.n)
            .map(|i| {
                chunk(
                    ctx,
                    json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
                )
            })
            .collect()
    }

    fn on_output(&mut self, ctx: &StreamCtx, _job: usize, o: SampleOutput) -> Vec<Value> {
        let Some(st) = self.choices.get_mut(o.index) else { return Vec::new() };
        st.completion += o.token_ids.len();
        st.cached = o.cached_tokens;
        let (mut content, mut calls) = (o.text.clone(), Vec::new());
        if self.parse_tools {
            let d = st.tools.push(&o.text, &ctx.id, o.index);
            content = d.content;
            calls = d.calls;
            if o.finished.is_some() {
                content.push_str(&st.tools.finish());
            }
        }
        let mut out = Vec::new();
        let logprobs = (self.logprobs && !o.logprobs.is_empty()).then(|| {
            json!({"content": o.logprobs.iter().map(|lp| chat_logprob(&ctx.model.tokenizer, lp)).collect::<Vec<_>>()})
        });
        if !calls.is_empty() {
            let base = st.tools.num_calls() - calls.len();
            let deltas: Vec<Value> = calls.iter().enumerate().map(|(k, c)| c.to_json(Some(base + k))).collect();
            out.push(chunk(
                ctx,
                json!({"index": o.index, "delta": {"tool_calls": deltas}, "logprobs": null, "finish_reason": null}),
            ));
        }
        let fin = o.finished.as_ref().map(|f| {
            let reason = finish_reason(f, st.tools.num_calls() > 0);
            st.reason = Some(reason);
            (reason, stop_reason(f, &ctx.model.engine.model_info().eos_token_ids))
        });
        if !content.is_empty() || logprobs.is_some() || fin.is_some() {
            let delta = if content.is_empty() { json!({}) } else { json!({"content": content}) };
            let mut choice = json!({"index": o.index, "delta": delta, "logprobs": logprobs, "finish_reason": null});
            if let Some((reason, stop)) = fin {
                choice["finish_reason"] = json!(reason);
                choice["stop_reason"] = stop;
            }
            out.push(chunk(ctx, choice));
        }
        out
    }

    fn summary(&self) -> (usize, usize, &'static str) {
        let completion = self.choices.iter().map(|c| c.completion).sum();
        let cached = self.choices.first().map_or(0, |c| c.cached);
        (completion, cached, self.choices.first().and_then(|c| c.reason).unwrap_or("stop"))
    }
}
