//! The best-first order of (id, logit) candidates that top-k, top-p and the reported top
//! logprobs share: the comparator that defines it, a u32 key that sorts the same way, the key's
//! buckets that let top-k and top-p look at the head of a row only, and the radix sort that puts
//! a bucket in order without comparing.

use std::cmp::Ordering;

/// Best first, ties to the lower id: the order the full-sort definitions of top-k and top-p use.
/// Only ever sees finite logits (so the order is total) with -0.0 folded into 0.0 (so it ties).
pub(super) fn desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    #[cfg(test)]
    COMPARISONS.with(|c| c.set(c.get() + 1));
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// An (id, logit) pair.
pub(super) type Candidate = (u32, f32);

pub(super) fn candidate(i: usize, l: f32) -> Candidate {
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
pub(super) const BUCKETS: usize = 1 << BUCKET_BITS;

/// Bucket 0 holds the largest logits.
pub(super) fn bucket(l: f32) -> usize {
    (desc_key(l) >> (32 - BUCKET_BITS)) as usize
}

/// Below this many candidates a comparison sort is cheaper than the radix sort's histograms.
pub(super) const RADIX_MIN: usize = 64;

/// Writes the finite candidates of buckets `first..=last` into `cand` from `at` on, grouped by
/// bucket in bucket order and in id order within each (which `sort_desc` needs); returns how
/// many. `counts` must be the row's per-bucket counts.
pub(super) fn gather(
    row: &[f32],
    counts: &[u32],
    first: usize,
    last: usize,
    at: usize,
    cand: &mut Vec<Candidate>,
) -> usize {
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

/// `bucket` of every id of a row as a nucleus records it, with `NOT_A_CANDIDATE` for NaN and
/// -inf; `gather_bucket` reads it back.
pub(super) const NOT_A_CANDIDATE: u16 = u16::MAX;
const _: () = assert!(BUCKETS <= NOT_A_CANDIDATE as usize);

/// Writes the candidates of bucket `b` into `cand` (cleared first) in id order, finding them
/// through `keys` (each id's bucket) rather than the logits: a scan of 2-byte keys whose
/// 64-id spans the compiler checks in vector compares, looking inside only the spans that hold
/// one. Returns how many.
pub(super) fn gather_bucket(row: &[f32], keys: &[u16], b: usize, cand: &mut Vec<Candidate>) -> usize {
    const SPAN: usize = 64;
    cand.clear();
    let b = b as u16;
    for (s, span) in keys.chunks(SPAN).enumerate() {
        if span.iter().fold(false, |hit, &k| hit | (k == b)) {
            for (j, _) in span.iter().enumerate().filter(|(_, &k)| k == b) {
                let i = s * SPAN + j;
                cand.push(candidate(i, row[i]));
            }
        }
    }
    cand.len()
}

/// Sorts one bucket's candidates into `desc` order: best first, ties to the lower id. Groups
/// past `RADIX_MIN` go through an LSD radix sort on the bits of `desc_key` below the bucket's:
/// it is stable, so given the group in id order (as `gather` leaves it) equal keys stay in id
/// order, which is exactly `desc`'s tie-break, and it compares nothing.
pub(super) fn sort_desc(v: &mut [Candidate], spare: &mut Vec<Candidate>) {
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

#[cfg(test)]
thread_local! {
    /// Calls of `desc` on this thread, so a test can tell a comparison sort of the vocabulary
    /// from the radix path without timing anything.
    pub(super) static COMPARISONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

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
}
