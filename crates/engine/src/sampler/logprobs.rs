//! The log-probabilities reported to clients: the chosen token's and the k most likely ids', of
//! the raw model row.

use std::cmp::Ordering;

use super::order::{candidate, desc};

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
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

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
