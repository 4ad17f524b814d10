//! `/v1/responses` bodies: the response object, its output items, usage and streamed events.

use serde::Serialize;
use serde_json::Value;

use super::{Empty, Null};

/// The response object, at creation (`in_progress`, no output) or at the end. The request's
/// settings are echoed as the client sent them (`Value`), or their defaults.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseObject<'a> {
    pub id: &'a str,
    /// `response`.
    pub object: &'static str,
    pub created_at: u64,
    /// `in_progress`, `completed` or `incomplete`.
    pub status: &'static str,
    pub model: &'a str,
    pub output: &'a [OutputItem],
    /// A failed response is an HTTP error or an `error` event, never an object.
    pub error: Null,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: &'a Value,
    pub max_output_tokens: &'a Value,
    pub temperature: &'a Value,
    pub top_p: &'a Value,
    pub tools: &'a Value,
    pub tool_choice: &'a Value,
    pub parallel_tool_calls: &'a Value,
    pub text: &'a Value,
    pub reasoning: ReasoningConfig,
    pub store: bool,
    pub previous_response_id: Null,
    /// `disabled`.
    pub truncation: &'static str,
    pub metadata: &'a Value,
    /// `null` until the response is done.
    pub usage: Option<ResponseUsage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: &'static str,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ReasoningConfig {
    pub effort: Null,
    pub summary: Null,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: usize,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct InputTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OutputTokensDetails {
    pub reasoning_tokens: usize,
}

impl ResponseUsage {
    pub fn new(input: usize, output: usize, cached: usize, reasoning: usize) -> Self {
        Self {
            input_tokens: input,
            input_tokens_details: InputTokensDetails { cached_tokens: cached },
            output_tokens: output,
            output_tokens_details: OutputTokensDetails { reasoning_tokens: reasoning },
            total_tokens: input + output,
        }
    }
}

/// An output item, typed by `type`. `status` is `in_progress` while it streams, then `completed`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Reasoning { id: String, summary: Empty, content: Vec<ReasoningContent>, status: &'static str },
    Message { id: String, status: &'static str, role: &'static str, content: Vec<ContentPart> },
    FunctionCall { id: String, call_id: String, name: String, arguments: String, status: &'static str },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ReasoningContent {
    ReasoningText { text: String },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    OutputText { text: String, annotations: Empty, logprobs: Empty },
}

impl ContentPart {
    pub fn text(text: &str) -> Self {
        ContentPart::OutputText { text: text.to_string(), annotations: [], logprobs: [] }
    }
}

/// A streamed event: its fields, then its `type` (also the SSE event's name) and its
/// `sequence_number`.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseEvent<E> {
    #[serde(flatten)]
    pub body: E,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub sequence_number: u64,
}

/// `response.created`, `response.in_progress`, `response.completed`, `response.incomplete`.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseState<'a> {
    pub response: ResponseObject<'a>,
}

/// `response.output_item.added` and `.done`.
#[derive(Debug, Clone, Serialize)]
pub struct ItemEvent<'a> {
    pub output_index: usize,
    pub item: &'a OutputItem,
}

/// `response.content_part.added` and `.done`.
#[derive(Debug, Clone, Serialize)]
pub struct ContentPartEvent<'a> {
    pub item_id: &'a str,
    pub output_index: usize,
    pub content_index: usize,
    pub part: ContentPart,
}

/// `response.output_text.delta`.
#[derive(Debug, Clone, Serialize)]
pub struct TextDelta<'a> {
    pub item_id: &'a str,
    pub output_index: usize,
    pub content_index: usize,
    pub delta: &'a str,
    pub logprobs: Empty,
}

/// `response.output_text.done`.
#[derive(Debug, Clone, Serialize)]
pub struct TextDone<'a> {
    pub item_id: &'a str,
    pub output_index: usize,
    pub content_index: usize,
    pub text: &'a str,
    pub logprobs: Empty,
}

/// `response.reasoning_text.delta`.
#[derive(Debug, Clone, Serialize)]
pub struct ReasoningDelta<'a> {
    pub item_id: &'a str,
    pub output_index: usize,
    pub content_index: usize,
    pub delta: &'a str,
}

/// `response.reasoning_text.done`.
#[derive(Debug, Clone, Serialize)]
pub struct ReasoningDone<'a> {
    pub item_id: &'a str,
    pub output_index: usize,
    pub content_index: usize,
    pub text: &'a str,
}

/// `response.function_call_arguments.delta`.
#[derive(Debug, Clone, Serialize)]
pub struct ArgumentsDelta<'a> {
    pub item_id: &'a str,
    pub output_index: usize,
    pub delta: &'a str,
}

/// `response.function_call_arguments.done`.
#[derive(Debug, Clone, Serialize)]
pub struct ArgumentsDone<'a> {
    pub item_id: &'a str,
    pub output_index: usize,
    pub arguments: &'a str,
}

/// `error`: a stream that failed after it began.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorEvent<'a> {
    pub code: Option<&'a str>,
    pub message: &'a str,
    pub param: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn items_and_events_are_typed_by_type() {
        let item = OutputItem::Message {
            id: "msg-1".into(),
            status: "completed",
            role: "assistant",
            content: vec![ContentPart::text("Hi")],
        };
        assert_eq!(
            serde_json::to_string(&item).unwrap(),
            r#"{"type":"message","id":"msg-1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}]}"#
        );
        let item = OutputItem::Reasoning {
            id: "rs-1".into(),
            summary: [],
            content: vec![ReasoningContent::ReasoningText { text: "hm".into() }],
            status: "completed",
        };
        assert_eq!(
            serde_json::to_value(&item).unwrap(),
            json!({"type": "reasoning", "id": "rs-1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}], "status": "completed"})
        );
        let ev = ResponseEvent {
            body: ArgumentsDelta { item_id: "fc_1", output_index: 0, delta: "{}" },
            kind: "response.function_call_arguments.delta",
            sequence_number: 3,
        };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"item_id":"fc_1","output_index":0,"delta":"{}","type":"response.function_call_arguments.delta","sequence_number":3}"#
        );
    }
}
