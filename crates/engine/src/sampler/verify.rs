//! Verifying a proposed token against the target's own sampling, for speculative decoding.
//!
//! A proposal here is one token with certainty (n-gram lookup, or a greedy draft): p_draft is a
//! point mass, so exact rejection sampling accepts the proposal `d` with probability
//! `min(1, p(d) / 1) = p(d)` and, on rejection, draws from `max(0, p − δ_d)` normalised — the
//! target's distribution without `d`. The token that comes out is distributed exactly as `p`,
//! the distribution after this request's bias, penalties, temperature, top-k, top-p and min-p:
//! the same [`support`] the plain draw uses. Greedy requests accept `d` when it is the argmax.

use rand::Rng;

use super::draw::{draw, drawable, support, Selection, Support};
use super::{argmax, masked_argmax, Sampler};

impl Sampler {
    /// The token for this row given the proposal `proposed`, and whether it is the proposal
    /// (accepted). Uses this sampler's generator: a seeded request stays reproducible.
    pub fn verify(&mut self, logits: &[f32], banned: &[u32], proposed: u32) -> (u32, bool) {
        if let Some(words) = self.greedy_mask_only(banned) {
            let t = masked_argmax(&logits[..self.width(logits)], words);
            return (t, t == proposed);
        }
        let row = if self.prepare(logits, banned) { &self.scratch[..] } else { &logits[..self.width(logits)] };
        if self.params.is_greedy() {
            let t = argmax(row);
            return (t, t == proposed);
        }
        let s = support(row, &self.params, &mut self.sel);
        let p = probability(&s, &self.sel, row, proposed);
        if self.rng.random::<f64>() < p {
            return (proposed, true);
        }
        // The residual: the same support with the proposal taken out.
        (draw(&s, &mut self.sel, row, &mut self.rng, Some(proposed)), false)
    }
}

/// `p(token)` under support `s`: its drawn weight over the support's drawn mass.
fn probability(s: &Support, sel: &Selection, row: &[f32], token: u32) -> f64 {
    if !drawable(s, sel, row, token) {
        return 0.0;
    }
    let mass = match *s {
        Support::Certain(_) => return 1.0,
        Support::Prefix { len } => len.checked_sub(1).map_or(0, |i| sel.cum[i]),
        Support::Nucleus { mass, .. } | Support::Row { mass } => mass,
    };
    if mass == 0 {
        return 0.0;
    }
    sel.drawn[token as usize] as f64 / mass as f64
}

#[cfg(test)]
mod tests {
    use crate::sampler::{Sampler, SamplingParams};

    /// Chi-square statistic of `counts` against probabilities `p` over `n` draws.
    fn chi_square(counts: &[u64], p: &[f64], n: u64) -> f64 {
        counts
            .iter()
            .zip(p)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&c, &p)| (c as f64 - p * n as f64).powi(2) / (p * n as f64))
            .sum()
    }

    /// The verified token is distributed as the target's sampling distribution, whichever
    /// proposal comes in: likely, unlikely, outside top-k, and the favourite.
    #[test]
    fn verified_tokens_follow_the_target_distribution() {
        let logits = [2.0f32, 1.5, 1.0, 0.2, -0.5, -3.0, 0.8, -1.0];
        let params = SamplingParams { temperature: 0.8, top_k: 6, top_p: 0.97, min_p: 0.01, ..Default::default() };
        let p: Vec<f64> = {
            let mut s = Sampler::new(params.clone(), logits.len());
            let w = s.support_weights(&logits);
            let total: f64 = w.iter().map(|x| x.1).sum();
            let mut p = vec![0.0; logits.len()];
            for (id, x) in w {
                p[id as usize] = x / total;
            }
            p
        };
        assert!(p.iter().filter(|&&x| x > 0.0).count() >= 4 && p[5] == 0.0);
        const N: u64 = 20_000;
        for proposed in [0u32, 1, 3, 5] {
            let mut counts = vec![0u64; logits.len()];
            let mut accepted = 0u64;
            for seed in 0..N {
                let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..params.clone() }, logits.len());
                let (t, ok) = s.verify(&logits, &[], proposed);
                assert_eq!(ok, t == proposed);
                counts[t as usize] += 1;
                accepted += u64::from(ok);
            }
            // 0.1% critical value of chi-square with 5 degrees of freedom (6 kept tokens).
            let x2 = chi_square(&counts, &p, N);
            assert!(x2 < 20.52, "proposal {proposed}: chi-square {x2:.2}, counts {counts:?}, p {p:?}");
            assert_eq!(counts[5], 0, "outside the support, never accepted");
            let rate = accepted as f64 / N as f64;
            assert!((rate - p[proposed as usize]).abs() < 0.02, "acceptance {rate} vs p {}", p[proposed as usize]);
        }
    }

    #[test]
    fn greedy_accepts_only_the_argmax_and_banned_ids_never_pass() {
        let logits = [0.5f32, 3.0, 1.0];
        let mut s = Sampler::new(SamplingParams::default(), 3);
        assert_eq!(s.verify(&logits, &[], 1), (1, true));
        assert_eq!(s.verify(&logits, &[], 2), (1, false));
        assert_eq!(s.verify(&logits, &[1], 1), (2, false));
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, seed: Some(3), ..Default::default() }, 3);
        for _ in 0..200 {
            assert_ne!(s.verify(&logits, &[1], 1).0, 1);
        }
    }
}
