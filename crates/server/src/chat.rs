//! `POST /v1/chat/completions`: messages rendered with the model's chat template (tools passed
//! in, `<tool_call>` output parsed back), answered as JSON or as a stream of chunks.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use flint_engine::SampleOutput;
use serde_json::{json, Value};

use crate::api_types::chat::{ChatChoice, ChatChunkChoice, ChatCompletion, ChatDelta, ChatMessage, Reasoning};
use crate::api_types::Usage;
use crate::error::{ApiError, ApiResult};
use crate::generation::{collect, respond, sse, submit, Chunk, Formatter, StreamCtx};
use crate::output::{
    chat_token_logprobs, finish_reason, new_id, now_unix, stop_reason, vllm_prompt_logprobs, Outcome, Timer,
};
use crate::prompt_tokens::encode_bounded;
use crate::protocol::{chat_logprobs, parse_off_async, parse_request, prompt_logprobs, ChatRequest};
use crate::reasoning::{ReasoningSplit, Split};
use crate::request_span::Arrival;
use crate::state::{InFlight, ServingModel, SharedState};
use crate::structured::Requested;
use crate::tools::{extract, ToolStream};
use flint_engine::structured::{Constraint, ToolSchema};
use flint_engine::RequestParams;

pub async fn chat_completions(State(state): State<SharedState>, headers: HeaderMap, body: Bytes) -> Response {
    let arrival = Arrival::new(&state, &headers);
    respond(&state, run(&state, arrival, body).await)
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

/// How a request uses its tools: whether output is parsed for calls, and the calls it must make
/// (`tool_choice` "required" or a named function) as a constraint.
struct ToolMode {
    parse: bool,
    forced: Option<Requested>,
}

/// A tool definition's name and argument schema (already checked by `limits::check_tools`).
fn tool_schema(t: &Value) -> ToolSchema {
    let f = &t["function"];
    let parameters = match f.get("parameters") {
        Some(p) if p.is_object() => p.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    ToolSchema { name: f["name"].as_str().unwrap_or_default().to_string(), parameters }
}

fn tool_mode(req: &ChatRequest) -> ApiResult<ToolMode> {
    let tools = req.tools.as_deref().unwrap_or_default();
    crate::limits::check_tools(tools)?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let forced = |tools: Vec<ToolSchema>, parallel: bool, optional: bool| ToolMode {
        parse: true,
        forced: Some(Requested {
            param: "tool_choice",
            constraint: Constraint::ToolCalls { tools, parallel, optional },
        }),
    };
    // `strict: true` on any tool: with tool_choice auto, a call, once it starts, follows its
    // schema (the other tools' arguments need only be an object).
    let strict = |t: &Value| t.pointer("/function/strict") == Some(&Value::Bool(true));
    let auto = || {
        if tools.iter().any(strict) {
            let schemas = tools
                .iter()
                .map(|t| {
                    let mut s = tool_schema(t);
                    if !strict(t) {
                        s.parameters = json!({"type": "object"});
                    }
                    s
                })
                .collect();
            forced(schemas, parallel, true)
        } else {
            ToolMode { parse: !tools.is_empty(), forced: None }
        }
    };
    let bad = |m: String| Err(ApiError::invalid("tool_choice", m));
    match &req.tool_choice {
        None => Ok(auto()),
        Some(Value::String(s)) if s == "auto" => Ok(auto()),
        Some(Value::String(s)) if s == "none" => Ok(ToolMode { parse: false, forced: None }),
        Some(Value::String(s)) if s == "required" => {
            if tools.is_empty() {
                return bad("`tool_choice` \"required\" needs at least one tool in `tools`".into());
            }
            Ok(forced(tools.iter().map(tool_schema).collect(), parallel, false))
        }
        Some(v @ Value::Object(_)) => {
            let name =
                match (v.get("type").and_then(Value::as_str), v.pointer("/function/name").and_then(Value::as_str)) {
                    (Some("function"), Some(n)) => n,
                    _ => {
                        return bad(format!(
                            "`tool_choice` {v} must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                        ))
                    }
                };
            match tools.iter().find(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name)) {
                Some(t) => Ok(forced(vec![tool_schema(t)], false, false)),
                None => bad(format!("`tool_choice` names {name:?}, which is not in `tools`")),
            }
        }
        Some(other) => {
            bad(format!("`tool_choice` must be \"none\", \"auto\", \"required\" or a named function, got {other}"))
        }
    }
}

fn render_prompt(model: &ServingModel, req: &ChatRequest) -> ApiResult<Vec<u32>> {
    let template = model.chat_template.as_ref().ok_or_else(|| {
        ApiError::invalid("messages", "this model has no chat template; use /v1/completions with a prompt")
    })?;
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
    let last_role = messages.last().and_then(|m| m.get("role")).and_then(Value::as_str);
    if continue_final && last_role != Some("assistant") {
        return Err(ApiError::invalid(
            "continue_final_message",
            format!(
                "`continue_final_message` continues the last message, which must be the assistant's; it is the {}'s",
                last_role.unwrap_or("?")
            ),
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

/// A chat request made ready for the engine: its prompt, parameters and admission.
pub struct PreparedChat {
    pub req: ChatRequest,
    pub prompt: Vec<u32>,
    pub params: RequestParams,
    /// Output is parsed for tool calls.
    pub parse_tools: bool,
    pub guard: InFlight,
}

/// Validate `req`, compile its constraint, admit it and render its prompt (the Responses API
/// runs its requests through here too).
pub async fn prepare(state: &SharedState, model: &Arc<ServingModel>, req: ChatRequest) -> ApiResult<PreparedChat> {
    check_model(state, req.common.model.as_deref())?;
    let tools = tool_mode(&req)?;
    let parse_tools = tools.parse;
    let constraint = match (tools.forced, crate::structured::requested(&req.common)?) {
        // Strict tools under "auto" yield to an explicit output format.
        (Some(t), Some(r)) if matches!(t.constraint, Constraint::ToolCalls { optional: true, .. }) => Some(r),
        // A forced call wins over an output format, as OpenAI has it (the format, still checked
        // above, would describe a final answer that this turn does not give): instructor's
        // RESPONSES_TOOLS mode sends both.
        (Some(t), Some(_)) => Some(t),
        (a, b) => a.or(b),
    };
    let reasoning = state.cfg.reasoning_parser;
    let model = model.clone();
    // Everything cheap is checked before the prompt is rendered and tokenized, and the request
    // holds its place in the admission count while that runs.
    let mut params = req.common.to_params(model.router.model_info(), "messages")?;
    params.logprobs = chat_logprobs(req.logprobs, req.top_logprobs, state.cfg.max_logprobs)?;
    params.prompt_logprobs = prompt_logprobs(&req.common, state.cfg.max_logprobs)?;
    req.common.max_tokens(0, model.max_model_len, false)?;
    if let Some(c) = constraint {
        // Qwen3 templates close an empty reasoning in the prompt when thinking is off.
        let thinking = req.chat_template_kwargs.as_ref().and_then(|k| k.get("enable_thinking")) != Some(&json!(false));
        let after = reasoning.and_then(|p| p.constraint_after(thinking));
        params.structured =
            Some(crate::structured::compile(&model, c, after, state.cfg.grammar_compile_timeout).await?);
    }
    let guard = state.admit(&model, params.n, "n")?;
    // Template rendering and tokenizing can take a while on big inputs: off the async workers.
    let m = model.clone();
    let (req, prompt) = tokio::task::spawn_blocking(move || {
        let prompt = render_prompt(&m, &req);
        (req, prompt)
    })
    .await
    .map_err(|_| ApiError::internal("prompt rendering panicked"))?;
    let prompt = prompt?;
    params.max_tokens = req.common.max_tokens(prompt.len(), model.max_model_len, false)?;
    Ok(PreparedChat { req, prompt, params, parse_tools, guard })
}

async fn run(state: &SharedState, arrival: Arrival, body: Bytes) -> ApiResult<Response> {
    let model = state.model()?;
    let req: ChatRequest = parse_off_async(body, parse_request).await?;
    let PreparedChat { req, prompt, params, parse_tools, mut guard } = prepare(state, &model, req).await?;
    let reasoning = state.cfg.reasoning_parser;
    let id = new_id("chatcmpl");
    let n = params.n;
    let prompt_len = prompt.len();
    let mut jobs = submit(&model, &id, vec![prompt.clone()], &params, "messages", &mut guard)?;
    let mut timer = Timer::new(&arrival, n);
    timer.trace(&arrival, &id, &params, &state.cfg.served_model_name);
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
        let choice = ChoiceState { reasoning: reasoning.map(ReasoningSplit::new), ..Default::default() };
        let fmt = ChatStream { parse_tools, logprobs: params.logprobs.is_some(), choices: vec![choice; n] };
        return Ok(sse(ctx, jobs, guard, timer, Box::new(fmt)));
    }
    let choices = collect(state, &mut jobs, n, &mut timer, &mut guard).await?;
    let eos = &model.router.model_info().eos_token_ids;
    let mut out = Vec::with_capacity(n);
    let (mut completion, mut reason0, mut reasoning_tokens) = (0, "stop", 0);
    for (i, c) in choices.iter().enumerate() {
        completion += c.token_ids.len();
        let (text, thought) = match reasoning {
            Some(p) => {
                let (split, tokens) = ReasoningSplit::split_all(p, &model.tokenizer, &c.text, &c.token_ids);
                reasoning_tokens += tokens;
                (split.content, Some(split.reasoning).filter(|r| !r.is_empty()))
            }
            None => (c.text.clone(), None),
        };
        let fin = c
            .finished
            .clone()
            .unwrap_or(flint_engine::Finished { reason: flint_engine::FinishReason::Error, stop: None });
        let (content, calls) = if parse_tools { extract(&text, &id, i) } else { (Some(text), Vec::new()) };
        let reason = finish_reason(&fin, !calls.is_empty());
        if i == 0 {
            reason0 = reason;
        }
        out.push(ChatChoice {
            index: i,
            message: ChatMessage {
                role: "assistant",
                content,
                reasoning: reasoning.map(|_| Reasoning::new(thought)),
                tool_calls: calls.iter().map(|c| c.to_chat(None)).collect(),
            },
            logprobs: params.logprobs.map(|_| chat_token_logprobs(&model.tokenizer, &c.logprobs)),
            finish_reason: reason,
            stop_reason: stop_reason(&fin, eos),
        });
    }
    let cached = choices.first().map_or(0, |c| c.cached_tokens);
    let outcome = Outcome {
        id: &id,
        prompt_tokens: prompt_len,
        completion_tokens: completion,
        cached_tokens: cached,
        sequences: n,
        reason: reason0,
    };
    timer.finish(&state.metrics, outcome);
    let prompt_logprobs = params.prompt_logprobs.map(|k| {
        let plps = choices.first().and_then(|c| c.prompt_logprobs.as_ref());
        vllm_prompt_logprobs(&model.tokenizer, &prompt, plps, k)
    });
    let body = ChatCompletion {
        id: &id,
        object: "chat.completion",
        created,
        model: &state.cfg.served_model_name,
        choices: out,
        usage: Usage::new(prompt_len, completion, cached).with_reasoning(reasoning.map(|_| reasoning_tokens)),
        prompt_logprobs,
    };
    Ok(Json(body).into_response())
}

#[derive(Debug, Default, Clone)]
struct ChoiceState {
    reasoning: Option<ReasoningSplit>,
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

fn chunk(ctx: &StreamCtx, choice: ChatChunkChoice) -> Chunk {
    Chunk::new(&ctx.chunk(vec![choice]))
}

impl Formatter for ChatStream {
    fn prelude(&mut self, ctx: &StreamCtx) -> Vec<Chunk> {
        let role = || ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
        (0..ctx.n).map(|i| chunk(ctx, ChatChunkChoice::delta(i, role()))).collect()
    }

    fn on_output(&mut self, ctx: &StreamCtx, _job: usize, o: SampleOutput) -> Vec<Chunk> {
        let Some(st) = self.choices.get_mut(o.index) else { return Vec::new() };
        st.completion += o.token_ids.len();
        st.cached = o.cached_tokens;
        let Split { reasoning: thought, content: text } = match st.reasoning.as_mut() {
            Some(r) => r.take(&ctx.model.tokenizer, &o.token_ids, &o.text, o.finished.is_some()),
            None => Split { reasoning: String::new(), content: o.text.clone() },
        };
        let (mut content, mut calls) = (text.clone(), Vec::new());
        if self.parse_tools {
            let d = st.tools.push(&text, &ctx.id, o.index);
            content = d.content;
            calls = d.calls;
            if o.finished.is_some() {
                content.push_str(&st.tools.finish());
            }
        }
        let mut out = Vec::new();
        if !thought.is_empty() {
            let delta = ChatDelta { reasoning: Some(Reasoning::new(Some(thought))), ..Default::default() };
            out.push(chunk(ctx, ChatChunkChoice::delta(o.index, delta)));
        }
        let logprobs =
            (self.logprobs && !o.logprobs.is_empty()).then(|| chat_token_logprobs(&ctx.model.tokenizer, &o.logprobs));
        if !calls.is_empty() {
            let base = st.tools.num_calls() - calls.len();
            let tool_calls = calls.iter().enumerate().map(|(k, c)| c.to_chat(Some(base + k))).collect();
            out.push(chunk(ctx, ChatChunkChoice::delta(o.index, ChatDelta { tool_calls, ..Default::default() })));
        }
        let fin = o.finished.as_ref().map(|f| {
            let reason = finish_reason(f, st.tools.num_calls() > 0);
            st.reason = Some(reason);
            (reason, stop_reason(f, &ctx.model.router.model_info().eos_token_ids))
        });
        if !content.is_empty() || logprobs.is_some() || fin.is_some() {
            let delta = ChatDelta { content: Some(content).filter(|c| !c.is_empty()), ..Default::default() };
            out.push(chunk(
                ctx,
                ChatChunkChoice {
                    index: o.index,
                    delta,
                    logprobs,
                    finish_reason: fin.as_ref().map(|f| f.0),
                    stop_reason: fin.map(|f| f.1),
                },
            ));
        }
        out
    }

    fn reasoning_tokens(&self) -> Option<usize> {
        let mut any = false;
        let mut n = 0;
        for r in self.choices.iter().filter_map(|c| c.reasoning.as_ref()) {
            any = true;
            n += r.reasoning_tokens();
        }
        any.then_some(n)
    }

    fn summary(&self) -> (usize, usize, &'static str) {
        let completion = self.choices.iter().map(|c| c.completion).sum();
        let cached = self.choices.first().map_or(0, |c| c.cached);
        (completion, cached, self.choices.first().and_then(|c| c.reason).unwrap_or("stop"))
    }
}
