//! `/v1/chat/completions` bodies: the completion, its streamed chunks' choices, tool calls and
//! chat-format logprobs.

use serde::Serialize;

use super::{PromptLogprobs, StopReason, Usage};

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion<'a> {
    pub id: &'a str,
    /// `chat.completion`.
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's, when the request asked for `prompt_logprobs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    pub stop_reason: Option<StopReason>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    /// `assistant`.
    pub role: &'static str,
    /// `null` when the output was only tool calls.
    pub content: Option<String>,
    /// Present (possibly `null`) when a reasoning parser runs.
    #[serde(flatten)]
    pub reasoning: Option<Reasoning>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ChatToolCall>,
}

/// The reasoning text under both names clients read: vLLM's `reasoning` and the older
/// `reasoning_content`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reasoning {
    pub reasoning: Option<String>,
    pub reasoning_content: Option<String>,
}

impl Reasoning {
    pub fn new(text: Option<String>) -> Self {
        Self { reasoning: text.clone(), reasoning_content: text }
    }
}

/// A tool call in chat's shape; streamed deltas carry the call's `index` among the choice's calls.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatToolCall {
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// One sampled token's logprob entry with its most likely alternatives.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
}

/// A streamed choice. `stop_reason` comes only with the `finish_reason`, on its last chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<StopReason>>,
}

impl ChatChunkChoice {
    /// A chunk of `delta` alone: no logprobs, not finished.
    pub fn delta(index: usize, delta: ChatDelta) -> Self {
        Self { index, delta, logprobs: None, finish_reason: None, stop_reason: None }
    }
}

/// What a chunk adds to its choice; only the fields it carries are sent (`{}` when none).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(flatten)]
    pub reasoning: Option<Reasoning>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ChatToolCall>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_and_deltas_carry_only_their_fields() {
        let m = ChatMessage { role: "assistant", content: None, reasoning: None, tool_calls: Vec::new() };
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"role":"assistant","content":null}"#);
        let m = ChatMessage { reasoning: Some(Reasoning::new(None)), ..m };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"role":"assistant","content":null,"reasoning":null,"reasoning_content":null}"#
        );
        assert_eq!(serde_json::to_string(&ChatDelta::default()).unwrap(), "{}");
        let d = ChatDelta { reasoning: Some(Reasoning::new(Some("hm".into()))), ..Default::default() };
        assert_eq!(serde_json::to_value(&d).unwrap(), json!({"reasoning": "hm", "reasoning_content": "hm"}));
        let c = ChatChunkChoice::delta(1, ChatDelta { content: Some("x".into()), ..Default::default() });
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"index":1,"delta":{"content":"x"},"logprobs":null,"finish_reason":null}"#
        );
        let c = ChatChunkChoice { finish_reason: Some("stop"), stop_reason: Some(None), ..c };
        assert_eq!(serde_json::to_value(&c).unwrap()["stop_reason"], json!(null));
    }
}
