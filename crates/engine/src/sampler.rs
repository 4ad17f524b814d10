//! Choosing the next token from one row of logits, in vLLM's order: logit bias and banned ids,
//! then repetition, frequency and presence penalties, then greedy argmax or temperature, top-k,
//! top-p (nucleus) and min-p sampling from a seeded generator, so a given seed reproduces its
//! output. Ids past the tokenizer's length (the checkpoint's padded vocabulary: 151,936 rows for
//! 151,665 tokens) are never chosen. Also the log-probabilities reported to clients.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod verify;

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

impl SamplingParams {
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

    /// Restrict the next draws to the ids whose bit is set in `words` (bit `i % 32` of word
    /// `i / 32`; ids past its end are disallowed), or lift the restriction with `None`. The mask
    /// comes before every other transform: bias, penalties, temperature, top-k/p and min-p only
    /// ever see allowed ids, and a disallowed id stays impossible whatever its bias.
    pub fn set_allowed(&mut self, words: Option<&[u32]>) {
        match (words, &mut self.allowed) {
            (None, a) => *a = None,
            (Some(w), Some(buf)) => {
                buf.clear();
                buf.extend_from_slice(w);
            }
            (Some(w), a) => *a = Some(w.to_vec()),
        }
    }

    /// [`set_allowed`](Self::set_allowed) with the bitset written in place by `fill` (a
    /// grammar's mask, without a second copy); an error leaves every id allowed.
    pub fn set_allowed_with<E>(&mut self, fill: impl FnOnce(&mut Vec<u32>) -> Result<(), E>) -> Result<(), E> {
        let mut words = self.allowed.take().unwrap_or_default();
        fill(&mut words)?;
        self.allowed = Some(words);
        Ok(())
    }

    /// The allowed-id bitset of the next draws, if restricted.
    pub fn allowed(&self) -> Option<&[u32]> {
        self.allowed.as_deref()
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
        draw(support, &self.sel, &mut self.rng)
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

    /// Applies bias, bans and penalties into `scratch` when any is in effect (true); otherwise the
    /// raw row is used as it is, saving a copy of 150k floats per greedy step.
    fn prepare(&mut self, logits: &[f32], banned: &[u32]) -> bool {
        if self.allowed.is_none()
            && self.params.logit_bias.is_empty()
            && banned.is_empty()
            && self.output_counts.is_empty()
            && self.seen.is_empty()
        {
            return false;
        }
        let n = self.width(logits);
        let row = &mut self.scratch;
        row.clear();
        match &self.allowed {
            Some(words) => copy_masked(row, &logits[..n], words),
            None => row.extend_from_slice(&logits[..n]),
        }
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
        self.support_weights_reaching(logits, REACH)
    }

    /// `support_weights` with the first batch of a nucleus chosen to reach `reach` × top_p of
    /// the mass, so tests can force the second batch.
    #[cfg(test)]
    fn support_weights_reaching(&mut self, logits: &[f32], reach: f64) -> Vec<(u32, f64)> {
        let row = &logits[..self.width(logits)];
        let sel = &mut self.sel;
        let mut out: Vec<(u32, f64)> = match support_reaching(row, &self.params, sel, reach) {
            Support::Certain(id) => vec![(id, 1.0)],
            Support::Prefix { len } => sel.cand[..len].iter().map(|&(id, _)| (id, sel.weights[id as usize])).collect(),
            Support::Row { .. } => sel.weights.iter().enumerate().map(|(i, &w)| (i as u32, w)).collect(),
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

/// Appends `src` to `row` with every logit whose id is not in the bitset `words` read as -inf,
/// a whole word of 32 ids at a time where all or none of them are allowed (most of a mask).
fn copy_masked(row: &mut Vec<f32>, src: &[f32], words: &[u32]) {
    for (w, chunk) in src.chunks(32).enumerate() {
        match words.get(w).copied().unwrap_or(0) {
            u32::MAX => row.extend_from_slice(chunk),
            0 => row.extend(std::iter::repeat_n(f32::NEG_INFINITY, chunk.len())),
            bits => row
                .extend(chunk.iter().enumerate().map(|(b, &l)| if bits >> b & 1 == 1 { l } else { f32::NEG_INFINITY })),
        }
    }
}

/// [`argmax`] of `v` with every id outside the bitset `words` read as -inf, reading only the
/// allowed ids: the first of the largest allowed values, 0 when none is finite or above -inf.
pub fn masked_argmax(v: &[f32], words: &[u32]) -> u32 {
    let (mut best, mut at) = (f32::NEG_INFINITY, 0usize);
    for (w, chunk) in v.chunks(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            // `x > m` is false for NaN, as in `argmax`.
            let m = chunk.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            if m > best {
                best = m;
                at = w * 32 + chunk.iter().position(|&x| x == m).unwrap_or(0);
            }
            continue;
        }
        let mut b = bits;
        while b != 0 {
            let i = b.trailing_zeros() as usize;
            b &= b - 1;
            if let Some(&x) = chunk.get(i) {
                if x > best {
                    (best, at) = (x, w * 32 + i);
                }
            }
        }
    }
    if best == f32::NEG_INFINITY {
        0
    } else {
        at as u32
    }
}

/// What a draw chooses from.
enum Support {
    Certain(u32),
    /// `Selection::cand[..len]`, best first, with `Selection::cum[..len]` their running mass.
    Prefix {
        len: usize,
    },
    /// Every id, weighted by `Selection::weights` (0 for excluded ids); `mass` is their sum.
    Row {
        mass: f64,
    },
}

/// Working buffers for top-k / top-p / min-p, kept by the sampler so a step allocates nothing
/// once they have grown to the row's width.
#[derive(Default)]
struct Selection {
    /// Candidate (id, logit) pairs; after `support`, best first at least up to the cut. Grown
    /// only as far as gathering needs, which for a peaked row is a small part of the vocabulary.
    cand: Vec<Candidate>,
    /// The radix sort's second half, as long as the largest bucket sorted.
    spare: Vec<Candidate>,
    /// Weight of each id. A whole-row draw holds the row's width with 0 for excluded ids; a
    /// prefix draw sets the candidates' entries and leaves the others stale.
    weights: Vec<f64>,
    /// `cum[i]`: the weights of `cand[..=i]` added in order, the sums the draw compares against.
    /// Grown as far as the scan goes; a prefix support says how much of it is set.
    cum: Vec<f64>,
    /// Candidates per key bucket (`bucket`), and for top-p their summed weight.
    counts: Vec<u32>,
    mass: Vec<f64>,
}

/// `exp((l - max) / T)`: subtracting the max first keeps the exponent ≤ 0, so it never overflows.
fn weight(l: f32, max: f32, inv_t: f64) -> f64 {
    ((f64::from(l) - f64::from(max)) * inv_t).exp()
}

#[cfg(test)]
thread_local! {
    /// Calls of `desc` on this thread, so a test can tell a comparison sort of the vocabulary
    /// from the radix path without timing anything.
    static COMPARISONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Best first, ties to the lower id: the order the full-sort definitions of top-k and top-p use.
/// Only ever sees finite logits (so the order is total) with -0.0 folded into 0.0 (so it ties).
fn desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    #[cfg(test)]
    COMPARISONS.with(|c| c.set(c.get() + 1));
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// An (id, logit) pair.
type Candidate = (u32, f32);

fn candidate(i: usize, l: f32) -> Candidate {
    (i as u32, if l == 0.0 { 0.0 } else { l })
}

/// A u32 that orders finite logits the way `desc` does: smaller key, larger logit; -0.0 is
/// folded into 0.0 as `candidate` does. Flipping every bit of a negative float and only the sign
/// bit of a positive one makes the bits of an f32 ascend with its value; complementing that
/// makes them descend.
fn desc_key(l: f32) -> u32 {
    let b = if l == 0.0 { 0 } else { l.to_bits() };
    if b & 0x8000_0000 != 0 {
        b
    } else {
        !(b | 0x8000_0000)
    }
}

/// The histogram's buckets are the key's top 11 bits (sign, exponent, two mantissa bits): each
/// power-of-two range of logits falls into four, fine enough to see how far down the order a
/// nucleus reaches before sorting anything, and small enough (2048) to clear and walk per call.
const BUCKET_BITS: u32 = 11;
const BUCKETS: usize = 1 << BUCKET_BITS;

/// Bucket 0 holds the largest logits.
fn bucket(l: f32) -> usize {
    (desc_key(l) >> (32 - BUCKET_BITS)) as usize
}

/// The first batch of a nucleus is the leading buckets whose summed weight reaches this multiple
/// of top_p's share. Bucket sums add in another order than the exact scan, so they can disagree
/// in the last bits; the margin keeps the exact cut inside the first batch. Were it outside, the
/// remaining buckets would be gathered too: slower, never different.
const REACH: f64 = 1.0 + 1e-6;

/// Below this many candidates a comparison sort is cheaper than the radix sort's histograms.
const RADIX_MIN: usize = 64;

/// Applies temperature, top-k, top-p and min-p to `row` without sorting the whole vocabulary.
/// With neither top-k nor top-p the draw runs over the row itself. Otherwise the candidates are
/// counted per key bucket (`bucket`), which shows which leading buckets hold the top k or the
/// top_p share of the mass; only those are gathered, in bucket order, and each bucket is sorted
/// (radix sort) only when the best-first scan reaches it, so a nucleus of most of the vocabulary
/// costs a few linear passes and one exp() per id, and a small one far less.
fn support(row: &[f32], p: &SamplingParams, sel: &mut Selection) -> Support {
    support_reaching(row, p, sel, REACH)
}

/// `support` with the first batch of a nucleus sized by `reach` (see `REACH`); every `reach`
/// gives the same support, which is what lets the tests vary it.
fn support_reaching(row: &[f32], p: &SamplingParams, sel: &mut Selection, reach: f64) -> Support {
    let (max, finite) = match finite_max(row) {
        Extent::Infinite(i) => return Support::Certain(i),
        // Every logit NaN or -inf: nothing is a candidate.
        Extent::Finite { finite: 0, .. } => return Support::Certain(argmax(row)),
        Extent::Finite { max, finite } => (max, finite),
    };
    let inv_t = 1.0 / f64::from(p.temperature);
    // min-p keeps p_i >= min_p * p_max, i.e. weight >= min_p since the best token weighs 1; the
    // ratio survives the renormalisation of top-k and top-p, so applying it last is the same cut.
    let min_w = f64::from(p.min_p);
    let top_k = p.top_k > 0 && p.top_k < finite;
    let Selection { cand, spare, weights, cum, counts, mass } = sel;
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
    if weights.len() < row.len() {
        weights.resize(row.len(), 0.0);
    }
    counts.clear();
    counts.resize(BUCKETS, 0);
    if top_k {
        for &l in row.iter().filter(|l| l.is_finite()) {
            counts[bucket(l)] += 1;
        }
        // The leading buckets holding k candidates hold the top k (the counts are exact).
        let mut held = 0;
        let last = counts.iter().position(|&c| {
            held += c as usize;
            held >= p.top_k
        });
        let last = last.unwrap_or(BUCKETS - 1);
        let gathered = gather(row, counts, 0, last, 0, cand);
        let mut start = 0;
        for &c in &counts[..=last] {
            sort_desc(&mut cand[start..start + c as usize], spare);
            start += c as usize;
        }
        let kept = &cand[..p.top_k.min(gathered)];
        // Each weight once, in the best-first order the full-sort definition sums them.
        let mut total = 0.0;
        for &(id, l) in kept {
            let w = weight(l, max, inv_t);
            weights[id as usize] = w;
            total += w;
        }
        let target = if p.top_p < 1.0 { f64::from(p.top_p) * total } else { f64::INFINITY };
        let (ControlFlow::Break(len) | ControlFlow::Continue(len)) = scan(kept, weights, target, min_w, cum, 0);
        return Support::Prefix { len };
    }
    mass.clear();
    mass.resize(BUCKETS, 0.0);
    // Each weight once, in id order as the definition sums the total; the scan and the draw reuse
    // them.
    let mut total = 0.0;
    for (i, &l) in row.iter().enumerate().filter(|(_, l)| l.is_finite()) {
        let w = weight(l, max, inv_t);
        weights[i] = w;
        total += w;
        let b = bucket(l);
        counts[b] += 1;
        mass[b] += w;
    }
    // Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
    let target = f64::from(p.top_p) * total;
    let mut seen = 0.0;
    let first_batch = mass.iter().zip(counts.iter()).position(|(&m, &c)| {
        seen += m;
        c > 0 && seen >= reach * target
    });
    let mut gathered_to = first_batch.unwrap_or(BUCKETS - 1);
    gather(row, counts, 0, gathered_to, 0, cand);
    // `start`: where bucket b begins in `cand`, and how much of the order is scanned.
    let mut start = 0;
    for b in 0..BUCKETS {
        let c = counts[b] as usize;
        if c == 0 {
            continue;
        }
        if b > gathered_to {
            // The estimate fell short: everything in later buckets ranks below what was
            // scanned, so gathering them behind it continues the same order.
            gather(row, counts, b, BUCKETS - 1, start, cand);
            gathered_to = BUCKETS - 1;
        }
        let group = &mut cand[start..start + c];
        sort_desc(group, spare);
        match scan(group, weights, target, min_w, cum, start) {
            ControlFlow::Break(len) => return Support::Prefix { len },
            ControlFlow::Continue(len) => start = len,
        }
    }
    Support::Prefix { len: start }
}

/// What the first pass over a row finds.
enum Extent {
    /// The first +inf (16-bit overflow), which is a certainty.
    Infinite(u32),
    /// The largest finite logit and how many there are (NaN and -inf are never candidates).
    Finite { max: f32, finite: usize },
}

/// One pass in 16 independent lanes (the compiler vectorises them); a single running maximum
/// would be a chain of dependent compares over the whole vocabulary.
fn finite_max(row: &[f32]) -> Extent {
    const LANES: usize = 16;
    let (mut max, mut finite, mut inf) = ([f32::NEG_INFINITY; LANES], [0u32; LANES], false);
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for ((m, n), &x) in max.iter_mut().zip(&mut finite).zip(c) {
            let f = x.is_finite();
            *m = if f && x > *m { x } else { *m };
            *n += u32::from(f);
            inf |= x == f32::INFINITY;
        }
    }
    let mut m = max.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    let mut n = finite.iter().map(|&c| c as usize).sum::<usize>();
    for &x in tail.iter().filter(|x| x.is_finite()) {
        m = if x > m { x } else { m };
        n += 1;
    }
    if inf || tail.contains(&f32::INFINITY) {
        if let Some(i) = row.iter().position(|&l| l == f32::INFINITY) {
            return Extent::Infinite(i as u32);
        }
    }
    Extent::Finite { max: m, finite: n }
}

/// Continues the best-first scan over `group`, the candidates from position `at` on, recording
/// the running mass in `cum[at..]`. Breaks with the kept length where the prefix ends: before a
/// token below min-p (never before the first), or with the token that brings the mass to
/// `target`; otherwise continues with the length scanned.
fn scan(
    group: &[Candidate],
    weights: &[f64],
    target: f64,
    min_w: f64,
    cum: &mut Vec<f64>,
    at: usize,
) -> ControlFlow<usize, usize> {
    if cum.len() < at + group.len() {
        cum.resize(at + group.len(), 0.0);
    }
    let mut acc = if at == 0 { 0.0 } else { cum[at - 1] };
    for (i, (&(id, _), c)) in group.iter().zip(&mut cum[at..]).enumerate() {
        let w = weights[id as usize];
        if w < min_w && at + i > 0 {
            return ControlFlow::Break(at + i);
        }
        acc += w;
        *c = acc;
        if acc >= target {
            return ControlFlow::Break(at + i + 1);
        }
    }
    ControlFlow::Continue(at + group.len())
}

/// Writes the finite candidates of buckets `first..=last` into `cand` from `at` on, grouped by
/// bucket in bucket order and in id order within each (which `sort_desc` needs); returns how
/// many. `counts` must be the row's per-bucket counts.
fn gather(row: &[f32], counts: &[u32], first: usize, last: usize, at: usize, cand: &mut Vec<Candidate>) -> usize {
    let mut next = [0u32; BUCKETS];
    let mut end = at as u32;
    for (n, &c) in next[first..=last].iter_mut().zip(&counts[first..=last]) {
        *n = end;
        end += c;
    }
    if cand.len() < end as usize {
        cand.resize(end as usize, (0, 0.0));
    }
    for (i, &l) in row.iter().enumerate().filter(|(_, l)| l.is_finite()) {
        let b = bucket(l);
        if (first..=last).contains(&b) {
            cand[next[b] as usize] = candidate(i, l);
            next[b] += 1;
        }
    }
    end as usize - at
}

/// Sorts one bucket's candidates into `desc` order: best first, ties to the lower id. Groups
/// past `RADIX_MIN` go through an LSD radix sort on the bits of `desc_key` below the bucket's:
/// it is stable, so given the group in id order (as `gather` leaves it) equal keys stay in id
/// order, which is exactly `desc`'s tie-break, and it compares nothing.
fn sort_desc(v: &mut [Candidate], spare: &mut Vec<Candidate>) {
    if v.len() < RADIX_MIN {
        v.sort_unstable_by(desc);
    } else if v.len() < WIDE_DIGITS_MIN {
        radix_sort::<128, 3>(v, spare);
    } else {
        radix_sort::<2048, 2>(v, spare);
    }
}

/// From this many candidates on, a group's 21 key bits go in two passes of 11 bits rather than
/// three of 7: one pass less over the data for four times the histogram to clear and sum.
const WIDE_DIGITS_MIN: usize = 4096;

/// LSD radix sort of `v` by `desc_key`'s low `PASSES` digits of log2(`RADIX`) bits, which must
/// cover the bits below `BUCKET_BITS`. A pass whose digit is the same for every key is skipped.
fn radix_sort<const RADIX: usize, const PASSES: usize>(v: &mut [Candidate], spare: &mut Vec<Candidate>) {
    let bits = RADIX.trailing_zeros() as usize;
    const { assert!(RADIX.is_power_of_two() && RADIX.trailing_zeros() as usize * PASSES >= 32 - BUCKET_BITS as usize) };
    let digit = |k: u32, d: usize| (k >> (bits * d)) as usize & (RADIX - 1);
    if spare.len() < v.len() {
        spare.resize(v.len(), (0, 0.0));
    }
    let spare = &mut spare[..v.len()];
    let mut hist = [[0u32; RADIX]; PASSES];
    for &(_, l) in v.iter() {
        let k = desc_key(l);
        for (d, h) in hist.iter_mut().enumerate() {
            h[digit(k, d)] += 1;
        }
    }
    let mut in_v = true;
    for (d, h) in hist.iter().enumerate() {
        if h.iter().any(|&c| c as usize == v.len()) {
            continue;
        }
        let mut next = [0u32; RADIX];
        let mut at = 0;
        for (n, &c) in next.iter_mut().zip(h) {
            *n = at;
            at += c;
        }
        let (src, dst): (&[Candidate], &mut [Candidate]) = if in_v { (v, spare) } else { (spare, v) };
        for &x in src {
            let slot = &mut next[digit(desc_key(x.1), d)];
            dst[*slot as usize] = x;
            *slot += 1;
        }
        in_v = !in_v;
    }
    if !in_v {
        v.copy_from_slice(spare);
    }
}

fn draw(s: Support, sel: &Selection, rng: &mut StdRng) -> u32 {
    match s {
        Support::Certain(id) => id,
        Support::Prefix { len } => {
            // The scan's running sums: the last is the kept mass, added in the same order the
            // linear draw's accumulator would add it.
            let cum = &sel.cum[..len.min(sel.cum.len())];
            let kept = &sel.cand[..cum.len()];
            let r = rng.random::<f64>() * cum.last().copied().unwrap_or(0.0);
            // The first running sum past r: where a linear walk would stop. A zero weight leaves
            // the sum where it was, so the first sum past r is always a token with weight.
            if let Some(&(id, _)) = kept.get(cum.partition_point(|&c| c <= r)) {
                return id;
            }
            // Rounding left r at the mass: the last kept token with weight. The best token always
            // weighs 1, so it is the fallback.
            kept.iter()
                .rev()
                .find(|&&(id, _)| sel.weights.get(id as usize).is_some_and(|&w| w > 0.0))
                .or(kept.first())
                .map_or(0, |c| c.0)
        }
        Support::Row { mass } => {
            let r = rng.random::<f64>() * mass;
            let mut acc = 0.0;
            let mut last = 0;
            for (i, &w) in sel.weights.iter().enumerate() {
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

    /// The allowed-id mask comes first: a disallowed id stays impossible whatever its bias or
    /// logit, in greedy, sampled and verifying draws, and ids past the mask are disallowed.
    #[test]
    fn the_grammar_mask_comes_before_every_transform() {
        let logits: Vec<f32> = (0..70).map(|i| (i % 7) as f32).collect();
        // Ids 3 and 40 only (word 0 bit 3, word 1 bit 8); word 2 is missing: ids 64.. are out.
        let words = [1u32 << 3, 1 << 8];
        let mut greedy = Sampler::new(SamplingParams { logit_bias: vec![(6, 100.0)], ..Default::default() }, 70);
        greedy.set_allowed(Some(&words));
        let row = greedy.processed(&logits, &[]);
        let finite: Vec<usize> = (0..70).filter(|&i| row[i].is_finite()).collect();
        assert_eq!(finite, vec![3, 40]);
        assert_eq!(greedy.sample(&logits, &[]), 40, "logit 5 beats 3; the biased id 6 is not allowed");
        assert_eq!(greedy.verify(&logits, &[], 6), (40, false));
        greedy.set_allowed(None);
        assert_eq!(greedy.sample(&logits, &[]), 6, "lifting the mask restores the bias");
        for seed in 0..200 {
            let p = SamplingParams { temperature: 1.5, top_p: 0.9, seed: Some(seed), ..Default::default() };
            let mut s = Sampler::new(p, 70);
            s.set_allowed(Some(&words));
            let t = s.sample(&logits, &[]);
            assert!(t == 3 || t == 40, "seed {seed} drew {t}");
            let (v, ok) = s.verify(&logits, &[], 13);
            assert!(!ok && (v == 3 || v == 40), "seed {seed} verified to {v}");
        }
        // A full word and a partial one, against the per-id definition.
        let words = [u32::MAX, 0b1010, 0];
        let mut row = Vec::new();
        copy_masked(&mut row, &[1.0f32; 70], &words);
        assert_eq!(row.len(), 70);
        for (i, l) in row.iter().enumerate() {
            let allowed = i < 32 || i == 33 || i == 35;
            assert_eq!(l.is_finite(), allowed, "id {i}");
        }
    }

    /// The masked argmax reads only allowed ids and agrees with `argmax` over the masked copy:
    /// ties, NaN, infinities, full, empty and partial words, short rows and short masks.
    #[test]
    fn masked_argmax_is_argmax_of_the_masked_row() {
        let mut state = 99u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        for len in [0usize, 1, 31, 32, 33, 100, 1000, 151_936] {
            for case in 0..8 {
                let mut v: Vec<f32> = (0..len).map(|_| (next() % 50) as f32 / 10.0).collect();
                if case == 1 {
                    v.iter_mut().step_by(3).for_each(|x| *x = f32::NAN);
                }
                if case == 2 && len > 0 {
                    let at = next() as usize % len;
                    v[at] = f32::INFINITY;
                }
                if case == 3 {
                    v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
                }
                let nwords = if case == 4 { len / 64 } else { len.div_ceil(32) };
                let words: Vec<u32> = (0..nwords)
                    .map(|_| match next() % 4 {
                        0 => 0,
                        1 => u32::MAX,
                        _ => next() & next(),
                    })
                    .collect();
                let mut masked = Vec::new();
                copy_masked(&mut masked, &v, &words);
                assert_eq!(masked_argmax(&v, &words), argmax(&masked), "len {len} case {case}");
            }
        }
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
    /// Returns the kept (id, weight) pairs best first, zero weights included.
    fn full_sort_nucleus(row: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
        let max = row.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / f64::from(p.temperature);
        let mut all: Vec<(u32, f32)> =
            row.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| candidate(i, l)).collect();
        // Ids are unique, so any correct sort gives this one order (`desc` is left alone: it counts).
        all.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
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
        out
    }

    /// The drawable ids of a nucleus and their weights, sorted by id.
    fn support_of(mut out: Vec<(u32, f64)>) -> Vec<(u32, f64)> {
        out.retain(|&(_, w)| w > 0.0);
        out.sort_by_key(|&(id, _)| id);
        out
    }

    /// `count` draws from a generator seeded with `seed`, by the definition spelled out the slow
    /// way: a +inf is certain, no finite logit means argmax; without top-k and top-p a walk over
    /// the row in id order, otherwise a walk over the full-sort nucleus best first, each walk
    /// adding the weights up afresh.
    fn full_sort_draws(row: &[f32], p: &SamplingParams, seed: u64, count: usize) -> Vec<u32> {
        full_sort_draws_from(row, p, None, seed, count)
    }

    /// `full_sort_draws` reusing the nucleus when the caller has it.
    fn full_sort_draws_from(
        row: &[f32],
        p: &SamplingParams,
        nucleus: Option<Vec<(u32, f64)>>,
        seed: u64,
        count: usize,
    ) -> Vec<u32> {
        if let Some(i) = row.iter().position(|&l| l == f32::INFINITY) {
            return vec![i as u32; count];
        }
        let finite = row.iter().filter(|l| l.is_finite()).count();
        if finite == 0 {
            return vec![argmax(row); count];
        }
        let kept = if (p.top_k == 0 || p.top_k >= finite) && p.top_p >= 1.0 {
            let max = row.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
            let inv_t = 1.0 / f64::from(p.temperature);
            row.iter()
                .enumerate()
                .map(|(i, &l)| {
                    let w = if l.is_finite() { weight(l, max, inv_t) } else { 0.0 };
                    (i as u32, if w >= f64::from(p.min_p) { w } else { 0.0 })
                })
                .collect()
        } else {
            nucleus.unwrap_or_else(|| full_sort_nucleus(row, p))
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let mut walk = || {
            let mass: f64 = kept.iter().map(|&(_, w)| w).sum();
            let r = rng.random::<f64>() * mass;
            let (mut acc, mut last) = (0.0, kept[0].0);
            for &(id, w) in &kept {
                if w > 0.0 {
                    acc += w;
                    last = id;
                    if r < acc {
                        return id;
                    }
                }
            }
            last
        };
        (0..count).map(|_| walk()).collect()
    }

    /// Rows where selection is hard: nearly flat (the nucleus is most of the row), coarse (many
    /// exact ties, whole rows in one bucket), peaked, with NaN, ±inf and ±0 sprinkled in.
    fn hard_row(rng: &mut StdRng, n: usize) -> Vec<f32> {
        let shape = rng.random_range(0..5);
        let scale = [0.5f32, 3.0, 12.0, 0.02, 0.2][rng.random_range(0..5)];
        let specials = rng.random_bool(0.7);
        (0..n)
            .map(|_| {
                let x = (rng.random::<f32>() - 0.5) * scale;
                let x = match shape {
                    0 => x,
                    1 => (x * 2.0).round() / 2.0,           // ties between buckets
                    2 => 1.0 + (x * 64.0).round() / 4096.0, // ties inside one bucket
                    3 => [-1.0f32, 0.0, 2.0][rng.random_range(0..3)], // a handful of values
                    _ if rng.random_bool(0.001) => 20.0 + x, // a few favourites
                    _ => x,
                };
                match rng.random_range(0..if specials { 40 } else { 1 << 20 }) {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    2 => -0.0,
                    3 => 0.0,
                    _ => x,
                }
            })
            .collect()
    }

    fn random_params(rng: &mut StdRng, n: usize, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: [0.05f32, 0.7, 1.0, 2.5][rng.random_range(0..4)],
            top_k: match rng.random_range(0..10) {
                0..=5 => 0,
                6 => 50,
                7 => n.saturating_sub(1),
                _ => rng.random_range(1..n + 5),
            },
            top_p: match rng.random_range(0..10) {
                0..=1 => 1.0,
                2..=4 => [0.5f32, 0.9, 0.95, 0.999_999][rng.random_range(0..4)],
                _ => rng.random_range(0.01f32..=1.0),
            },
            min_p: if rng.random_bool(0.3) { rng.random_range(0.0f32..0.3) } else { 0.0 },
            seed: Some(seed),
            ..Default::default()
        }
    }

    /// Whatever the first batch (`reach`), the support is the definition's, and seeded draws pick
    /// the very tokens the definition's linear walk picks.
    #[test]
    fn partial_selection_matches_the_full_sort_definition() {
        let mut rng = StdRng::seed_from_u64(1234);
        let (mut second_batch, mut big_nuclei, mut radix_groups) = (0, 0, 0);
        for case in 0..400u64 {
            let wide = case % 200 == 7;
            let n = match case % 4 {
                _ if wide => 151_936,
                0 => rng.random_range(1..64),
                1 | 2 => rng.random_range(1..3000),
                _ => rng.random_range(3000..12_000),
            };
            let row = hard_row(&mut rng, n);
            let p = random_params(&mut rng, n, case);
            let nucleus = full_sort_nucleus(&row, &p);
            let want = support_of(nucleus.clone());
            let mut s = Sampler::new(p.clone(), n);
            for reach in [REACH, 0.0, rng.random_range(0.0..1.0)] {
                assert_eq!(s.support_weights_reaching(&row, reach), want, "case {case}: n={n} reach={reach} {p:?}");
            }
            second_batch += usize::from(p.top_k == 0 && p.top_p < 1.0);
            big_nuclei += usize::from(want.len() > 1000);
            radix_groups += usize::from(want.len() > RADIX_MIN);
            let draws = if wide { 2 } else { 6 };
            let got: Vec<u32> = (0..draws).map(|_| s.sample(&row, &[])).collect();
            assert_eq!(got, full_sort_draws_from(&row, &p, Some(nucleus), case, draws), "case {case}: n={n} {p:?}");
        }
        assert!(
            second_batch > 100 && big_nuclei > 30 && radix_groups > 60,
            "{second_batch} {big_nuclei} {radix_groups}"
        );
    }

    /// Runs of seeded draws over flat rows whose nucleus is most of the vocabulary, top-k, top-p
    /// and min-p together: token for token what the definition draws.
    #[test]
    fn large_nuclei_draw_the_definitions_tokens() {
        let mut rng = StdRng::seed_from_u64(77);
        let n = 151_936;
        let flat: Vec<f32> = (0..n).map(|_| (rng.random::<f32>() - 0.5) * 0.2).collect();
        let mut tied = flat.clone();
        tied.iter_mut().for_each(|l| *l = (*l * 20.0).round() / 20.0);
        for (row, p) in [
            (&flat, params(1.0, 0.9, 0, 1)),
            (&flat, params(0.7, 0.5, 0, 2)),
            (&flat, SamplingParams { min_p: 0.99, ..params(1.0, 0.95, 0, 3) }),
            (&flat, params(1.0, 0.9, 100_000, 4)),
            (&tied, SamplingParams { min_p: 0.05, ..params(1.0, 0.9, 140_000, 5) }),
            (&tied, params(0.7, 0.95, 0, 6)),
        ] {
            let mut s = Sampler::new(p.clone(), n);
            let got: Vec<u32> = (0..4).map(|_| s.sample(row, &[])).collect();
            assert_eq!(got, full_sort_draws(row, &p, p.seed.unwrap_or(0), 4), "{p:?}");
        }
    }

    /// The radix sort is the comparator's order, ties and all, on both digit widths.
    #[test]
    fn radix_sort_orders_like_the_comparator() {
        let mut rng = StdRng::seed_from_u64(5);
        let mut spare = Vec::new();
        for len in [0usize, 1, RADIX_MIN - 1, RADIX_MIN, 1000, WIDE_DIGITS_MIN - 1, WIDE_DIGITS_MIN, 30_000] {
            for base in [1.0f32, -3.0, 1e-30, -1e30] {
                // One bucket: the top 11 bits of the key fixed, the low 21 random, few distinct.
                let spread = [1u32 << 21, 50, 1][rng.random_range(0..3)];
                let mut v: Vec<(u32, f32)> = (0..len)
                    .map(|i| {
                        let k = (desc_key(base) & !((1 << 21) - 1)) | rng.random_range(0..spread);
                        let l = f32::from_bits(if k & 0x8000_0000 != 0 { k } else { !k & 0x7FFF_FFFF });
                        (i as u32, l)
                    })
                    .collect();
                assert!(v.iter().all(|&(_, l)| l.is_finite() && bucket(l) == bucket(base)));
                let mut want = v.clone();
                want.sort_by(desc);
                sort_desc(&mut v, &mut spare);
                assert_eq!(v, want, "len {len} base {base} spread {spread}");
            }
        }
        // The key orders every kind of finite float as `desc` does, -0.0 tying with 0.0.
        let specials = [f32::MAX, 1.0, f32::MIN_POSITIVE, 1e-45, 0.0, -0.0, -1e-45, -f32::MIN_POSITIVE, -1.0, f32::MIN];
        for w in specials.windows(2) {
            assert!(desc_key(w[0]) < desc_key(w[1]) || w[0] == w[1], "{w:?}");
        }
        assert_eq!(desc_key(0.0), desc_key(-0.0));
    }

    /// The regression this guards: a nucleus of most of a 151,936-id row sorted by comparisons
    /// (n log n ≈ 2.6M of them, or ~3n for a selection). The radix path compares only inside the
    /// few tiny groups at the extremes.
    #[test]
    fn large_nuclei_are_not_comparison_sorted() {
        let mut rng = StdRng::seed_from_u64(9);
        let n = 151_936;
        let flat: Vec<f32> = (0..n).map(|_| (rng.random::<f32>() - 0.5) * 0.2).collect();
        for p in [params(1.0, 0.9, 0, 1), params(0.7, 0.99, 120_000, 2), params(1.0, 0.9, 50, 3)] {
            let mut s = Sampler::new(p.clone(), n);
            COMPARISONS.with(|c| c.set(0));
            let kept = s.support_weights(&flat).len();
            s.sample(&flat, &[]);
            let compared = COMPARISONS.with(|c| c.get());
            assert!(p.top_k == 50 || kept > 100_000, "{p:?}: {kept}");
            // Only small groups compare: the many narrow power-of-two ranges near 0 hold a few
            // ids each (a few thousand comparisons in all).
            assert!(compared < n as u64 / 10, "{p:?}: {compared} comparisons for a nucleus of {kept}");
        }
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
