//! What a client asks the engine for, and what comes back: a request (one prompt, `n` samples)
//! and the stream of events that answers it.

use crate::pooling::PoolingParams;
use crate::sampler::{SamplingParams, TokenLogprobs};
use crate::structured::StructuredOutput;

/// Most top-logprobs the engine computes per token; a server's `--max-logprobs` (vLLM's name,
/// default [`DEFAULT_MAX_LOGPROBS`]) is at most this.
pub const MAX_LOGPROBS: usize = 1024;
/// vLLM's default `max_logprobs`.
pub const DEFAULT_MAX_LOGPROBS: usize = 20;
/// Most samples per request.
pub const MAX_N: usize = 128;

#[derive(Debug, Clone, PartialEq)]
pub struct RequestParams {
    pub sampling: SamplingParams,
    /// Independent samples of the same prompt (choices), sharing its KV blocks.
    pub n: usize,
    /// 0 scores the prompt (with `prompt_logprobs`) and draws nothing.
    pub max_tokens: usize,
    /// Stop ids (EOS, `stop_token_ids`) cannot end generation before this many tokens.
    pub min_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Top-k logprobs of each chosen token (`Some(0)`: the chosen token's only).
    pub logprobs: Option<usize>,
    /// Logprobs of the prompt's tokens, with this many alternatives each.
    pub prompt_logprobs: Option<usize>,
    pub cache_salt: Option<String>,
    /// A grammar every sample's output must follow (structured outputs, forced tool calls).
    pub structured: Option<StructuredOutput>,
    /// An embedding request: the prompt's hidden states are pooled into
    /// [`SampleOutput::embedding`]; nothing is generated (`max_tokens` 0, `n` 1).
    pub pooling: Option<PoolingParams>,
}

impl Default for RequestParams {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::default(),
            n: 1,
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            logprobs: None,
            prompt_logprobs: None,
            cache_salt: None,
            structured: None,
            pooling: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Unique among live requests; also the abort handle.
    pub id: String,
    pub prompt: Vec<u32>,
    pub params: RequestParams,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id or stop string ended the sample.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    Abort,
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// What matched when a sample stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopMatch {
    Token(u32),
    Text(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub stop: Option<StopMatch>,
}

/// New output of one sample (choice) since its previous event.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutput {
    /// Which of the request's `n` samples.
    pub index: usize,
    /// Text released by this step: valid UTF-8, with anything that may still become a stop
    /// string held back.
    pub text: String,
    pub token_ids: Vec<u32>,
    /// One entry per token in `token_ids` when logprobs were requested.
    pub logprobs: Vec<TokenLogprobs>,
    pub finished: Option<Finished>,
    /// Tokens generated so far by this sample.
    pub completion_tokens: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Per prompt position (the first has none), sent once with the first output of sample 0.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    /// Seconds from submission to this sample's first scheduling; on its first event only.
    pub queue_secs: Option<f64>,
    /// An embedding request's vector, on its final event.
    pub embedding: Option<Vec<f32>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Output(SampleOutput),
    /// The request failed; no further events follow.
    Error(String),
    /// The request's own constraint failed while generating (the grammar engine refused to go
    /// on): the client's error, not the server's. No further events follow.
    Rejected(String),
    /// The engine (a worker) serving the request stopped: the request can be retried elsewhere.
    /// No further events follow.
    Stopped(String),
}
