//! The Responses API's streamed events: `response.created` and `response.in_progress`, each
//! output item opened (`output_item.added`), its text or arguments as deltas, closed with its
//! `done` events, and `response.completed` (or `response.incomplete`) with the whole response.
//! Every event carries its `type` (also the SSE event name) and a `sequence_number`; the stream
//! has no `[DONE]`.

use flint_engine::{FinishReason, SampleOutput};
use serde::Serialize;

use super::{call_item, call_item_id, message_item, reasoning_item, Envelope};
use crate::api_types::responses::{
    ArgumentsDelta, ArgumentsDone, ContentPart, ContentPartEvent, ErrorEvent, ItemEvent, OutputItem, ReasoningDelta,
    ReasoningDone, ResponseEvent, ResponseState, ResponseUsage, TextDelta, TextDone,
};
use crate::api_types::Usage;
use crate::error::ApiError;
use crate::generation::{Chunk, Formatter, StreamCtx};
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
    output: Vec<OutputItem>,
    completion: usize,
    cached: usize,
    finish: Option<FinishReason>,
}

/// The next event: `body`, typed `kind`, numbered `seq` (which moves on).
fn event(seq: &mut u64, kind: &'static str, body: impl Serialize) -> Chunk {
    let e = ResponseEvent { body, kind, sequence_number: *seq };
    *seq += 1;
    Chunk::named(kind, &e)
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

    fn ev(&mut self, kind: &'static str, body: impl Serialize) -> Chunk {
        event(&mut self.seq, kind, body)
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    /// Close the open item: its `done` events, and it joins the output.
    fn close(&mut self, out: &mut Vec<Chunk>) {
        let i = self.index();
        let item = match std::mem::replace(&mut self.open, Open::None) {
            Open::None => return,
            Open::Reasoning { id, text } => {
                let done = ReasoningDone { item_id: &id, output_index: i, content_index: 0, text: &text };
                out.push(self.ev("response.reasoning_text.done", done));
                reasoning_item(&id, &text)
            }
            Open::Message { id, text } => {
                let done = TextDone { item_id: &id, output_index: i, content_index: 0, text: &text, logprobs: [] };
                out.push(self.ev("response.output_text.done", done));
                let part = ContentPartEvent {
                    item_id: &id,
                    output_index: i,
                    content_index: 0,
                    part: ContentPart::text(&text),
                };
                out.push(self.ev("response.content_part.done", part));
                message_item(&id, &text, "completed")
            }
        };
        out.push(self.ev("response.output_item.done", ItemEvent { output_index: i, item: &item }));
        self.output.push(item);
    }

    fn reasoning_delta(&mut self, delta: &str, out: &mut Vec<Chunk>) {
        if !matches!(self.open, Open::Reasoning { .. }) {
            self.close(out);
            let id = new_id("rs");
            let item =
                OutputItem::Reasoning { id: id.clone(), summary: [], content: Vec::new(), status: "in_progress" };
            out.push(self.ev("response.output_item.added", ItemEvent { output_index: self.index(), item: &item }));
            self.open = Open::Reasoning { id, text: String::new() };
        }
        let i = self.index();
        if let Open::Reasoning { id, text } = &mut self.open {
            text.push_str(delta);
            let id = id.clone();
            let e = ReasoningDelta { item_id: &id, output_index: i, content_index: 0, delta };
            out.push(self.ev("response.reasoning_text.delta", e));
        }
    }

    fn text_delta(&mut self, delta: &str, out: &mut Vec<Chunk>) {
        if !matches!(self.open, Open::Message { .. }) {
            self.close(out);
            let id = new_id("msg");
            let item =
                OutputItem::Message { id: id.clone(), status: "in_progress", role: "assistant", content: Vec::new() };
            let i = self.index();
            out.push(self.ev("response.output_item.added", ItemEvent { output_index: i, item: &item }));
            let part =
                ContentPartEvent { item_id: &id, output_index: i, content_index: 0, part: ContentPart::text("") };
            out.push(self.ev("response.content_part.added", part));
            self.open = Open::Message { id, text: String::new() };
        }
        let i = self.index();
        if let Open::Message { id, text } = &mut self.open {
            text.push_str(delta);
            let id = id.clone();
            let e = TextDelta { item_id: &id, output_index: i, content_index: 0, delta, logprobs: [] };
            out.push(self.ev("response.output_text.delta", e));
        }
    }

    fn call(&mut self, call: &ToolCall, out: &mut Vec<Chunk>) {
        self.close(out);
        let i = self.index();
        let added = call_item(call, "in_progress", "");
        let item_id = call_item_id(call);
        out.push(self.ev("response.output_item.added", ItemEvent { output_index: i, item: &added }));
        let delta = ArgumentsDelta { item_id: &item_id, output_index: i, delta: &call.arguments };
        out.push(self.ev("response.function_call_arguments.delta", delta));
        let done = ArgumentsDone { item_id: &item_id, output_index: i, arguments: &call.arguments };
        out.push(self.ev("response.function_call_arguments.done", done));
        let item = call_item(call, "completed", &call.arguments);
        out.push(self.ev("response.output_item.done", ItemEvent { output_index: i, item: &item }));
        self.output.push(item);
    }
}

impl Formatter for ResponsesStream {
    fn prelude(&mut self, _ctx: &StreamCtx) -> Vec<Chunk> {
        let response = self.env.object("in_progress", &[], None);
        let created = event(&mut self.seq, "response.created", ResponseState { response: response.clone() });
        let progress = event(&mut self.seq, "response.in_progress", ResponseState { response });
        vec![created, progress]
    }

    fn on_output(&mut self, ctx: &StreamCtx, _job: usize, o: SampleOutput) -> Vec<Chunk> {
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

    fn epilogue(&mut self, ctx: &StreamCtx, _usage: &Usage) -> Vec<Chunk> {
        let incomplete = self.finish == Some(FinishReason::Length);
        let reasoning = self.reasoning.as_ref().map_or(0, ReasoningSplit::reasoning_tokens);
        let usage = ResponseUsage::new(ctx.prompt_tokens, self.completion, self.cached, reasoning);
        let (status, kind) =
            if incomplete { ("incomplete", "response.incomplete") } else { ("completed", "response.completed") };
        let response = self.env.object(status, &self.output, Some(usage));
        vec![event(&mut self.seq, kind, ResponseState { response })]
    }

    fn done_marker(&self) -> bool {
        false
    }

    fn error_event(&mut self, e: &ApiError) -> Chunk {
        self.ev("error", ErrorEvent { code: e.code, message: &e.message, param: e.param.as_deref() })
    }
}
