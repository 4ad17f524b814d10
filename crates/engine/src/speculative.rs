//! Speculative decoding's configuration and bookkeeping: vLLM's `--speculative-config` JSON,
//! each sequence's proposer state with its adaptive draft length, and the acceptance counters
//! behind `vllm:spec_decode_*`.
//!
//! The flow of one speculating sequence: after a step, up to `k` tokens are proposed (by n-gram
//! lookup over its own prompt and output, [`ngram`], or by the runner's draft model, the
//! [`Drafter`] choosing how many); the scheduler appends them
//! to the sequence's next decode chunk; the model computes every row of that chunk; the engine
//! verifies the proposals row by row against the target's own sampling
//! ([`crate::sampler::Sampler::verify`]) and keeps the accepted prefix plus one token from the
//! target, and the scheduler rolls the cache back past the rest.

pub mod ngram;

use serde::Deserialize;

use crate::EngineError;

/// How proposals are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup: the tokens that followed an earlier occurrence of the sequence's last n
    /// tokens.
    Ngram,
    /// A smaller (or more quantized) model with the same tokenizer proposes greedily.
    DraftModel,
}

/// A validated `--speculative-config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpecMethod,
    /// Most tokens proposed per step (k).
    pub num_speculative_tokens: usize,
    /// The n-gram window: matches of `prompt_lookup_max` down to `prompt_lookup_min` tokens.
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
    /// Speculation pauses while more sequences than this run (`None`: never).
    pub disable_by_batch_size: Option<usize>,
    /// The draft model (`draft_model`): a local directory, GGUF file or hub id.
    pub draft_model: Option<String>,
}

/// Most tokens one step may propose per sequence (each costs a row of verification).
pub const MAX_SPECULATIVE_TOKENS: usize = 32;
/// Longest n-gram looked up.
pub const MAX_PROMPT_LOOKUP: usize = 64;

/// The JSON as vLLM names its keys; anything else is refused by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    method: Option<String>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_min: Option<usize>,
    prompt_lookup_max: Option<usize>,
    model: Option<String>,
    disable_by_batch_size: Option<usize>,
}

impl SpeculativeConfig {
    /// Parse and check `--speculative-config`; every error names the key at fault.
    pub fn parse(json: &str) -> Result<Self, EngineError> {
        let bad = |m: String| EngineError::InvalidRequest(format!("--speculative-config: {m}"));
        let raw: RawConfig = serde_json::from_str(json).map_err(|e| bad(format!("not a valid config object: {e}")))?;
        // As vLLM: without a method, a model means a draft model and no model means n-gram.
        let method = match (raw.method.as_deref(), raw.model.as_deref()) {
            (Some("ngram"), None) | (None, None) => SpecMethod::Ngram,
            (Some("ngram"), Some(_)) => return Err(bad("\"model\" is not used by method \"ngram\"; remove it".into())),
            (Some("draft_model"), Some(_)) | (None, Some(_)) => SpecMethod::DraftModel,
            (Some("draft_model"), None) => {
                return Err(bad(
                    "method \"draft_model\" needs \"model\": the draft's directory, GGUF file or hub id".into()
                ))
            }
            (Some(other), _) => {
                return Err(bad(format!("unknown method {other:?}; flint supports \"ngram\" and \"draft_model\"")));
            }
        };
        let k = raw.num_speculative_tokens.ok_or_else(|| bad("\"num_speculative_tokens\" is required".into()))?;
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
            return Err(bad(format!(
                "\"num_speculative_tokens\" must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k}"
            )));
        }
        // As vLLM: both omitted → 5 and 5; one given → the other copies it.
        let (min, max) = match (raw.prompt_lookup_min, raw.prompt_lookup_max) {
            (None, None) => (5, 5),
            (Some(a), None) => (a, a),
            (None, Some(b)) => (b, b),
            (Some(a), Some(b)) => (a, b),
        };
        if min == 0 || max > MAX_PROMPT_LOOKUP || min > max {
            return Err(bad(format!(
                "\"prompt_lookup_min\" ({min}) and \"prompt_lookup_max\" ({max}) must satisfy 1 <= min <= max <= \
                 {MAX_PROMPT_LOOKUP}"
            )));
        }
        if raw.disable_by_batch_size == Some(0) {
            return Err(bad("\"disable_by_batch_size\" must be at least 1 (omit it to always speculate)".into()));
        }
        Ok(Self {
            method,
            num_speculative_tokens: k,
            prompt_lookup_min: min,
            prompt_lookup_max: max,
            disable_by_batch_size: raw.disable_by_batch_size,
            draft_model: raw.model.filter(|_| method == SpecMethod::DraftModel),
        })
    }
}

/// One sequence's proposer: the n-gram index over its tokens and how many tokens it proposes
/// now. The draft length adapts to what the target accepts: it doubles (up to k) after a fully
/// accepted draft and drops to one past the accepted prefix after a partial one. After a draft
/// of which nothing was accepted, or while the acceptance rate (a moving average, halving the
/// weight of older drafts) is below [`MIN_ACCEPTANCE`], the sequence pauses proposing for 1, 2,
/// 4, … up to [`MAX_BACKOFF`] steps — so a workload that never or seldom repeats pays for
/// almost no verification rows.
#[derive(Debug, Clone)]
pub struct Drafter {
    /// N-gram lookup's index (`None` with a draft model, which proposes in the runner).
    index: Option<ngram::NgramIndex>,
    k: usize,
    len: usize,
    /// Steps left before the next proposal, and the pause after the next miss.
    pause: usize,
    backoff: usize,
    /// Moving average of accepted / proposed.
    rate: f64,
}

/// Longest pause after consecutive drafts of which nothing was accepted.
pub const MAX_BACKOFF: usize = 64;
/// Below this acceptance rate a draft costs more than it saves: a verification row costs about
/// a fifth of a one-row decode step of qwen2.5-0.5b on a CPU (less for larger models), and a
/// draft token pays off only when accepted.
pub const MIN_ACCEPTANCE: f64 = 0.3;

impl Drafter {
    pub fn new(cfg: &SpeculativeConfig) -> Self {
        Self {
            index: (cfg.method == SpecMethod::Ngram)
                .then(|| ngram::NgramIndex::new(cfg.prompt_lookup_min, cfg.prompt_lookup_max)),
            k: cfg.num_speculative_tokens,
            len: cfg.num_speculative_tokens,
            pause: 0,
            backoff: 1,
            rate: 1.0,
        }
    }

    /// Up to `limit` proposed tokens to follow `tokens` (the sequence's prompt and output so
    /// far, of which the index has seen any prefix). Empty when pausing or nothing matches.
    pub fn propose(&mut self, tokens: &[u32], limit: usize) -> Vec<u32> {
        let Some(index) = self.index.as_mut() else { return Vec::new() };
        index.extend(tokens);
        if self.pause > 0 {
            self.pause -= 1;
            return Vec::new();
        }
        index.propose(tokens, self.len.min(limit))
    }

    /// How many tokens a draft model should propose now (at most `limit`; 0 while pausing).
    pub fn next_len(&mut self, limit: usize) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        self.len.min(limit)
    }

    /// The target accepted `accepted` of the `proposed` tokens of this sequence's last draft.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.rate = 0.5 * self.rate + 0.5 * accepted as f64 / proposed as f64;
        self.len = if accepted == 0 {
            1
        } else if accepted == proposed {
            (self.len * 2).min(self.k)
        } else {
            (accepted + 1).min(self.k)
        };
        if accepted == 0 || self.rate < MIN_ACCEPTANCE {
            self.pause = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        } else {
            self.backoff = 1;
        }
    }

    /// Tokens the next proposal may hold at most (tests and logs).
    pub fn draft_len(&self) -> usize {
        self.len
    }
}

/// Acceptance counters since start (vLLM's `spec_decode` metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecCounters {
    /// Verification passes that carried a draft.
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Entry `i`: drafts whose token at position `i` was accepted.
    pub accepted_per_pos: Vec<u64>,
}

impl SpecCounters {
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.drafts += 1;
        self.draft_tokens += proposed as u64;
        self.accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < proposed {
            self.accepted_per_pos.resize(proposed, 0);
        }
        for slot in &mut self.accepted_per_pos[..accepted] {
            *slot += 1;
        }
    }

    /// `1 + accepted / drafts`: tokens each verification yields on average, the bonus included.
    pub fn mean_acceptance_length(&self) -> f64 {
        1.0 + self.accepted_tokens as f64 / self.drafts.max(1) as f64
    }

    pub fn acceptance_rate(&self) -> f64 {
        self.accepted_tokens as f64 / self.draft_tokens.max(1) as f64
    }

    /// vLLM's periodic line.
    pub fn log_line(&self) -> String {
        let per_pos: Vec<String> =
            self.accepted_per_pos.iter().map(|&a| format!("{:.3}", a as f64 / self.drafts.max(1) as f64)).collect();
        format!(
            "SpecDecoding metrics: Mean acceptance length: {:.2}, Accepted: {} tokens, Drafted: {} tokens, \
             Per-position acceptance rate: {}, Avg Draft acceptance rate: {:.1}%",
            self.mean_acceptance_length(),
            self.accepted_tokens,
            self.draft_tokens,
            per_pos.join(", "),
            100.0 * self.acceptance_rate()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        SpeculativeConfig::parse(json).unwrap_err().to_string()
    }

    #[test]
    fn parses_vllm_keys_and_defaults() {
        let c = SpeculativeConfig::parse(r#"{"method": "ngram", "num_speculative_tokens": 4}"#).unwrap();
        assert_eq!((c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max), (4, 5, 5));
        assert_eq!(c.disable_by_batch_size, None);
        let c = SpeculativeConfig::parse(r#"{"num_speculative_tokens": 2, "prompt_lookup_max": 3}"#).unwrap();
        assert_eq!((c.method, c.prompt_lookup_min, c.prompt_lookup_max), (SpecMethod::Ngram, 3, 3));
        let c = SpeculativeConfig::parse(
            r#"{"method":"ngram","num_speculative_tokens":8,"prompt_lookup_min":2,"prompt_lookup_max":6,"disable_by_batch_size":4}"#,
        )
        .unwrap();
        assert_eq!((c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size), (2, 6, Some(4)));
    }

    #[test]
    fn bad_configs_name_the_key() {
        assert!(err(r#"{"method": "ngram"}"#).contains("num_speculative_tokens"));
        assert!(err(r#"{"method": "ngram", "num_speculative_tokens": 0}"#).contains("between 1 and"));
        assert!(err(r#"{"method": "eagle", "num_speculative_tokens": 2}"#).contains("unknown method \"eagle\""));
        assert!(err(r#"{"method": "draft_model", "num_speculative_tokens": 2}"#).contains("needs \"model\""));
        let c = SpeculativeConfig::parse(r#"{"model": "d.gguf", "num_speculative_tokens": 3}"#).unwrap();
        assert_eq!((c.method, c.draft_model.as_deref()), (SpecMethod::DraftModel, Some("d.gguf")));
        assert!(err(r#"{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#)
            .contains("prompt_lookup_min"));
        assert!(err(r#"{"num_speculative_tokens": 2, "typo": 1}"#).contains("typo"));
        assert!(err("[1]").contains("--speculative-config"));
        assert!(err(r#"{"num_speculative_tokens": 2, "disable_by_batch_size": 0}"#).contains("disable_by_batch_size"));
    }

    #[test]
    fn draft_length_adapts_and_backs_off() {
        let cfg = SpeculativeConfig::parse(r#"{"num_speculative_tokens": 8, "prompt_lookup_min": 2}"#).unwrap();
        let mut d = Drafter::new(&cfg);
        let toks = [1, 2, 3, 4, 1, 2];
        assert_eq!(d.propose(&toks, 8), vec![3, 4, 1, 2]);
        d.observe(4, 2);
        assert_eq!(d.draft_len(), 3);
        d.observe(3, 3);
        assert_eq!(d.draft_len(), 6);
        // Nothing accepted: one token next time, after a pause that doubles with each miss.
        d.observe(6, 0);
        assert_eq!(d.draft_len(), 1);
        assert!(d.propose(&toks, 8).is_empty(), "paused for one step");
        assert_eq!(d.propose(&toks, 8), vec![3]);
        d.observe(1, 0);
        assert!(d.propose(&toks, 8).is_empty() && d.propose(&toks, 8).is_empty());
        assert_eq!(d.propose(&toks, 8).len(), 1);
        d.observe(1, 1);
        assert_eq!(d.draft_len(), 2);
        // A quarter accepted, draft after draft: the average sinks below MIN_ACCEPTANCE and the
        // pauses grow.
        for _ in 0..4 {
            d.observe(4, 1);
        }
        assert!(d.rate < MIN_ACCEPTANCE);
        let skipped = (0..10).take_while(|_| d.propose(&toks, 8).is_empty()).count();
        assert!(skipped >= 2, "paused {skipped} steps");
    }

    #[test]
    fn counters_follow_vllm_definitions() {
        let mut c = SpecCounters::default();
        c.record(3, 2);
        c.record(3, 0);
        c.record(0, 0);
        assert_eq!((c.drafts, c.draft_tokens, c.accepted_tokens), (2, 6, 2));
        assert_eq!(c.accepted_per_pos, vec![1, 1, 0]);
        assert!((c.mean_acceptance_length() - 2.0).abs() < 1e-12);
        assert!(c.log_line().contains("Mean acceptance length: 2.00"));
    }
}
