//! Speculative decoding's proposals, made after each step for the samples that decode next: by
//! each sample's drafter (n-gram) or by the draft model for all of them at once, within
//! [`SPEC_STEP_ROWS`]. Verifying them is the draw's part (`draws`).

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::{EngineCore, Handle};
use crate::runner::{DraftRequest, ModelRunner};
use crate::speculative::SpecMethod;
use crate::EngineError;

/// Rows (decode tokens plus draft tokens) up to which a step stays cheap enough for drafts.
/// Every row costs its share of compute, most of it the vocabulary projection (152k × hidden);
/// on a 2-core CPU a row costs about a fifth of a one-row step of qwen2.5-0.5b, so at 16
/// sequences the step is compute-bound and verifying drafts there measured 0.96× of plain
/// decoding even at 97% acceptance (docs/benchmarks.md, "Speculative decoding").
pub const SPEC_STEP_ROWS: usize = 16;

impl<R: ModelRunner> EngineCore<R> {
    /// Propose drafts for every sample that decodes next step (speculative decoding), unless
    /// more sequences run than `disable_by_batch_size` allows. Each sample's draft is also held
    /// to its share of [`SPEC_STEP_ROWS`]: verification rows are worth their compute only
    /// while a step is bound by reading the weights.
    pub(super) fn propose(&mut self) {
        let Some(cfg) = &self.speculative else { return };
        let running = self.scheduler.num_running();
        if cfg.disable_by_batch_size.is_some_and(|b| running > b) {
            return;
        }
        let k = cfg.num_speculative_tokens.min(SPEC_STEP_ROWS.saturating_sub(running) / running.max(1));
        if k == 0 {
            return;
        }
        if cfg.method == SpecMethod::DraftModel {
            return self.propose_with_draft_model(k);
        }
        for (&seq, s) in self.samples.iter_mut() {
            let Some(dr) = s.drafter.as_mut() else { continue };
            if !self.scheduler.is_decoding(seq) {
                continue;
            }
            let draft = dr.propose(self.scheduler.tokens(seq), k);
            if !draft.is_empty() {
                self.scheduler.set_draft(seq, draft);
            }
        }
    }

    /// The draft model proposes for every decoding sample at once (one batched pass per token);
    /// each gets blocks for its proposal first. A failing draft pass ends those requests, as a
    /// failing step would.
    fn propose_with_draft_model(&mut self, k: usize) {
        let mut reqs = Vec::new();
        for (&seq, s) in self.samples.iter_mut() {
            let Some(dr) = s.drafter.as_mut() else { continue };
            if !self.scheduler.is_decoding(seq) {
                continue;
            }
            let want = dr.next_len(k);
            let room = self.scheduler.reserve_draft(seq, want);
            let tokens = self.scheduler.tokens(seq);
            if let (true, Some(&token)) = (room > 0, tokens.last()) {
                let (position, blocks) = (tokens.len() - 1, self.scheduler.kv().blocks(seq).to_vec());
                reqs.push(DraftRequest { seq, position, token, blocks, k: room });
            }
        }
        if reqs.is_empty() {
            return;
        }
        reqs.sort_by_key(|r| r.seq);
        let result = catch_unwind(AssertUnwindSafe(|| self.runner.propose(&reqs)))
            .unwrap_or_else(|_| Err(EngineError::Internal("the draft model panicked".into())));
        match result {
            Ok(drafts) => {
                for (r, d) in reqs.iter().zip(drafts) {
                    self.scheduler.set_draft(r.seq, d);
                }
            }
            Err(e) => {
                let groups: Vec<Handle> =
                    reqs.iter().filter_map(|r| self.samples.get(&r.seq).map(|s| s.group)).collect();
                for g in groups {
                    self.fail_group(g, &format!("the draft model failed: {e}"));
                }
            }
        }
    }
}
