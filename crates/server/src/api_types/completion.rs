//! `/v1/completions` bodies: the completion, its streamed choices and the column-wise logprobs.

use serde::Serialize;

use super::{PromptLogprobs, StopReason, TokenMap, Usage};

#[derive(Debug, Clone, Serialize)]
pub struct Completion<'a> {
    pub id: &'a str,
    /// `text_completion`.
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: &'static str,
    pub stop_reason: Option<StopReason>,
    /// vLLM's, when the request asked for `prompt_logprobs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// A streamed choice. `stop_reason` comes only with the `finish_reason`, on its last chunk.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChunkChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<StopReason>>,
}

/// Completions logprobs, column-wise: one entry per token in each list. The first prompt token
/// of an echo has no logprob and no alternatives (`null`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f64>>,
    /// The most likely alternatives, keyed by their text.
    pub top_logprobs: Vec<Option<TokenMap<f64>>>,
    pub text_offset: Vec<usize>,
}
