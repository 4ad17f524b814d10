//! N-gram prompt lookup: propose the tokens that followed an earlier occurrence of the sequence's
//! own last n tokens, for the longest n in the window `min..=max`; among those, the most recent
//! occurrence that is followed by enough tokens (in a run of one repeated token the most recent
//! occurrence overlaps the suffix and is followed by a single token).
//!
//! A naive lookup scans the whole history every step (a 16k-token context, 16 sequences: a
//! noticeable part of a decode step). The index instead maps each `min`-gram to the positions
//! where it ends, kept up to date as tokens arrive, so a lookup only visits earlier occurrences
//! of the last `min` tokens and extends each backwards up to `max`.

use std::collections::HashMap;

/// Most earlier occurrences a lookup extends (the most recent ones): bounds the cost of very
/// frequent n-grams (runs of one token).
const MAX_CANDIDATES: usize = 64;

#[derive(Debug, Clone)]
pub struct NgramIndex {
    min: usize,
    max: usize,
    /// `min`-gram (hashed) → the positions just past each of its occurrences, oldest first.
    ends: HashMap<u64, Vec<u32>>,
    /// Tokens indexed so far.
    seen: usize,
}

fn gram_hash(gram: &[u32]) -> u64 {
    // FNV-1a over the ids: collisions only cost a comparison, the candidates are verified.
    gram.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3))
}

impl NgramIndex {
    pub fn new(min: usize, max: usize) -> Self {
        let min = min.max(1);
        Self { min, max: max.max(min), ends: HashMap::new(), seen: 0 }
    }

    /// Index `tokens` past what was seen (the history only ever grows).
    pub fn extend(&mut self, tokens: &[u32]) {
        let start = self.seen.max(self.min);
        for end in start..=tokens.len() {
            self.ends.entry(gram_hash(&tokens[end - self.min..end])).or_default().push(end as u32);
        }
        self.seen = self.seen.max(tokens.len());
    }

    /// Up to `limit` tokens that followed the best earlier match of `tokens`' suffix: the longest
    /// (at most `max`, at least `min` tokens), then the one followed by the most tokens (up to
    /// `limit`), then the most recent.
    pub fn propose(&self, tokens: &[u32], limit: usize) -> Vec<u32> {
        let len = tokens.len();
        if limit == 0 || len <= self.min {
            return Vec::new();
        }
        let suffix = &tokens[len - self.min..];
        let Some(ends) = self.ends.get(&gram_hash(suffix)) else { return Vec::new() };
        // (end, match length, tokens it offers)
        let mut best: Option<(usize, usize, usize)> = None;
        for &end in ends.iter().rev().filter(|&&e| (e as usize) < len).take(MAX_CANDIDATES) {
            let end = end as usize;
            if tokens[end - self.min..end] != *suffix {
                continue;
            }
            let mut n = self.min;
            while n < self.max && n < end && tokens[end - 1 - n] == tokens[len - 1 - n] {
                n += 1;
            }
            let offers = (len - end).min(limit);
            if best.is_none_or(|(_, bn, bo)| (n, offers) > (bn, bo)) {
                best = Some((end, n, offers));
                if (n, offers) == (self.max, limit) {
                    break;
                }
            }
        }
        best.map(|(end, _, offers)| tokens[end..end + offers].to_vec()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, by brute force: longest suffix match in the window, then the longest
    /// continuation (up to `limit`), then the most recent.
    fn reference(tokens: &[u32], min: usize, max: usize, limit: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min..=max).rev() {
            if n >= len {
                continue;
            }
            let suffix = &tokens[len - n..];
            let ends = (n..len).rev().filter(|&end| &tokens[end - n..end] == suffix);
            // max_by_key keeps the last maximum: iterate oldest first so that is the most recent.
            let best = ends.collect::<Vec<_>>().into_iter().rev().max_by_key(|&end| (len - end).min(limit));
            if let Some(end) = best {
                return tokens[end..(end + limit).min(len)].to_vec();
            }
        }
        Vec::new()
    }

    #[test]
    fn longest_then_most_recent_match() {
        let t = [7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3];
        let mut ix = NgramIndex::new(2, 3);
        ix.extend(&t);
        // [2, 3] occurs at 2..4 and 6..8; [1, 2, 3] only at 1..4: the longer match wins.
        assert_eq!(ix.propose(&t, 3), vec![9, 5, 2]);
        let mut ix = NgramIndex::new(2, 2);
        ix.extend(&t);
        assert_eq!(ix.propose(&t, 3), vec![8, 1, 2], "equally long: the most recent");
        assert_eq!(ix.propose(&t, 5), vec![9, 5, 2, 3, 8], "unless an older one offers more tokens");
        let run = [5, 5, 5, 5, 5, 5];
        let mut ix = NgramIndex::new(2, 2);
        ix.extend(&run);
        assert_eq!(ix.propose(&run, 3), vec![5, 5, 5], "a run continues past the overlapping match");
        assert!(ix.propose(&[4, 5, 6], 3).is_empty());
        assert!(ix.propose(&t, 0).is_empty());
    }

    #[test]
    fn matches_brute_force_as_tokens_arrive() {
        let mut state = 12345u64;
        for trial in 0..200 {
            let (min, max) = (1 + trial % 3, 1 + trial % 3 + trial % 4);
            let mut ix = NgramIndex::new(min, max);
            let mut toks = Vec::new();
            for _ in 0..60 {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                toks.push(((state >> 33) % 4) as u32);
                ix.extend(&toks);
                let limit = 1 + (state >> 20) as usize % 5;
                assert_eq!(ix.propose(&toks, limit), reference(&toks, min, max, limit), "{toks:?} {min} {max}");
            }
        }
    }
}
