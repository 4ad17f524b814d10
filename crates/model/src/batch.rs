//! The plan for one forward pass: the new tokens of several sequences, flattened, and for each
//! sequence where its keys and values live and how many it already has. The engine builds it;
//! the model only reads it.

use std::ops::Range;

use crate::error::{ModelError, Result};

/// Which rows of logits a sequence wants back from this pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRows {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// The last new token's row (decode, or the final prefill chunk).
    Last,
    /// Every new token's row (prompt logprobs, speculative verification, golden tests).
    All,
}

impl LogitsRows {
    /// The rows this selects of a chunk of `num_tokens` new tokens, counted from its first.
    pub fn rows(self, num_tokens: usize) -> Range<usize> {
        match self {
            LogitsRows::None => 0..0,
            LogitsRows::Last => num_tokens.saturating_sub(1)..num_tokens,
            LogitsRows::All => 0..num_tokens,
        }
    }
}

/// One sequence's share of a batch. The same idea has one type per layer, each holding what its
/// layer needs: the engine schedules a `ScheduledChunk` (token ids, and why rows are wanted:
/// sampling, prompt logprobs, a draft), the model runs this (where the keys and values live,
/// which logit rows), and the attention kernel reads a
/// [`SeqView`](crate::kernels::attention::SeqView) (its rows of the flattened batch, borrowed
/// block tables), so the model knows nothing of scheduling and the kernel nothing of batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqChunk {
    /// The sequence's id: the paged cache names it in errors, the contiguous cache keeps one
    /// buffer of keys and values per id.
    pub seq: usize,
    /// Tokens already in the cache for this sequence; the first new token sits at this position.
    pub context_len: usize,
    /// How many new tokens of the batch belong to this sequence.
    pub num_tokens: usize,
    pub logits: LogitsRows,
    /// Which rows' final hidden states (after the last norm) come back: embeddings pool them.
    pub hidden: LogitsRows,
    /// The paged cache's block table: position `p` lives in block `blocks[p / block_size]`.
    /// Empty for caches addressed by `seq` alone (the contiguous one).
    pub blocks: Vec<u32>,
}

#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    /// New tokens of every sequence, sequence after sequence.
    pub tokens: Vec<u32>,
    /// Absolute position of each new token (context_len + i within its sequence).
    pub positions: Vec<u32>,
    pub seqs: Vec<SeqChunk>,
}

impl ForwardBatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append a sequence's new tokens, continuing after `context_len` cached ones.
    pub fn push(&mut self, seq: usize, context_len: usize, tokens: &[u32], logits: LogitsRows) {
        self.push_paged(seq, context_len, tokens, logits, Vec::new());
    }

    /// Append a sequence whose keys and values live in the paged blocks `blocks`.
    pub fn push_paged(&mut self, seq: usize, context_len: usize, tokens: &[u32], logits: LogitsRows, blocks: Vec<u32>) {
        self.tokens.extend_from_slice(tokens);
        self.positions.extend((0..tokens.len()).map(|i| (context_len + i) as u32));
        let hidden = LogitsRows::None;
        self.seqs.push(SeqChunk { seq, context_len, num_tokens: tokens.len(), logits, hidden, blocks });
    }

    /// Ask for the final hidden states of `rows` of the sequence pushed last.
    pub fn want_hidden(&mut self, rows: LogitsRows) {
        if let Some(s) = self.seqs.last_mut() {
            s.hidden = rows;
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Rows of the flattened batch whose logits are wanted, in output order.
    pub fn logit_rows(&self) -> Vec<usize> {
        self.rows_of(|s| s.logits)
    }

    /// Rows of the flattened batch whose final hidden states are wanted, in output order.
    pub fn hidden_rows(&self) -> Vec<usize> {
        self.rows_of(|s| s.hidden)
    }

    fn rows_of(&self, which: impl Fn(&SeqChunk) -> LogitsRows) -> Vec<usize> {
        let mut rows = Vec::new();
        let mut offset = 0;
        for s in &self.seqs {
            rows.extend(which(s).rows(s.num_tokens).map(|r| offset + r));
            offset += s.num_tokens;
        }
        rows
    }

    /// Structural checks; a malformed plan is an engine bug, reported rather than panicking.
    pub fn validate(&self) -> Result<()> {
        let total: usize = self.seqs.iter().map(|s| s.num_tokens).sum();
        if total != self.tokens.len() || self.positions.len() != self.tokens.len() {
            return Err(ModelError::Batch(format!(
                "{} tokens, {} positions, chunks sum to {total}",
                self.tokens.len(),
                self.positions.len()
            )));
        }
        if self.seqs.iter().any(|s| s.num_tokens == 0) {
            return Err(ModelError::Batch("a sequence chunk has no tokens".into()));
        }
        // RoPE reads `positions`, the mask and the cache read `context_len`: they must agree.
        let mut offset = 0;
        for s in &self.seqs {
            let expected = (s.context_len..s.context_len + s.num_tokens).map(|p| p as u32);
            if !self.positions[offset..offset + s.num_tokens].iter().copied().eq(expected) {
                return Err(ModelError::Batch(format!(
                    "sequence {}: positions do not continue from context_len {}",
                    s.seq, s.context_len
                )));
            }
            offset += s.num_tokens;
        }
        let mut seqs: Vec<usize> = self.seqs.iter().map(|s| s.seq).collect();
        seqs.sort_unstable();
        if seqs.windows(2).any(|w| w[0] == w[1]) {
            return Err(ModelError::Batch("a sequence appears twice in one batch".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_positions() {
        let mut b = ForwardBatch::new();
        b.push(3, 0, &[1, 2, 3], LogitsRows::Last);
        b.push(0, 10, &[4], LogitsRows::All);
        b.push(1, 5, &[5, 6], LogitsRows::None);
        assert_eq!(b.positions, vec![0, 1, 2, 10, 5, 6]);
        assert_eq!(b.logit_rows(), vec![2, 3]);
        b.validate().unwrap();
        b.push(0, 11, &[7], LogitsRows::Last);
        assert!(b.validate().is_err());
        let mut c = ForwardBatch::new();
        c.push(0, 4, &[1, 2], LogitsRows::Last);
        c.positions[1] = 9;
        assert!(c.validate().unwrap_err().to_string().contains("positions"));
    }
}
