//! Choosing the next token from one row of logits: greedy at temperature 0, otherwise temperature,
//! top-k and top-p (nucleus) sampling from a seeded generator, so a given seed reproduces its
//! output. Ids past the tokenizer's length (the checkpoint's padded vocabulary: 151,936 rows for
//! 151,665 tokens) are never chosen.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Validated sampling settings for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: 0, seed: None }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        Ok(())
    }

    /// Temperatures below 1e-5 (vLLM's threshold) are greedy: dividing by them overflows.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5 || self.top_k == 1
    }
}

pub struct Sampler {
    params: SamplingParams,
    /// Ids `>= valid_vocab` are padding rows of the embedding and are never sampled.
    valid_vocab: usize,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams, valid_vocab: usize) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self { params, valid_vocab, rng }
    }

    /// Pick a token from `logits` (one row, the model's full padded width).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let n = logits.len().min(self.valid_vocab).max(1).min(logits.len());
        let logits = &logits[..n];
        if self.params.is_greedy() {
            return argmax(logits);
        }
        // A +inf logit (16-bit overflow) is a certainty; NaN and -inf are never candidates.
        if let Some(i) = logits.iter().position(|&l| l == f32::INFINITY) {
            return i as u32;
        }
        let inv_t = 1.0 / self.params.temperature;
        // Candidates: the top-k ids (all ids when top-k is off), best first.
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as u32, l)).collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.params.top_k > 0 && self.params.top_k < cand.len() {
            cand.select_nth_unstable_by(self.params.top_k - 1, desc);
            cand.truncate(self.params.top_k);
        }
        cand.sort_unstable_by(desc);
        // Scale after subtracting the max: (l - max) ≤ 0, so the exponent never overflows.
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, l)| ((l - max) * inv_t).exp()).collect();
        let total: f32 = probs.iter().sum();
        if !total.is_finite() || total <= 0.0 {
            return cand[0].0;
        }
        probs.iter_mut().for_each(|p| *p /= total);
        // Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
        let mut keep = probs.len();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        for i in 0..keep {
            r -= probs[i];
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

/// Index of the largest value; the lowest index wins ties, NaN never wins.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best_v {
            best = i;
            best_v = x;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_ignores_padded_vocab() {
        let mut logits = vec![0.0f32; 10];
        logits[3] = 1.0;
        logits[8] = 5.0; // a padding row must never win
        let mut s = Sampler::new(SamplingParams::default(), 6);
        assert_eq!(s.sample(&logits), 3);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 5, seed: Some(7) };
        let mut top5: Vec<u32> = (0..100u32).collect();
        top5.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top5.truncate(5);
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), 100);
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = draw(&p);
        assert_eq!(a, draw(&p));
        assert!(a.iter().all(|t| top5.contains(t)));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
    }

    #[test]
    fn extreme_values_never_pick_the_least_likely() {
        let logits = vec![1.0f32, f32::NAN, 3.0, f32::NEG_INFINITY, 2.0];
        for t in [1e-30f32, 1e-6, 1e-3, 1.0, 1e30] {
            let mut s = Sampler::new(SamplingParams { temperature: t, top_p: 1.0, top_k: 0, seed: Some(3) }, 5);
            let picks: Vec<u32> = (0..50).map(|_| s.sample(&logits)).collect();
            assert!(picks.iter().all(|&p| p == 0 || p == 2 || p == 4), "t={t}: {picks:?}");
            if t <= 1e-3 {
                assert!(picks.iter().all(|&p| p == 2), "t={t}: {picks:?}");
            }
        }
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: Some(3) }, 3);
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0]), 1);
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = vec![0.1f32, 3.0, 0.2, 2.9];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 1e-6, top_k: 0, seed: Some(1) }, 4);
        assert!((0..50).all(|_| s.sample(&logits) == 1));
    }

    #[test]
    fn validation_names_the_parameter() {
        let bad = SamplingParams { temperature: -1.0, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("temperature"));
        let bad = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("top_p"));
    }
}
