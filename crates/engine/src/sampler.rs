//! Choosing the next token from one row of logits, in vLLM's order: logit bias and banned ids,
//! then repetition, frequency and presence penalties, then greedy argmax or temperature, top-k,
//! top-p (nucleus) and min-p sampling from a seeded generator, so a given seed reproduces its
//! output. Ids past the tokenizer's length (the checkpoint's padded vocabulary: 151,936 rows for
//! 151,665 tokens) are never chosen. Also the log-probabilities reported to clients.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

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
    /// 0 disables; otherwise tokens less likely than `min_p` times the most likely one are dropped.
    pub min_p: f32,
    /// Subtracted once from the logit of every token the output already holds; 0 disables.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the output; 0 disables.
    pub frequency_penalty: f32,
    /// 1.0 disables; positive logits of prompt and output tokens are divided by it, negative ones
    /// multiplied, so it always makes a repeat less likely.
    pub repetition_penalty: f32,
    /// Added to the listed ids' logits (each entry is applied, so repeated ids add up).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("presence_penalty must be in [-2, 2], got {0}")]
    PresencePenalty(f32),
    #[error("frequency_penalty must be in [-2, 2], got {0}")]
    FrequencyPenalty(f32),
    #[error("repetition_penalty must be a finite number > 0, got {0}")]
    RepetitionPenalty(f32),
    #[error("logit_bias for token {token} must be in [-100, 100], got {bias}")]
    LogitBias { token: u32, bias: f32 },
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(SamplingError::PresencePenalty(self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(SamplingError::FrequencyPenalty(self.frequency_penalty));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplingError::RepetitionPenalty(self.repetition_penalty));
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(SamplingError::LogitBias { token, bias });
        }
        Ok(())
    }

    /// Temperatures below 1e-5 (vLLM's threshold) are greedy: dividing by them overflows.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5 || self.top_k == 1
    }

    fn counts_output(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    fn tracks_repeats(&self) -> bool {
        self.repetition_penalty != 1.0
    }
}

/// First size of the partial selection for top-p; grown ×4 while the mass falls short. Most
/// nucleus cuts on real model rows fall within the first few dozen tokens.
const NUCLEUS_FIRST: usize = 64;

/// One sequence's sampler. Owns the seeded generator, which only advances when this sequence
/// draws, so a seeded request reproduces whatever else is batched with it.
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
    /// Candidate (id, logit) pairs for top-k / top-p selection.
    cand: Vec<(u32, f32)>,
    /// Per-id weights when drawing over the whole row.
    weights: Vec<f64>,
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
            cand: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Record the prompt's ids for the repetition penalty (a no-op when it is off).
    pub fn set_prompt(&mut self, prompt: &[u32]) {
        if self.params.tracks_repeats() {
            self.seen.extend(prompt.iter().copied());
        }
    }

    /// Record a generated token for the penalties.
    pub fn record(&mut self, token: u32) {
        if self.params.counts_output() {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
        if self.params.tracks_repeats() {
            self.seen.insert(token);
        }
    }

    /// Pick a token from `logits` (one row, the model's full padded width). `banned` ids cannot be
    /// chosen (stop ids before `min_tokens`).
    pub fn sample(&mut self, logits: &[f32], banned: &[u32]) -> u32 {
        let row = if self.prepare(logits, banned) { &self.scratch[..] } else { &logits[..self.width(logits)] };
        if self.params.is_greedy() {
            return argmax(row);
        }
        let support = support(row, &self.params, &mut self.cand, &mut self.weights);
        draw(support, &self.params, &self.cand, &self.weights, &mut self.rng)
    }

    fn width(&self, logits: &[f32]) -> usize {
        logits.len().min(self.valid_vocab).max(1).min(logits.len())
    }

    /// Applies bias, bans and penalties into `scratch` when any is in effect (true); otherwise the
    /// raw row is used as it is, saving a copy of 150k floats per greedy step.
    fn prepare(&mut self, logits: &[f32], banned: &[u32]) -> bool {
        if self.params.logit_bias.is_empty()
            && banned.is_empty()
            && self.output_counts.is_empty()
            && self.seen.is_empty()
        {
            return false;
        }
        let n = self.width(logits);
        let row = &mut self.scratch;
        row.clear();
        row.extend_from_slice(&logits[..n]);
        for &(id, bias) in &self.params.logit_bias {
            if let Some(l) = row.get_mut(id as usize) {
                *l += bias;
            }
        }
        for &id in banned {
            if let Some(l) = row.get_mut(id as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        let rep = self.params.repetition_penalty;
        for &id in &self.seen {
            if let Some(l) = row.get_mut(id as usize) {
                *l = if *l > 0.0 { *l / rep } else { *l * rep };
            }
        }
        let (freq, pres) = (self.params.frequency_penalty, self.params.presence_penalty);
        for (&id, &count) in &self.output_counts {
            if let Some(l) = row.get_mut(id as usize) {
                *l -= freq * count as f32 + pres;
            }
        }
        true
    }

    /// The ids that can be drawn and their unnormalised weights, sorted by id.
    #[cfg(test)]
    fn support_weights(&mut self, logits: &[f32]) -> Vec<(u32, f64)> {
        let row = &logits[..self.width(logits)];
        let mut out: Vec<(u32, f64)> = match support(row, &self.params, &mut self.cand, &mut self.weights) {
            Support::Certain(id) => vec![(id, 1.0)],
            Support::Prefix { len, max } => {
                let inv_t = 1.0 / f64::from(self.params.temperature);
                self.cand[..len].iter().map(|&(id, l)| (id, weight(l, max, inv_t))).collect()
            }
            Support::Row { .. } => self.weights.iter().enumerate().map(|(i, &w)| (i as u32, w)).collect(),
        };
        out.retain(|&(_, w)| w > 0.0);
        out.sort_by_key(|&(id, _)| id);
        out
    }

    #[cfg(test)]
    fn processed(&mut self, logits: &[f32], banned: &[u32]) -> Vec<f32> {
        if self.prepare(logits, banned) {
            self.scratch.clone()
        } else {
            logits[..self.width(logits)].to_vec()
        }
    }
}

/// What a draw chooses from.
enum Support {
    Certain(u32),
    /// `cand[..len]`, best first; `max` is the row's largest finite logit.
    Prefix {
        len: usize,
        max: f32,
    },
    /// Every id, weighted by `weights` (0 for excluded ids); `mass` is their sum.
    Row {
        mass: f64,
    },
}

/// `exp((l - max) / T)`: subtracting the max first keeps the exponent ≤ 0, so it never overflows.
fn weight(l: f32, max: f32, inv_t: f64) -> f64 {
    ((f64::from(l) - f64::from(max)) * inv_t).exp()
}

/// Best first, ties to the lower id: the order the full-sort definitions of top-k and top-p use.
/// Only ever sees finite logits (so the order is total) with -0.0 folded into 0.0 (so it ties).
fn desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

fn candidate(i: usize, l: f32) -> (u32, f32) {
    (i as u32, if l == 0.0 { 0.0 } else { l })
}

/// Applies temperature, top-k, top-p and min-p to `row` without sorting the whole vocabulary:
/// top-k selects k candidates, top-p selects a growing prefix until its mass suffices, and with
/// neither the draw runs over the row itself.
fn support(row: &[f32], p: &SamplingParams, cand: &mut Vec<(u32, f32)>, weights: &mut Vec<f64>) -> Support {
    // A +inf logit (16-bit overflow) is a certainty; NaN and -inf are never candidates.
    if let Some(i) = row.iter().position(|&l| l == f32::INFINITY) {
        return Support::Certain(i as u32);
    }
    let (mut max, mut finite) = (f32::NEG_INFINITY, 0usize);
    for &l in row.iter().filter(|l| l.is_finite()) {
        max = max.max(l);
        finite += 1;
    }
    if finite == 0 {
        return Support::Certain(argmax(row));
    }
    let inv_t = 1.0 / f64::from(p.temperature);
    // min-p keeps p_i >= min_p * p_max, i.e. weight >= min_p since the best token weighs 1; the
    // ratio survives the renormalisation of top-k and top-p, so applying it last is the same cut.
    let min_w = f64::from(p.min_p);
    let top_k = p.top_k > 0 && p.top_k < finite;
    if !top_k && p.top_p >= 1.0 {
        weights.clear();
        weights.extend(row.iter().map(|&l| {
            let w = if l.is_finite() { weight(l, max, inv_t) } else { 0.0 };
            if w >= min_w {
                w
            } else {
                0.0
            }
        }));
        return Support::Row { mass: weights.iter().sum() };
    }
    cand.clear();
    cand.extend(row.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| candidate(i, l)));
    let total: f64 = if top_k {
        cand.select_nth_unstable_by(p.top_k - 1, desc);
        cand.truncate(p.top_k);
        cand.sort_unstable_by(desc);
        cand.iter().map(|&(_, l)| weight(l, max, inv_t)).sum()
    } else {
        row.iter().filter(|l| l.is_finite()).map(|&l| weight(l, max, inv_t)).sum()
    };
    // Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
    let target = if p.top_p < 1.0 { f64::from(p.top_p) * total } else { f64::INFINITY };
    let mut acc = 0.0;
    let mut sorted = if top_k { cand.len() } else { 0 };
    let mut scanned = 0;
    let mut m = NUCLEUS_FIRST;
    loop {
        let end = if top_k { cand.len() } else { m.min(cand.len()) };
        if end > sorted {
            // cand[..sorted] outranks everything after it, so selecting within the rest extends
            // the sorted prefix.
            if end < cand.len() {
                cand[sorted..].select_nth_unstable_by(end - sorted - 1, desc);
            }
            cand[sorted..end].sort_unstable_by(desc);
            sorted = end;
        }
        for (i, &(_, l)) in cand[..end].iter().enumerate().skip(scanned) {
            let w = weight(l, max, inv_t);
            if w < min_w {
                return Support::Prefix { len: i.max(1), max };
            }
            acc += w;
            if acc >= target {
                return Support::Prefix { len: i + 1, max };
            }
        }
        if end == cand.len() {
            return Support::Prefix { len: end, max };
        }
        scanned = end;
        m = m.saturating_mul(4);
    }
}

fn draw(s: Support, p: &SamplingParams, cand: &[(u32, f32)], weights: &[f64], rng: &mut StdRng) -> u32 {
    match s {
        Support::Certain(id) => id,
        Support::Prefix { len, max } => {
            let inv_t = 1.0 / f64::from(p.temperature);
            let kept = &cand[..len];
            let mass: f64 = kept.iter().map(|&(_, l)| weight(l, max, inv_t)).sum();
            let r = rng.random::<f64>() * mass;
            let mut acc = 0.0;
            // The best token always weighs 1, so it is the fallback when rounding leaves r >= acc.
            let mut last = kept.first().map_or(0, |c| c.0);
            for &(id, l) in kept {
                let w = weight(l, max, inv_t);
                if w > 0.0 {
                    acc += w;
                    last = id;
                    if r < acc {
                        return id;
                    }
                }
            }
            last
        }
        Support::Row { mass } => {
            let r = rng.random::<f64>() * mass;
            let mut acc = 0.0;
            let mut last = 0;
            for (i, &w) in weights.iter().enumerate() {
                if w > 0.0 {
                    acc += w;
                    last = i;
                    if r < acc {
                        return i as u32;
                    }
                }
            }
            last as u32
        }
    }
}

/// Index of the largest value; the lowest index wins ties, NaN never wins (0 when nothing beats
/// −∞).
///
/// Greedy decoding runs this over the whole vocabulary every step. One running maximum is a
/// chain of dependent compares (~0.2 ms for 152k logits, 1.6% of a small model's decode step),
/// so it takes two vectorisable passes instead: lane-wise maxima over 16 lanes, then the first
/// position holding the overall maximum.
pub fn argmax(v: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            // `x > m` is false for NaN, so NaN never enters a lane.
            *m = if x > *m { x } else { *m };
        }
    }
    let best = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    if best == f32::NEG_INFINITY {
        return 0;
    }
    const SCAN: usize = 64;
    for (ci, c) in v.chunks(SCAN).enumerate() {
        if c.iter().fold(false, |hit, &x| hit | (x == best)) {
            let at = c.iter().position(|&x| x == best).unwrap_or(0);
            return (ci * SCAN + at) as u32;
        }
    }
    0
}

/// The chosen token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The k most likely ids, best first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Up to this k the top ids are kept by insertion into a short sorted list (one comparison for
/// almost every id); beyond it a selection over all ids is cheaper.
const INSERTION_TOP_K: usize = 32;

/// Log-probabilities of the raw model row (before bias, penalties and temperature: vLLM's default
/// `raw_logprobs`) over the ids below `valid_vocab`.
pub fn token_logprobs(logits: &[f32], valid_vocab: usize, token: u32, k: usize) -> TokenLogprobs {
    let row = &logits[..logits.len().min(valid_vocab)];
    let Some(max) = row.iter().copied().filter(|l| !l.is_nan()).reduce(f32::max) else {
        return TokenLogprobs { token, logprob: f32::NEG_INFINITY, top: Vec::new() };
    };
    // Accumulating in f64 keeps 150k small terms from losing the tail of the normaliser.
    let log_z = row.iter().map(|&l| shifted(l, max).exp()).sum::<f64>().ln();
    let lp = |l: f32| (shifted(l, max) - log_z) as f32;
    let logprob = row.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
    let top = top_ids(row, k).into_iter().map(|(id, l)| (id, lp(l))).collect();
    TokenLogprobs { token, logprob, top }
}

/// `l - max`, with the values equal to an infinite max counting as 0: the limit of softmax is
/// uniform over them (all +inf, or every id at -inf). NaN has no probability.
fn shifted(l: f32, max: f32) -> f64 {
    if l.is_nan() {
        f64::NEG_INFINITY
    } else if l == max {
        0.0
    } else {
        f64::from(l) - f64::from(max)
    }
}

/// The k best non-NaN (id, logit) pairs in `desc` order.
fn top_ids(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let cands = row.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| candidate(i, l));
    if k <= INSERTION_TOP_K {
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        for c in cands {
            if top.len() == k && top.last().is_some_and(|worst| desc(&c, worst) != Ordering::Less) {
                continue;
            }
            let at = top.partition_point(|t| desc(t, &c) == Ordering::Less);
            top.insert(at, c);
            top.truncate(k);
        }
        return top;
    }
    let mut all: Vec<(u32, f32)> = cands.collect();
    if k < all.len() {
        all.select_nth_unstable_by(k - 1, desc);
        all.truncate(k);
    }
    all.sort_unstable_by(desc);
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
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
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(1.0, 1.0, 5, 7);
        let mut top5: Vec<u32> = (0..100u32).collect();
        top5.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top5.truncate(5);
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), 100);
            (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        let a = draw(&p);
        assert_eq!(a, draw(&p));
        assert!(a.iter().all(|t| top5.contains(t)));
        assert!(a.iter().collect::<HashSet<_>>().len() > 1);
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

    #[test]
    fn extreme_values_never_pick_the_least_likely() {
        let logits = vec![1.0f32, f32::NAN, 3.0, f32::NEG_INFINITY, 2.0];
        for t in [1e-30f32, 1e-6, 1e-3, 1.0, 1e30] {
            for top_p in [1.0, 0.99] {
                let mut s = Sampler::new(params(t, top_p, 0, 3), 5);
                let picks: Vec<u32> = (0..50).map(|_| s.sample(&logits, &[])).collect();
                assert!(picks.iter().all(|&p| p == 0 || p == 2 || p == 4), "t={t}: {picks:?}");
                if t <= 1e-3 {
                    assert!(picks.iter().all(|&p| p == 2), "t={t}: {picks:?}");
                }
            }
        }
        let mut s = Sampler::new(params(1.0, 1.0, 0, 3), 3);
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0], &[]), 1);
    }

    #[test]
    fn negative_zero_ties_with_zero() {
        let logits = [-0.0f32, 0.0, -1.0];
        let mut s = Sampler::new(params(1.0, 1.0, 1, 1), 3);
        assert_eq!(s.support_weights(&logits), vec![(0, 1.0)]);
        assert_eq!(token_logprobs(&logits, 3, 0, 1).top[0].0, 0);
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = vec![0.1f32, 3.0, 0.2, 2.9];
        let mut s = Sampler::new(params(1.0, 1e-6, 0, 1), 4);
        assert!((0..50).all(|_| s.sample(&logits, &[]) == 1));
    }

    #[test]
    fn validation_names_the_parameter() {
        let cases = [
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: 1.5, ..Default::default() }, "min_p"),
            (SamplingParams { min_p: f32::NAN, ..Default::default() }, "min_p"),
            (SamplingParams { presence_penalty: 2.5, ..Default::default() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: -2.1, ..Default::default() }, "frequency_penalty"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { repetition_penalty: f32::INFINITY, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { logit_bias: vec![(3, 1.0), (4, 101.0)], ..Default::default() }, "logit_bias"),
            (SamplingParams { logit_bias: vec![(3, f32::NAN)], ..Default::default() }, "logit_bias"),
        ];
        for (p, name) in cases {
            let err = p.validate().unwrap_err().to_string();
            assert!(err.contains(name), "{name}: {err}");
        }
        let ok = SamplingParams {
            min_p: 1.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            repetition_penalty: 0.5,
            logit_bias: vec![(1, -100.0), (2, 100.0)],
            ..Default::default()
        };
        assert_eq!(ok.validate(), Ok(()));
        assert!(SamplingParams::default().is_greedy());
    }

    #[test]
    fn presence_and_frequency_penalties_count_output_tokens_only() {
        let logits = [1.0f32, 2.0, 3.0, 0.5];
        let p = SamplingParams { presence_penalty: 0.25, frequency_penalty: 0.5, ..Default::default() };
        let mut s = Sampler::new(p, 4);
        s.set_prompt(&[3, 3, 3]);
        for t in [2, 1, 2] {
            s.record(t);
        }
        // id 2: 3 - 0.5*2 - 0.25; id 1: 2 - 0.5*1 - 0.25; id 3 only in the prompt.
        assert_eq!(s.processed(&logits, &[]), vec![1.0, 1.25, 1.75, 0.5]);

        let mut s = Sampler::new(SamplingParams { frequency_penalty: 1.0, ..Default::default() }, 4);
        assert_eq!(s.sample(&logits, &[]), 2);
        s.record(2);
        // 3 - 1 ties id 1's 2.0, and ties go to the lower id.
        assert_eq!(s.sample(&logits, &[]), 1);
    }

    #[test]
    fn repetition_penalty_covers_prompt_and_output_once_each() {
        let logits = [2.0f32, -1.0, 0.5, 1.0, 4.0];
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() }, 5);
        s.set_prompt(&[0, 1, 0]);
        s.record(2);
        s.record(2);
        assert_eq!(s.processed(&logits, &[]), vec![1.0, -2.0, 0.25, 1.0, 4.0]);
        // Off (1.0): nothing is tracked, the row is used as it is.
        let mut s = Sampler::new(SamplingParams::default(), 5);
        s.set_prompt(&[0, 1]);
        s.record(4);
        assert!(s.seen.is_empty() && s.output_counts.is_empty());
        assert_eq!(s.sample(&logits, &[]), 4);
    }

    /// The vectorised argmax against one running maximum: ties, NaN, infinities, short rows.
    #[test]
    fn argmax_is_the_first_largest_value() {
        fn reference(v: &[f32]) -> u32 {
            let (mut best, mut best_v) = (0, f32::NEG_INFINITY);
            for (i, &x) in v.iter().enumerate() {
                if x > best_v {
                    (best, best_v) = (i, x);
                }
            }
            best as u32
        }
        let mut state = 12345u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        for len in [0usize, 1, 2, 15, 16, 17, 63, 64, 65, 1000, 151_936] {
            for case in 0..6 {
                let mut v: Vec<f32> = (0..len).map(|_| (next() % 200) as f32 / 10.0 - 10.0).collect();
                if len > 0 {
                    let at = next() as usize % len;
                    match case {
                        1 => v.iter_mut().step_by(3).for_each(|x| *x = f32::NAN),
                        2 => v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                        3 => v.iter_mut().for_each(|x| *x = f32::NAN),
                        4 => v[at] = f32::INFINITY,
                        5 => {
                            v[at] = 50.0;
                            v[len - 1] = 50.0;
                        }
                        _ => {}
                    }
                }
                assert_eq!(argmax(&v), reference(&v), "len {len} case {case}");
            }
        }
    }

    #[test]
    fn logit_bias_forces_and_forbids() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).cos()).collect();
        let bias = |b: Vec<(u32, f32)>, t: f32| SamplingParams {
            logit_bias: b,
            temperature: t,
            seed: Some(5),
            ..Default::default()
        };
        let mut s = Sampler::new(bias(vec![(17, 100.0)], 0.0), 50);
        assert_eq!(s.sample(&logits, &[]), 17);
        let mut s = Sampler::new(bias(vec![(17, 100.0)], 1.0), 50);
        assert!((0..200).all(|_| s.sample(&logits, &[]) == 17));
        let best = argmax(&logits);
        let mut s = Sampler::new(bias(vec![(best, -100.0)], 0.0), 50);
        assert_ne!(s.sample(&logits, &[]), best);
        // Ids past the vocabulary are ignored rather than indexed.
        let mut s = Sampler::new(bias(vec![(60, 100.0), (1000, 5.0)], 0.0), 50);
        assert_eq!(s.sample(&logits, &[]), best);
        assert_eq!(s.processed(&logits, &[]), logits);
    }

    #[test]
    fn banned_ids_are_never_chosen() {
        let logits = [5.0f32, 4.9, 0.0, 4.8, -1.0];
        let mut s = Sampler::new(SamplingParams::default(), 5);
        assert_eq!(s.sample(&logits, &[0, 1]), 3);
        let mut s = Sampler::new(params(2.0, 1.0, 0, 8), 5);
        let picks: HashSet<u32> = (0..500).map(|_| s.sample(&logits, &[0, 3, 9])).collect();
        assert!(!picks.contains(&0) && !picks.contains(&3), "{picks:?}");
        assert_eq!(picks, HashSet::from([1, 2, 4]));
        let mut s = Sampler::new(params(2.0, 0.5, 2, 8), 5);
        assert!((0..200).all(|_| ![0, 1].contains(&s.sample(&logits, &[0, 1]))));
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_best() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        for (min_p, keep) in [(0.0, vec![0, 1, 2, 3]), (0.2, vec![0, 1, 2]), (0.5, vec![0, 1]), (1.0, vec![0])] {
            for top_p in [1.0, 0.999] {
                let p = SamplingParams { temperature: 1.0, min_p, top_p, seed: Some(2), ..Default::default() };
                let mut s = Sampler::new(p, 4);
                let kept: Vec<u32> = s.support_weights(&logits).iter().map(|&(id, _)| id).collect();
                assert_eq!(kept, keep, "min_p={min_p} top_p={top_p}");
                let picks: HashSet<u32> = (0..1000).map(|_| s.sample(&logits, &[])).collect();
                assert_eq!(picks, keep.iter().copied().collect::<HashSet<_>>(), "min_p={min_p} top_p={top_p}");
            }
        }
    }

    /// The definition: sort every finite id (best first, ties to the lower id), keep the top k,
    /// then the smallest prefix reaching top_p of the (top-k renormalised) mass, then min-p.
    fn full_sort_support(row: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
        let max = row.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / f64::from(p.temperature);
        let mut all: Vec<(u32, f32)> =
            row.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| candidate(i, l)).collect();
        all.sort_by(desc);
        let total: f64 = if p.top_k > 0 && p.top_k < all.len() {
            all.truncate(p.top_k);
            all.iter().map(|&(_, l)| weight(l, max, inv_t)).sum()
        } else {
            row.iter().filter(|l| l.is_finite()).map(|&l| weight(l, max, inv_t)).sum()
        };
        let target = if p.top_p < 1.0 { f64::from(p.top_p) * total } else { f64::INFINITY };
        let mut acc = 0.0;
        let mut out = Vec::new();
        for &(id, l) in &all {
            let w = weight(l, max, inv_t);
            if w < f64::from(p.min_p) {
                break;
            }
            out.push((id, w));
            acc += w;
            if acc >= target {
                break;
            }
        }
        out.retain(|&(_, w)| w > 0.0);
        out.sort_by_key(|&(id, _)| id);
        out
    }

    #[test]
    fn partial_selection_matches_the_full_sort_definition() {
        let mut rng = StdRng::seed_from_u64(1234);
        let mut grown = 0;
        for case in 0..400 {
            let wide = case % 100 == 0;
            let n = if wide { 151_936 } else { rng.random_range(1..400) };
            let scale = [0.5f32, 3.0, 12.0][rng.random_range(0..3)];
            let coarse = rng.random_bool(0.3); // many exact ties
            let row: Vec<f32> = (0..n)
                .map(|_| {
                    let x = (rng.random::<f32>() - 0.5) * scale;
                    match rng.random_range(0..40) {
                        0 => f32::NEG_INFINITY,
                        1 => f32::NAN,
                        2 => -0.0,
                        3 => 0.0,
                        _ if coarse => (x * 2.0).round() / 2.0,
                        _ => x,
                    }
                })
                .collect();
            let p = SamplingParams {
                temperature: [0.05f32, 0.7, 1.0, 2.5][rng.random_range(0..4)],
                top_k: if rng.random_bool(0.4) { rng.random_range(1..n + 5) } else { 0 },
                top_p: if rng.random_bool(0.8) { rng.random_range(0.01f32..=1.0) } else { 1.0 },
                min_p: if rng.random_bool(0.3) { rng.random_range(0.0f32..0.3) } else { 0.0 },
                seed: Some(case),
                ..Default::default()
            };
            let mut s = Sampler::new(p.clone(), n);
            let got = s.support_weights(&row);
            let want = full_sort_support(&row, &p);
            assert_eq!(got, want, "case {case}: n={n} {p:?}");
            if got.len() > NUCLEUS_FIRST {
                grown += 1;
            }
            let draws: HashSet<u32> = (0..if wide { 2 } else { 20 }).map(|_| s.sample(&row, &[])).collect();
            assert!(draws.iter().all(|d| want.iter().any(|&(id, _)| id == *d)), "case {case}");
        }
        assert!(grown > 5, "the ×4 growth path was exercised only {grown} times");
    }

    #[test]
    fn logprobs_are_normalised_ordered_and_ignore_padding() {
        let logits = [0.0f32, 3f32.ln(), 50.0];
        let lp = token_logprobs(&logits, 2, 1, 5);
        assert!((lp.logprob - 0.75f32.ln()).abs() < 1e-6, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0]);
        assert!((lp.top[1].1 - 0.25f32.ln()).abs() < 1e-6);
        assert!(token_logprobs(&logits, 2, 1, 0).top.is_empty());

        let mut rng = StdRng::seed_from_u64(3);
        let mut row: Vec<f32> = (0..151_936).map(|_| (rng.random::<f32>() - 0.5) * 20.0).collect();
        row[10] = 15.0;
        row[20] = 15.0;
        row[5] = 15.0;
        row[151_900] = 1000.0; // padding
        row[7] = f32::NAN;
        let all = token_logprobs(&row, 151_665, 0, 151_665).top;
        assert_eq!(all.len(), 151_664, "every non-NaN id below valid_vocab");
        let sum: f64 = all.iter().map(|&(_, l)| f64::from(l).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-5, "sum {sum}");
        for k in [3, 20, 100] {
            let lp = token_logprobs(&row, 151_665, 20, k);
            let mut want: Vec<(u32, f32)> =
                row[..151_665].iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| candidate(i, l)).collect();
            want.sort_by(desc);
            let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
            assert_eq!(ids, want[..k].iter().map(|t| t.0).collect::<Vec<_>>(), "k={k}");
            assert_eq!(&ids[..3], &[5, 10, 20]);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert_eq!(lp.logprob, lp.top[2].1);
            assert!(lp.logprob < 0.0);
        }
    }

    #[test]
    fn logprobs_sum_to_one_in_the_degenerate_rows() {
        let total = |row: &[f32]| -> f64 {
            (0..row.len() as u32).map(|i| f64::from(token_logprobs(row, row.len(), i, 0).logprob).exp()).sum()
        };
        for row in [
            vec![1.0f32, 2.0, -3.0, 0.5],
            vec![f32::NEG_INFINITY; 3],
            vec![1.0, f32::INFINITY, f32::INFINITY, f32::NAN],
            vec![-1e30, 1e30, 0.0],
        ] {
            assert!((total(&row) - 1.0).abs() < 1e-6, "{row:?}: {}", total(&row));
        }
    }
}
