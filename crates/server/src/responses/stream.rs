//! The Responses API's streamed events: `response.created` and `response.in_progress`, each
//! output item opened (`output_item.added`), its text or arguments as deltas, closed with its
//! `done` events, and `response.completed` (or `response.incomplete`) with the whole response.
//! Every event carries its `type` (also the SSE event name) and a `sequence_number`; the stream
//! has no `[DONE]`.

use flint_engine::{FinishReason, SampleOutput};
use serde_json::{json, Value};

use super::{call_item, message_item, reasoning_item, text_part, usage, Envelope};
use crate::error::ApiError;
use crate::generation::{Formatter, StreamCtx};
use crate::output::new_id;
use crate::reasoning::{ReasoningSplit, Split};
use crate::tools::{ToolCall, ToolStream};

/// The output item being streamed.
enum Open {
    None,
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
}

pub(super) struct ResponsesStream {
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
    pub(super) fn new(env: Envelope, parse_tools: bool, reasoning: Option<ReasoningSplit>) -> Self {
        Self {
            env,
            seq: 0,
            parse_tools,
            reasoning,
            tools: ToolStream::default(),
            open: Open::None,
            output: Vec::new(),
            completion: 0,
            cached: 0,
            finish: None,
        }
    }

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
