//! Choosing the next token from one row of logits, in vLLM's order: logit bias and banned ids,
//! then repetition, frequency and presence penalties, then greedy argmax or temperature, top-k,
//! top-p (nucleus) and min-p sampling from a seeded generator, so a given seed reproduces its
//! output. Ids past the tokenizer's length (the checkpoint's padded vocabulary: 151,936 rows for
//! 151,665 tokens) are never chosen. Also the log-probabilities reported to clients.
//!
//! [`Sampler`] is one sequence's state and the order of the steps; each step has its module:
//! `params` the settings, `transforms` what is done to the row before the draw (grammar mask,
//! bias, bans, penalties), `order` the best-first order of candidates (a radix sort), `draw`
//! temperature, top-k, top-p, min-p and the seeded draw (`weights` its vectorised exp), `verify`
//! speculative verification and `logprobs` the reported log-probabilities. The plain argmax is a
//! model kernel ([`flint_model::kernels::argmax`]), re-exported here.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::SeedableRng;

mod draw;
mod logprobs;
mod order;
mod params;
mod transforms;
mod verify;
mod weights;

pub use flint_model::kernels::argmax::argmax;
pub use logprobs::{token_logprobs, TokenLogprobs};
pub use params::SamplingParams;
pub use transforms::masked_argmax;

use draw::{draw, support, Selection};

/// One sequence's sampler. Owns the seeded generator, which only advances when this sequence
/// draws, so a seeded request reproduces whatever else is batched with it. What feeds the
/// transforms (`set_prompt`, `record`, `set_allowed`) is with them in `transforms`; `verify` is
/// in its module.
pub struct Sampler {
    params: SamplingParams,
    /// Ids `>= valid_vocab` are padding rows of the embedding and are never sampled.
    valid_vocab: usize,
    rng: StdRng,
    /// Occurrences of each generated id; only kept when presence or frequency penalty is on.
    output_counts: HashMap<u32, u32>,
    /// Prompt and generated ids; only kept when the repetition penalty is on.
    seen: HashSet<u32>,
    /// The processed row, reused so a step allocates nothing.
    scratch: Vec<f32>,
    /// Top-k / top-p / min-p working buffers, reused for the same reason.
    sel: Selection,
    /// The allowed ids of the next draw as a bitset (bit `i % 32` of word `i / 32`), set by a
    /// grammar before each constrained draw; `None` leaves every id allowed.
    allowed: Option<Vec<u32>>,
}

impl Sampler {
    pub fn new(params: SamplingParams, valid_vocab: usize) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            params,
            valid_vocab,
            rng,
            output_counts: HashMap::new(),
            seen: HashSet::new(),
            scratch: Vec::new(),
            sel: Selection::default(),
            allowed: None,
        }
    }

    /// Pick a token from `logits` (one row, the model's full padded width). `banned` ids cannot be
    /// chosen (stop ids before `min_tokens`).
    pub fn sample(&mut self, logits: &[f32], banned: &[u32]) -> u32 {
        if let Some(words) = self.greedy_mask_only(banned) {
            return masked_argmax(&logits[..self.width(logits)], words);
        }
        let row = if self.prepare(logits, banned) { &self.scratch[..] } else { &logits[..self.width(logits)] };
        if self.params.is_greedy() {
            return argmax(row);
        }
        let support = support(row, &self.params, &mut self.sel);
        draw(&support, &mut self.sel, row, &mut self.rng, None)
    }

    /// The mask, when it is all there is to a greedy draw: the argmax then reads only the
    /// allowed ids instead of writing a masked copy of the row.
    fn greedy_mask_only(&self, banned: &[u32]) -> Option<&[u32]> {
        let only = self.params.is_greedy()
            && banned.is_empty()
            && self.params.logit_bias.is_empty()
            && self.output_counts.is_empty()
            && self.seen.is_empty();
        self.allowed.as_deref().filter(|_| only)
    }

    fn width(&self, logits: &[f32]) -> usize {
        logits.len().min(self.valid_vocab).max(1).min(logits.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    pub(super) fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed: Some(seed), ..Default::default() }
    }

    #[test]
    fn greedy_ignores_padded_vocab() {
        let mut logits = vec![0.0f32; 10];
        logits[3] = 1.0;
        logits[8] = 5.0; // a padding row must never win
        let mut s = Sampler::new(SamplingParams::default(), 6);
        assert_eq!(s.sample(&logits, &[]), 3);
        let mut s = Sampler::new(params(1.0, 0.9, 0, 4), 6);
        assert!((0..300).all(|_| s.sample(&logits, &[]) < 6));
        let mut s = Sampler::new(params(1.0, 1.0, 0, 4), 6);
        assert!((0..300).all(|_| s.sample(&logits, &[]) < 6));
    }

    #[test]
    fn seeded_sampling_with_every_option_is_reproducible() {
        let mut rng = StdRng::seed_from_u64(11);
        let rows: Vec<Vec<f32>> = (0..40).map(|_| (0..2000).map(|_| rng.random::<f32>() * 4.0).collect()).collect();
        let p = SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            min_p: 0.02,
            presence_penalty: 0.5,
            frequency_penalty: 0.3,
            repetition_penalty: 1.2,
            logit_bias: vec![(5, 2.0)],
            seed: Some(99),
            ..Default::default()
        };
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), 1990);
            s.set_prompt(&[1, 2, 3]);
            rows.iter()
                .map(|r| {
                    let t = s.sample(r, &[7]);
                    s.record(t);
                    t
                })
                .collect::<Vec<_>>()
        };
        let a = run(&p);
        assert_eq!(a, run(&p));
        assert_ne!(a, run(&SamplingParams { seed: Some(100), ..p.clone() }));
        assert!(a.iter().all(|&t| t < 1990 && t != 7));
    }
}
