//! The model runner: executes a [`StepPlan`] and returns the logits the plan asks for. The engine
//! core only sees this trait, so its scheduling is tested with a fake runner.

use std::sync::Arc;

use flint_model::{ForwardBatch, LogitsRows, PagedKvCache, Qwen2Model};

use crate::scheduler::StepPlan;
use crate::EngineError;

/// Logit rows of one step, in plan order: for each chunk, every row when `all_logits` or it
/// carries a draft, else its last row when `sample`, else none.
#[derive(Debug, Clone, Default)]
pub struct StepLogits {
    pub width: usize,
    pub data: Vec<f32>,
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
}

/// Qwen2 over the paged KV cache.
pub struct PagedModelRunner {
    pub model: Arc<Qwen2Model>,
    pub cache: PagedKvCache,
}

impl ModelRunner for PagedModelRunner {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepLogits, EngineError> {
        let mut batch = ForwardBatch::new();
        for c in &plan.chunks {
            // A draft's chunk is the pending token and the draft: every row is verified.
            let rows = if c.all_logits || c.draft > 0 {
                LogitsRows::All
            } else if c.sample {
                LogitsRows::Last
            } else {
                LogitsRows::None
            };
            batch.push_paged(c.seq as usize, c.context_len, &c.tokens, rows, c.blocks.clone());
        }
        let width = self.model.config().vocab_size;
        let data = self.model.forward_logits(&batch, &mut self.cache)?.unwrap_or_default();
        Ok(StepLogits { width, data })
    }

    fn release(&mut self, blocks: &[u32]) {
        self.cache.release(blocks);
    }
}
