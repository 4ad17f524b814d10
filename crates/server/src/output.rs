//! Pieces shared by the chat and completions responses: ids, finish and stop reasons, logprob
//! entries (the types are in [`crate::api_types`]), the
//! per-request timing that feeds the metrics and the request log line.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use flint_engine::request::{FinishReason, Finished, StopMatch};
use flint_engine::sampler::TokenLogprobs;
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{RequestParams, SampleOutput};

use crate::api_types::chat::{ChatLogprobs, ChatTokenLogprob, TopLogprob};
use crate::api_types::completion::CompletionLogprobs;
use crate::api_types::{PromptLogprob, PromptLogprobs, StopReason, TokenMap};
use crate::metrics::Metrics;
use crate::request_span::{Arrival, RequestSpan, SpanTiming, SpanUsage};

pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `prefix-` followed by 24 hex digits, unique per process run.
pub fn new_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mix = (t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    format!("{prefix}-{mix:016x}{n:08x}")
}

pub fn finish_reason(f: &Finished, tool_calls: bool) -> &'static str {
    match f.reason {
        FinishReason::Stop if tool_calls => "tool_calls",
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Error => "error",
    }
}

/// vLLM's `stop_reason`: the matched stop string or token id (`null` for EOS and length).
pub fn stop_reason(f: &Finished, eos: &[u32]) -> Option<StopReason> {
    match &f.stop {
        Some(StopMatch::Text(s)) => Some(StopReason::Text(s.clone())),
        Some(StopMatch::Token(t)) if !eos.contains(t) => Some(StopReason::Token(*t)),
        _ => None,
    }
}

/// vLLM's `prompt_logprobs`: `null` for the first token (nothing predicts it), then per prompt
/// token an object keyed by token id holding that token and the `k` most likely ids, each as
/// `{"logprob", "decoded_token"}` (vLLM also reports a rank, which flint does not compute).
pub fn vllm_prompt_logprobs(
    tok: &Tokenizer,
    prompt: &[u32],
    plps: Option<&Vec<Option<TokenLogprobs>>>,
    k: usize,
) -> PromptLogprobs {
    let entry = |id: u32, lp: f32| PromptLogprob { logprob: f64::from(lp), decoded_token: token_text(tok, id) };
    prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let lp = plps.and_then(|v| v.get(i)).and_then(Option::as_ref)?;
            let mut m = TokenMap::default();
            for &(id, l) in lp.top.iter().take(k) {
                m.insert(id.to_string(), entry(id, l));
            }
            m.insert(t.to_string(), entry(t, lp.logprob));
            Some(m)
        })
        .collect()
}

/// A token's text as logprob entries show it (a partial UTF-8 character shows as U+FFFD).
pub fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Chat format: `{"token", "logprob", "bytes", "top_logprobs": [...]}`.
pub fn chat_logprob(tok: &Tokenizer, lp: &TokenLogprobs) -> ChatTokenLogprob {
    let entry = |id: u32, p: f32| {
        let token = token_text(tok, id);
        let bytes = tok.token_bytes(id).unwrap_or_else(|| token.as_bytes().to_vec());
        TopLogprob { token, logprob: f64::from(p), bytes }
    };
    let TopLogprob { token, logprob, bytes } = entry(lp.token, lp.logprob);
    ChatTokenLogprob { token, logprob, bytes, top_logprobs: lp.top.iter().map(|&(id, p)| entry(id, p)).collect() }
}

/// Chat's `logprobs` of a run of tokens.
pub fn chat_token_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs]) -> ChatLogprobs {
    ChatLogprobs { content: lps.iter().map(|lp| chat_logprob(tok, lp)).collect() }
}

impl CompletionLogprobs {
    /// Append one token; `lp` is `None` for the first prompt token (nothing predicts it).
    pub fn push(&mut self, tok: &Tokenizer, id: u32, lp: Option<&TokenLogprobs>, offset: usize) -> usize {
        let text = token_text(tok, id);
        let next = offset + text.len();
        self.tokens.push(text);
        self.token_logprobs.push(lp.map(|lp| f64::from(lp.logprob)));
        self.top_logprobs.push(lp.map(|lp| {
            let mut top = TokenMap::default();
            for &(t, p) in &lp.top {
                top.insert(token_text(tok, t), f64::from(p));
            }
            top
        }));
        self.text_offset.push(offset);
        next
    }
}

/// Timing of one request for the metrics, the log line and its span.
pub struct Timer {
    pub arrival: Instant,
    pub first_token: Option<f64>,
    queue: Option<f64>,
    last_event: Vec<Option<Instant>>,
    span: Option<RequestSpan>,
}

/// How a request ended, for [`Timer::finish`].
pub struct Outcome<'a> {
    pub id: &'a str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Samples drawn (`n` × prompts).
    pub sequences: usize,
    pub reason: &'static str,
}

impl Timer {
    pub fn new(arrival: &Arrival, choices: usize) -> Self {
        Self { arrival: arrival.at, first_token: None, queue: None, last_event: vec![None; choices], span: None }
    }

    /// Export this request's span when it finishes (only when spans are exported at all).
    pub fn trace(&mut self, arrival: &Arrival, id: &str, params: &RequestParams, model: &str) {
        self.span = RequestSpan::new(arrival, id, params, model);
    }

    /// Record an output event of choice `i` carrying tokens.
    pub fn on_output(&mut self, m: &Metrics, i: usize, o: &SampleOutput) {
        let now = Instant::now();
        if self.queue.is_none() {
            if let Some(q) = o.queue_secs {
                m.queue_time(q);
                self.queue = Some(q);
            }
        }
        if o.token_ids.is_empty() {
            return;
        }
        if self.first_token.is_none() {
            let t = now.duration_since(self.arrival).as_secs_f64();
            self.first_token = Some(t);
            m.ttft(t);
        }
        if let Some(slot) = self.last_event.get_mut(i) {
            if let Some(prev) = *slot {
                m.itl(now.duration_since(prev).as_secs_f64());
            }
            *slot = Some(now);
        }
    }

    pub fn elapsed(&self) -> f64 {
        self.arrival.elapsed().as_secs_f64()
    }

    /// The request finished: count it, write its one info line, export its span.
    pub fn finish(&mut self, m: &Metrics, o: Outcome) {
        let e2e = self.elapsed();
        m.finished(o.reason, e2e);
        tracing::info!(
            "request {}: prompt {} tokens ({} cached), output {} tokens, TTFT {}, total {e2e:.3}s, finish {}",
            o.id,
            o.prompt_tokens,
            o.cached_tokens,
            o.completion_tokens,
            self.first_token.map_or("-".to_string(), |t| format!("{t:.3}s")),
            o.reason
        );
        if let Some(span) = self.span.take() {
            let timing = SpanTiming { queue: self.queue, first_token: self.first_token, e2e };
            let usage = SpanUsage { prompt_tokens: o.prompt_tokens, completion_tokens: o.completion_tokens };
            span.end(&timing, &usage, o.sequences);
        }
    }
}
