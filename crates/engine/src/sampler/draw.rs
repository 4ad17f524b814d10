//! Temperature, top-k, top-p and min-p, and the seeded draw: [`support`] finds what a draw
//! chooses from without sorting the vocabulary, [`draw`] picks from it. Speculative verification
//! (`verify`) reads the same support and draws from it with the rejected proposal left out.
//!
//! Weights are fixed point. Each id weighs `exp((l - max) / T)` (the best token 1), rounded to
//! the nearest multiple of 2^-`frac_bits` (2^-44 for a 151,936-id row), so that a whole row's sum
//! fits a u64. Integer sums are exact: the mass of a group of ids does not depend on the order it is
//! added in. That is what makes a nucleus cheap. Counting each key bucket's mass (`bucket`) in
//! one pass finds the bucket where top-p's share is reached; only that bucket is put in
//! best-first order to find the exact cut, and a draw puts in order only the bucket its number
//! lands in. Nothing else of a nucleus of most of the vocabulary is ever sorted. A token whose
//! weight rounds to 0 (below 2^-45 of the best's: together under 1e-8 of the mass) is never
//! drawn.

use rand::rngs::StdRng;
use rand::Rng;

use super::order::{bucket, gather, gather_bucket, sort_desc, Candidate, BUCKETS, NOT_A_CANDIDATE};
use super::weights::{self, fixed_weight};
use super::{argmax, SamplingParams};

/// What a draw chooses from. Every drawable id has a nonzero `Selection::drawn` weight.
pub(super) enum Support {
    Certain(u32),
    /// Top-k: `Selection::cand[..len]`, best first, with `Selection::cum[..len]` their running
    /// drawn mass.
    Prefix {
        len: usize,
    },
    /// Top-p alone: every candidate of the buckets before `cut`, and the first `len` of bucket
    /// `cut` (`Selection::cand[..len]`, best first); `mass` is their drawn weights' sum.
    Nucleus {
        cut: usize,
        len: usize,
        mass: u64,
    },
    /// Neither: every id, weighted by `Selection::drawn`; `mass` is their sum.
    Row {
        mass: u64,
    },
}

/// Working buffers for top-k / top-p / min-p, kept by the sampler so a step allocates nothing
/// once they have grown to the row's width.
#[derive(Default)]
pub(super) struct Selection {
    /// Candidate (id, logit) pairs: the top-k prefix, or the cut bucket, best first.
    pub(super) cand: Vec<Candidate>,
    /// The radix sort's second half.
    spare: Vec<Candidate>,
    /// The bucket a nucleus draw lands in, put in order.
    landed: Vec<Candidate>,
    /// Each id's key bucket (a Nucleus support), for `gather_bucket`.
    keys: Vec<u16>,
    /// Each id's fixed-point weight as drawn: 0 where min-p excludes it. Set for every id in a
    /// Row or Nucleus support, for the kept candidates in a Prefix.
    pub(super) drawn: Vec<u64>,
    /// `cum[i]`: the drawn weights of `cand[..=i]` added in order (a Prefix support).
    pub(super) cum: Vec<u64>,
    /// Per key bucket: how many candidates, their fixed-point mass (what top-p's share counts)
    /// and their drawn mass.
    counts: Vec<u32>,
    mass: Vec<u64>,
    drawn_mass: Vec<u64>,
    /// 2^`frac_bits` of the last support, as an f64 (the best token's fixed-point weight).
    pub(super) one: f64,
}

/// Fraction bits of a row of `n` ids: n weights of at most 1 sum below 2^62. 51 at most (what
/// `fixed_weight` rounds exactly).
fn frac_bits(n: usize) -> u32 {
    let width = usize::BITS - n.max(1).leading_zeros();
    62u32.saturating_sub(width).min(51)
}

/// Top-p's share of `total`: the first best-first prefix whose mass reaches it is the nucleus
/// (at least one unit, so the best token is always in).
fn share(top_p: f32, total: u64) -> u64 {
    ((f64::from(top_p) * total as f64).ceil() as u64).clamp(1, total.max(1))
}

/// Applies temperature, top-k, top-p and min-p to `row` (see the module docs).
pub(super) fn support(row: &[f32], p: &SamplingParams, sel: &mut Selection) -> Support {
    let (max, finite) = match finite_max(row) {
        Extent::Infinite(i) => return Support::Certain(i),
        // Every logit NaN or -inf: nothing is a candidate.
        Extent::Finite { finite: 0, .. } => return Support::Certain(argmax(row)),
        Extent::Finite { max, finite } => (max, finite),
    };
    let inv_t = 1.0 / f64::from(p.temperature);
    let one = f64::from(frac_bits(row.len())).exp2();
    sel.one = one;
    // min-p keeps p_i >= min_p * p_max: a fixed-point weight of at least min_p times the best
    // one's. The ratio survives the renormalisation of top-k and top-p, so applying it to the
    // weights as drawn is the same cut as applying it last.
    let min_w = (f64::from(p.min_p) * one).ceil() as u64;
    let top_k = p.top_k > 0 && p.top_k < finite;
    let Selection { cand, spare, drawn, cum, counts, mass, drawn_mass, keys, .. } = sel;
    if drawn.len() < row.len() {
        drawn.resize(row.len(), 0);
        keys.resize(row.len(), NOT_A_CANDIDATE);
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
        let total: u64 = kept.iter().map(|&(_, l)| fixed_weight(l, max, inv_t, one)).sum();
        let target = if p.top_p < 1.0 { share(p.top_p, total) } else { total };
        if cum.len() < kept.len() {
            cum.resize(kept.len(), 0);
        }
        let (mut full, mut acc, mut len) = (0u64, 0u64, kept.len());
        for (i, &(id, l)) in kept.iter().enumerate() {
            let w = fixed_weight(l, max, inv_t, one);
            let d = if w >= min_w { w } else { 0 };
            drawn[id as usize] = d;
            acc += d;
            cum[i] = acc;
            full += w;
            if full >= target {
                len = i + 1;
                break;
            }
        }
        return Support::Prefix { len };
    }
    // Each weight once (a vectorised pass), then min-p and the sums: per bucket for a nucleus.
    let row_drawn = &mut drawn[..row.len()];
    weights::fill(row, max, inv_t, one, row_drawn);
    let nucleus = p.top_p < 1.0;
    let mut total = 0u64;
    let mut drawn_total = 0u64;
    if nucleus {
        mass.clear();
        mass.resize(BUCKETS, 0);
        drawn_mass.clear();
        drawn_mass.resize(BUCKETS, 0);
        for ((d, key), &l) in row_drawn.iter_mut().zip(keys.iter_mut()).zip(row) {
            if !l.is_finite() {
                *key = NOT_A_CANDIDATE;
                continue;
            }
            let q = *d;
            *d = if q >= min_w { q } else { 0 };
            total += q;
            let b = bucket(l);
            *key = b as u16;
            counts[b] += 1;
            mass[b] += q;
            drawn_mass[b] += *d;
        }
    } else {
        // Integer sums vectorise: their order does not change them.
        for d in row_drawn.iter_mut() {
            *d = if *d >= min_w { *d } else { 0 };
            drawn_total += *d;
        }
    }
    if !nucleus {
        return Support::Row { mass: drawn_total };
    }
    // The nucleus ends in the first bucket whose running mass reaches the share; only it is
    // sorted, to find the exact cut.
    let target = share(p.top_p, total);
    let (mut before, mut kept) = (0u64, 0u64);
    let mut cut = BUCKETS - 1;
    for b in 0..BUCKETS {
        if counts[b] > 0 && before + mass[b] >= target {
            cut = b;
            break;
        }
        before += mass[b];
        kept += drawn_mass[b];
    }
    let n = gather_bucket(row, &keys[..row.len()], cut, cand);
    sort_desc(&mut cand[..n], spare);
    let mut len = n;
    for (i, &(id, _)) in cand[..n].iter().enumerate() {
        kept += drawn[id as usize];
        before += fixed_weight(row[id as usize], max, inv_t, one);
        if before >= target {
            len = i + 1;
            break;
        }
    }
    Support::Nucleus { cut, len, mass: kept }
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

/// Whether `token` can be drawn from `s` (nonzero drawn weight inside the support).
pub(super) fn drawable(s: &Support, sel: &Selection, row: &[f32], token: u32) -> bool {
    let t = token as usize;
    let weighed = || sel.drawn.get(t).is_some_and(|&d| d > 0);
    match *s {
        Support::Certain(id) => id == token,
        Support::Prefix { len } => sel.cand[..len].iter().any(|c| c.0 == token) && weighed(),
        Support::Nucleus { cut, len, .. } => {
            let l = row.get(t).copied().unwrap_or(f32::NAN);
            l.is_finite()
                && weighed()
                && match bucket(l).cmp(&cut) {
                    std::cmp::Ordering::Less => true,
                    std::cmp::Ordering::Equal => sel.cand[..len].iter().any(|c| c.0 == token),
                    std::cmp::Ordering::Greater => false,
                }
        }
        Support::Row { .. } => t < row.len() && weighed(),
    }
}

/// A seeded draw from `s`: a number below the support's drawn mass, then the first token in the
/// support's order (id order for a Row, best first otherwise) whose running mass passes it.
/// With `skip`, that token is taken out first (speculative verification's residual); if nothing
/// else has weight, `skip` comes back.
pub(super) fn draw(s: &Support, sel: &mut Selection, row: &[f32], rng: &mut StdRng, skip: Option<u32>) -> u32 {
    let skipped = skip.filter(|&t| drawable(s, sel, row, t));
    let skip_w = skipped.map_or(0, |t| sel.drawn[t as usize]);
    let total = match *s {
        Support::Certain(id) => return id,
        Support::Prefix { len } => len.checked_sub(1).map_or(0, |i| sel.cum[i]),
        Support::Nucleus { mass, .. } | Support::Row { mass } => mass,
    } - skip_w;
    if total == 0 {
        return skip.unwrap_or(0);
    }
    let mut r = rng.random_range(0..total);
    // The first candidate of `group` whose running drawn mass passes `r`, skipping `skip`.
    let pick = |group: &[Candidate], drawn: &[u64], r: u64| {
        let mut acc = 0;
        group.iter().map(|c| c.0).filter(|&id| Some(id) != skipped).find(|&id| {
            acc += drawn[id as usize];
            r < acc
        })
    };
    let found = match *s {
        Support::Certain(_) => None,
        Support::Prefix { len } if skipped.is_none() => {
            let cum = &sel.cum[..len];
            sel.cand.get(cum.partition_point(|&c| c <= r)).map(|c| c.0)
        }
        Support::Prefix { len } => pick(&sel.cand[..len], &sel.drawn, r),
        Support::Row { .. } => {
            let mut acc = 0;
            (0..row.len() as u32).filter(|&id| Some(id) != skipped).find(|&id| {
                acc += sel.drawn[id as usize];
                r < acc
            })
        }
        Support::Nucleus { cut, len, .. } => {
            let skip_bucket = skipped.map(|t| bucket(row[t as usize]));
            let mut found = None;
            for b in 0..=cut {
                // What is left of the number below the cut bucket falls inside its kept part.
                let m = if b == cut { u64::MAX } else { sel.drawn_mass[b] }
                    - if skip_bucket == Some(b) { skip_w } else { 0 };
                if r >= m {
                    r -= m;
                    continue;
                }
                found = if b == cut {
                    pick(&sel.cand[..len], &sel.drawn, r)
                } else {
                    // The bucket the number landed in, put in best-first order.
                    let n = gather_bucket(row, &sel.keys[..row.len()], b, &mut sel.landed);
                    sort_desc(&mut sel.landed[..n], &mut sel.spare);
                    pick(&sel.landed[..n], &sel.drawn, r)
                };
                break;
            }
            found
        }
    };
    // Exact sums leave no rounding to fall through; this only guards the invariant.
    found.or(skipped).unwrap_or(0)
}

#[cfg(test)]
impl super::Sampler {
    /// The ids that can be drawn and their weights in units of the best token's, sorted by id.
    pub(super) fn support_weights(&mut self, logits: &[f32]) -> Vec<(u32, f64)> {
        let row = &logits[..self.width(logits)];
        let s = support(row, &self.params, &mut self.sel);
        let sel = &self.sel;
        let ids: Vec<u32> = match s {
            Support::Certain(id) => return vec![(id, 1.0)],
            Support::Prefix { len } => sel.cand[..len].iter().map(|c| c.0).collect(),
            Support::Nucleus { cut, len, .. } => (0..row.len())
                .filter(|&i| row[i].is_finite() && bucket(row[i]) < cut)
                .map(|i| i as u32)
                .chain(sel.cand[..len].iter().map(|c| c.0))
                .collect(),
            Support::Row { .. } => (0..row.len() as u32).collect(),
        };
        let mut out: Vec<(u32, f64)> = ids
            .into_iter()
            .filter(|&id| sel.drawn[id as usize] > 0)
            .map(|id| (id, sel.drawn[id as usize] as f64 / sel.one))
            .collect();
        out.sort_by_key(|&(id, _)| id);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::order::{candidate, COMPARISONS, RADIX_MIN};
    use crate::sampler::tests::params;
    use crate::sampler::{token_logprobs, Sampler};
    use rand::SeedableRng;
    use std::collections::HashSet;

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
    /// then the smallest prefix whose fixed-point mass reaches top_p's share of the (top-k
    /// renormalised) mass; min-p zeroes the weights below its share of the best. Returns the kept
    /// (id, drawn weight) pairs best first, zero weights included.
    fn full_sort_nucleus(row: &[f32], p: &SamplingParams) -> Vec<(u32, u64)> {
        let max = row.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / f64::from(p.temperature);
        let one = f64::from(frac_bits(row.len())).exp2();
        let q = |l: f32| fixed_weight(l, max, inv_t, one);
        let mut all: Vec<(u32, f32)> =
            row.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| candidate(i, l)).collect();
        // Ids are unique, so any correct sort gives this one order (`desc` is left alone: it counts).
        all.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < all.len() {
            all.truncate(p.top_k);
        }
        let total: u64 = all.iter().map(|&(_, l)| q(l)).sum();
        let target = if p.top_p < 1.0 { share(p.top_p, total) } else { total };
        let mut acc = 0;
        let mut out = Vec::new();
        for &(id, l) in &all {
            let w = q(l);
            out.push((id, if w as f64 >= f64::from(p.min_p) * one { w } else { 0 }));
            acc += w;
            if acc >= target {
                break;
            }
        }
        out
    }

    /// The drawable ids of a nucleus and their weights in units of the best's, sorted by id.
    fn support_of(row: &[f32], mut out: Vec<(u32, u64)>) -> Vec<(u32, f64)> {
        let one = f64::from(frac_bits(row.len())).exp2();
        out.retain(|&(_, w)| w > 0);
        out.sort_by_key(|&(id, _)| id);
        out.into_iter().map(|(id, w)| (id, w as f64 / one)).collect()
    }

    /// `count` draws from a generator seeded with `seed`, by the definition spelled out the slow
    /// way: a +inf is certain, no finite logit means argmax; without top-k and top-p a walk over
    /// the row in id order, otherwise a walk over the full-sort nucleus best first: a number
    /// below the drawn mass, and the first token whose running mass passes it.
    fn full_sort_draws(row: &[f32], p: &SamplingParams, seed: u64, count: usize) -> Vec<u32> {
        full_sort_draws_from(row, p, None, seed, count)
    }

    /// `full_sort_draws` reusing the nucleus when the caller has it.
    fn full_sort_draws_from(
        row: &[f32],
        p: &SamplingParams,
        nucleus: Option<Vec<(u32, u64)>>,
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
            let one = f64::from(frac_bits(row.len())).exp2();
            row.iter()
                .enumerate()
                .map(|(i, &l)| {
                    let w = if l.is_finite() { fixed_weight(l, max, inv_t, one) } else { 0 };
                    (i as u32, if w as f64 >= f64::from(p.min_p) * one { w } else { 0 })
                })
                .collect()
        } else {
            nucleus.unwrap_or_else(|| full_sort_nucleus(row, p))
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let mut walk = || {
            let mass: u64 = kept.iter().map(|&(_, w)| w).sum();
            let r = rng.random_range(0..mass);
            let mut acc = 0;
            kept.iter()
                .find(|&&(_, w)| {
                    acc += w;
                    r < acc
                })
                .map(|c| c.0)
                .expect("r is below the mass")
        };
        (0..count).map(|_| walk()).collect()
    }

    /// One draw without `skip`, by the definition: the support's walk (id order for a whole
    /// row, best first for a nucleus) with `skip` left out; `skip` itself when nothing else has
    /// weight.
    fn residual_draw(row: &[f32], p: &SamplingParams, nucleus: Vec<(u32, u64)>, skip: u32, seed: u64) -> u32 {
        if let Some(i) = row.iter().position(|&l| l == f32::INFINITY) {
            return i as u32;
        }
        let finite = row.iter().filter(|l| l.is_finite()).count();
        if finite == 0 {
            return argmax(row);
        }
        let mut kept = nucleus;
        if (p.top_k == 0 || p.top_k >= finite) && p.top_p >= 1.0 {
            kept.sort_by_key(|c| c.0);
        }
        kept.retain(|c| c.0 != skip && c.1 > 0);
        let mass: u64 = kept.iter().map(|c| c.1).sum();
        if mass == 0 {
            return skip;
        }
        let r = StdRng::seed_from_u64(seed).random_range(0..mass);
        let mut acc = 0;
        kept.iter()
            .find(|c| {
                acc += c.1;
                r < acc
            })
            .map_or(skip, |c| c.0)
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

    /// The support is the definition's, and seeded draws pick
    /// the very tokens the definition's linear walk picks.
    #[test]
    fn partial_selection_matches_the_full_sort_definition() {
        let mut rng = StdRng::seed_from_u64(1234);
        let (mut nuclei, mut big_nuclei, mut radix_groups) = (0, 0, 0);
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
            let mut s = Sampler::new(p.clone(), n);
            assert_eq!(s.support_weights(&row), support_of(&row, nucleus.clone()), "case {case}: n={n} {p:?}");
            nuclei += usize::from(p.top_k == 0 && p.top_p < 1.0);
            let kept = nucleus.iter().filter(|c| c.1 > 0).count();
            big_nuclei += usize::from(kept > 1000);
            radix_groups += usize::from(kept > RADIX_MIN);
            let draws = if wide { 2 } else { 6 };
            let got: Vec<u32> = (0..draws).map(|_| s.sample(&row, &[])).collect();
            assert_eq!(
                got,
                full_sort_draws_from(&row, &p, Some(nucleus.clone()), case, draws),
                "case {case}: n={n} {p:?}"
            );
            // Verification's residual: the same walk with one token taken out (a drawable one,
            // or any id).
            let skip = match nucleus.iter().filter(|c| c.1 > 0).nth(rng.random_range(0..4)) {
                Some(c) if case % 3 != 0 => c.0,
                _ => rng.random_range(0..n as u32),
            };
            let support = support(&row, &p, &mut s.sel);
            let mut gen = StdRng::seed_from_u64(case);
            let got = draw(&support, &mut s.sel, &row, &mut gen, Some(skip));
            assert_eq!(got, residual_draw(&row, &p, nucleus, skip, case), "case {case}: n={n} skip {skip} {p:?}");
        }
        assert!(nuclei > 100 && big_nuclei > 30 && radix_groups > 60, "{nuclei} {big_nuclei} {radix_groups}");
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
}
