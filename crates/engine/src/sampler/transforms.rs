//! What is done to a row before the draw, in vLLM's order: the grammar's allowed-id mask first
//! (so nothing after it can make a disallowed id possible again), then logit bias, banned ids,
//! the repetition penalty and the frequency and presence penalties. Also what they read: the
//! prompt and output ids the penalties count, and the mask, set by the caller before each draw.

use super::Sampler;

impl Sampler {
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

    /// Applies bias, bans and penalties into `scratch` when any is in effect (true); otherwise the
    /// raw row is used as it is, saving a copy of 150k floats per greedy step.
    pub(super) fn prepare(&mut self, logits: &[f32], banned: &[u32]) -> bool {
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

/// [`argmax`](super::argmax) of `v` with every id outside the bitset `words` read as -inf, reading only the
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::tests::params;
    use crate::sampler::{argmax, SamplingParams};
    use std::collections::HashSet;

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
}
