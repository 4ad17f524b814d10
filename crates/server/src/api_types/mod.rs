//! The bodies flint answers with, as typed structs named after OpenAI's and vLLM's fields. What
//! is sent as `null` is an `Option` (or [`Null`]) that always serializes; what is left out when it
//! does not apply is skipped when `None` or empty. Logprobs are the engine's `f32` widened to
//! `f64`, the digits clients have always seen.

pub mod chat;
pub mod completion;
pub mod embedding;
pub mod misc;
pub mod responses;

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde::Serialize as DeriveSerialize;

/// A field that is always `null` (kept for clients that expect it).
#[derive(Debug, Clone, Copy, Default, DeriveSerialize)]
pub struct Null;

/// A list flint always sends empty (`annotations`, a reasoning item's `summary`).
pub type Empty = [(); 0];

/// `usage` of chat and completions.
#[derive(Debug, Clone, Copy, PartialEq, DeriveSerialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    /// Only when a reasoning parser runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

#[derive(Debug, Clone, Copy, PartialEq, DeriveSerialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, DeriveSerialize)]
pub struct CompletionTokensDetails {
    pub reasoning_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: cached },
            completion_tokens_details: None,
        }
    }

    /// With `completion_tokens_details.reasoning_tokens` when a reasoning parser runs.
    pub fn with_reasoning(mut self, reasoning_tokens: Option<usize>) -> Self {
        self.completion_tokens_details = reasoning_tokens.map(|r| CompletionTokensDetails { reasoning_tokens: r });
        self
    }
}

/// vLLM's `stop_reason` of a choice stopped by a stop string or a (non-EOS) stop token; EOS and
/// length stops are `null`, an `Option` of this that is `None`.
#[derive(Debug, Clone, PartialEq, DeriveSerialize)]
#[serde(untagged)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

/// A JSON object keyed by token (its text or its id), in insertion order. A key inserted again
/// keeps its place and takes the new value, so two tokens with one text make one entry.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenMap<V>(Vec<(String, V)>);

impl<V> Default for TokenMap<V> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<V> TokenMap<V> {
    pub fn insert(&mut self, key: String, value: V) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.0.push((key, value)),
        }
    }
}

impl<V: Serialize> Serialize for TokenMap<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// One entry of vLLM's `prompt_logprobs`.
#[derive(Debug, Clone, PartialEq, DeriveSerialize)]
pub struct PromptLogprob {
    pub logprob: f64,
    pub decoded_token: String,
}

/// vLLM's `prompt_logprobs`: `null` for the first token (nothing predicts it), then per prompt
/// token its own and the most likely ids' entries, keyed by token id.
pub type PromptLogprobs = Vec<Option<TokenMap<PromptLogprob>>>;

/// The envelope every streamed chat or completions chunk shares, around its `choices`; the last
/// chunk of a stream that asked for usage has no choices and its `usage`.
#[derive(Debug, Clone, DeriveSerialize)]
pub struct StreamChunk<'a, C> {
    pub id: &'a str,
    /// `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The choice type of a chunk that has none (the usage chunk).
#[derive(Debug, Clone, DeriveSerialize)]
pub enum NoChoice {}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shared_pieces_serialize_as_before() {
        let u = Usage::new(3, 4, 1);
        assert_eq!(
            serde_json::to_value(u).unwrap(),
            json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 1}})
        );
        let u = u.with_reasoning(Some(2));
        assert_eq!(serde_json::to_value(u).unwrap()["completion_tokens_details"], json!({"reasoning_tokens": 2}));
        assert_eq!(serde_json::to_string(&[StopReason::Text("x".into()), StopReason::Token(7)]).unwrap(), r#"["x",7]"#);
        assert_eq!(serde_json::to_string(&Null).unwrap(), "null");
        assert_eq!(serde_json::to_string(&Empty::default()).unwrap(), "[]");
        let mut m = TokenMap::default();
        m.insert("b".into(), 1.0);
        m.insert("a".into(), 2.0);
        m.insert("b".into(), 3.0);
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"b":3.0,"a":2.0}"#);
        // f32 logprobs widen to the f64 digits serde_json's Value printed.
        assert_eq!(serde_json::to_string(&f64::from(-0.1f32)).unwrap(), json!(-0.1f32).to_string());
        assert_eq!(serde_json::to_string(&Some(f64::from(f32::NEG_INFINITY))).unwrap(), "null");
    }
}
