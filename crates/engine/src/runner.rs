//! The model runner: executes a [`StepPlan`] and returns the logits the plan asks for. The engine
//! core only sees this trait, so its scheduling is tested with a fake runner.

use std::sync::Arc;

use flint_model::{DecoderModel, ForwardBatch, KvPool, LogitsRows, PagedKvCache};

use crate::kv_manager::SeqId;
use crate::scheduler::StepPlan;
use crate::EngineError;
use flint_model::kernels::argmax::argmax;

/// Logit rows of one step, in plan order: for each chunk, the rows
/// [`ScheduledChunk::logits`](crate::scheduler::ScheduledChunk::logits) names; and the final
/// hidden rows [`ScheduledChunk::hidden`](crate::scheduler::ScheduledChunk::hidden) names
/// (embeddings), likewise in plan order.
#[derive(Debug, Clone, Default)]
pub struct StepLogits {
    pub width: usize,
    pub data: Vec<f32>,
    pub hidden_width: usize,
    pub hidden: Vec<f32>,
}

impl StepLogits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.width..(i + 1) * self.width]
    }

    pub fn num_rows(&self) -> usize {
        self.data.len() / self.width.max(1)
    }
}

pub trait ModelRunner: Send {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepLogits, EngineError>;

    /// Forget whatever is kept for `blocks`, which no sequence holds any more (called with each
    /// plan's `freed_blocks` before it runs).
    fn release(&mut self, _blocks: &[u32]) {}

    /// A draft model's greedy proposals, one list per request (speculative decoding with
    /// `draft_model`); runners without a draft propose nothing.
    fn propose(&mut self, reqs: &[DraftRequest]) -> Result<Vec<Vec<u32>>, EngineError> {
        Ok(vec![Vec::new(); reqs.len()])
    }
}

/// One sequence's proposal: its pending token sits at `position` (everything before it is in the
/// cache); propose `k` tokens to follow it. `blocks` covers positions up to `position + k`.
#[derive(Debug, Clone)]
pub struct DraftRequest {
    pub seq: SeqId,
    pub position: usize,
    pub token: u32,
    pub blocks: Vec<u32>,
    pub k: usize,
}

/// The draft of speculative decoding: its own weights and its own paged cache over the same
/// block tables as the target's (so prefix hits, preemption and rollback hold for both). It runs
/// every chunk the target runs, without logits, so its cache holds every position the target's
/// does; proposing writes the pending token and the proposals after it, so of the next step's
/// verification chunk it only has the last token left to write.
pub struct DraftModel {
    pub model: Arc<DecoderModel>,
    pub cache: PagedKvCache,
    /// Ids the draft may propose (the tokenizer's, shared with the target).
    pub valid_vocab: usize,
}

/// Qwen2 over the paged KV cache (in host memory, or the GPU's when the model runs there), with a
/// draft model when speculative decoding uses one.
pub struct PagedModelRunner {
    pub model: Arc<DecoderModel>,
    pub cache: KvPool,
    pub draft: Option<DraftModel>,
}

impl ModelRunner for PagedModelRunner {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepLogits, EngineError> {
        let mut batch = ForwardBatch::new();
        for c in &plan.chunks {
            batch.push_paged(c.seq as usize, c.context_len, &c.tokens, c.logits(), c.blocks.clone());
            batch.want_hidden(c.hidden());
        }
        let width = self.model.config().vocab_size;
        let out = self.model.forward_step(&batch, &mut self.cache)?;
        let (data, hidden) = (out.logits.unwrap_or_default(), out.hidden);
        if let Some(d) = self.draft.as_mut() {
            let mut mirror = ForwardBatch::new();
            for c in &plan.chunks {
                // A verification chunk is the pending token and the draft's own proposals, which
                // proposing already wrote at these positions but the last: only that one is new.
                let skip = if c.draft > 0 { c.tokens.len() - 1 } else { 0 };
                let (at, tokens) = (c.context_len + skip, &c.tokens[skip..]);
                mirror.push_paged(c.seq as usize, at, tokens, LogitsRows::None, c.blocks.clone());
            }
            d.model.forward_logits(&mirror, &mut d.cache)?;
        }
        Ok(StepLogits { width, data, hidden_width: self.model.config().hidden_size, hidden })
    }

    fn release(&mut self, blocks: &[u32]) {
        self.cache.release(blocks);
        if let Some(d) = self.draft.as_mut() {
            d.cache.release(blocks);
        }
    }

    fn propose(&mut self, reqs: &[DraftRequest]) -> Result<Vec<Vec<u32>>, EngineError> {
        let mut out = vec![Vec::new(); reqs.len()];
        let Some(d) = self.draft.as_mut() else { return Ok(out) };
        let width = d.model.config().vocab_size;
        let mut next: Vec<u32> = reqs.iter().map(|r| r.token).collect();
        // One pass per proposed token, every sequence still proposing in the same batch.
        for i in 0..reqs.iter().map(|r| r.k).max().unwrap_or(0) {
            let mut batch = ForwardBatch::new();
            let live: Vec<usize> = (0..reqs.len()).filter(|&j| i < reqs[j].k).collect();
            for &j in &live {
                let r = &reqs[j];
                batch.push_paged(r.seq as usize, r.position + i, &next[j..j + 1], LogitsRows::Last, r.blocks.clone());
            }
            let logits = d.model.forward_logits(&batch, &mut d.cache)?.unwrap_or_default();
            if logits.len() != live.len() * width {
                return Err(EngineError::Internal(format!(
                    "the draft returned {} logits for {} rows of {width}",
                    logits.len(),
                    live.len()
                )));
            }
            for (row, &j) in live.iter().enumerate() {
                let t = argmax(&logits[row * width..][..d.valid_vocab.min(width)]);
                out[j].push(t);
                next[j] = t;
            }
        }
        Ok(out)
    }
}
