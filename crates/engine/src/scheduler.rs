//! The scheduler: pure bookkeeping that decides, each step, which tokens of which sequences the
//! model computes, and emits that decision as a plain [`StepPlan`].
//!
//! One token budget per step (`max_num_batched_tokens`). Running sequences go first, oldest
//! first: a decoding one needs one token, one still ingesting its prompt gets a chunk of what is
//! left of the budget (chunked prefill, so a long prompt never stalls the streams already
//! running). Then waiting sequences are admitted in arrival order while budget, sequence slots
//! and blocks last, each starting after whatever prefix of it the cache already holds. When
//! blocks run out, the newest running sequence is preempted by recompute: its blocks are freed
//! and it goes back to the front of the queue, to be prefilled again (prompt and output so far)
//! later. The oldest running sequence is never preempted for a younger one, so some sequence
//! always advances: a request admitted because it fits the pool alone finishes.
//!
//! Speculative decoding: a decoding sequence may carry a draft ([`Scheduler::set_draft`]); its
//! chunk then holds the pending token followed by as much of the draft as the budget, its limits
//! and the pool allow, and every row of it is verified. Until the engine reports how much of the
//! draft was accepted ([`Scheduler::accept_draft`]), only the pending token counts as computed,
//! so the prefix cache never registers a block holding a token that was not accepted.

use std::collections::{HashMap, VecDeque};

use flint_model::LogitsRows;

use crate::kv_manager::{salt_hash, KvManager, PrefixHit, SeqId};
use crate::pooling::PoolingType;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub enable_prefix_caching: bool,
    /// The cache quantizes a block when it fills (int8): a draft must never fill one, or a
    /// rejected token would be frozen into its codes.
    pub quantize_full_blocks: bool,
}

impl SchedulerConfig {
    /// Would a request of `prompt` tokens generating up to `max_tokens` ever fit?
    pub fn check_admissible(&self, prompt: usize, max_tokens: usize) -> Result<(), AdmissionError> {
        if prompt == 0 {
            return Err(AdmissionError::EmptyPrompt);
        }
        // A client can send any max_tokens: saturate rather than overflow past the check.
        let total = prompt.saturating_add(max_tokens);
        if total > self.max_model_len {
            return Err(AdmissionError::ContextLength { max_model_len: self.max_model_len, total, prompt, max_tokens });
        }
        let needed = total.div_ceil(self.block_size.max(1));
        if needed > self.num_blocks {
            return Err(AdmissionError::PoolTooSmall { tokens: total, needed, total: self.num_blocks });
        }
        Ok(())
    }
}

/// A sequence to schedule.
#[derive(Debug, Clone, Default)]
pub struct SeqSpec {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Isolates this sequence's prefix-cache entries from those of other salts.
    pub cache_salt: Option<String>,
    /// Every prompt position's logits are wanted, so none may come from the cache.
    pub prompt_logprobs: bool,
    /// An embedding: the prompt's final hidden states are pooled and nothing is sampled.
    pub pooling: Option<PoolingType>,
    /// Admit only once this sequence's prompt is computed (siblings of an `n > 1` request wait
    /// for the first one, then reuse its prompt blocks from the prefix cache).
    pub after: Option<SeqId>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {total} tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the length \
         of the messages or completion."
    )]
    ContextLength { max_model_len: usize, total: usize, prompt: usize, max_tokens: usize },
    #[error(
        "the request needs {needed} KV-cache blocks for {tokens} tokens but the pool has only {total}; \
         reduce max_tokens or the prompt, or start flint with a larger --kv-cache-memory"
    )]
    PoolTooSmall { tokens: usize, needed: usize, total: usize },
    #[error("sequence {0} already exists")]
    Duplicate(SeqId),
}

/// One sequence's share of a step, as the scheduler decides it; the runner hands it to the model
/// as a [`flint_model::SeqChunk`] (whose docs say why each layer has its own type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub seq: SeqId,
    /// Tokens already in the cache; `tokens[0]` sits at this position.
    pub context_len: usize,
    pub tokens: Vec<u32>,
    /// The sequence's block table, covering `context_len + tokens.len()` positions.
    pub blocks: Vec<u32>,
    /// The chunk ends the known tokens: sample the next one from its last row.
    pub sample: bool,
    /// The chunk holds prompt positions whose logprobs were asked for: every row is wanted.
    pub prompt_logprobs: bool,
    /// The last `draft` tokens are proposals to verify: every row from the pending token on is
    /// wanted (`draft + 1` rows; a chunk with a draft is the pending token and the draft).
    pub draft: usize,
    /// The chunk belongs to an embedding: it returns hidden rows ([`hidden`](Self::hidden)), no
    /// logits, and its sequence ends with the prompt.
    pub pooling: Option<PoolingType>,
}

impl ScheduledChunk {
    /// The logit rows the model returns for this chunk, the one rule the runners and the engine
    /// core share: every row for prompt logprobs or a draft to verify, the last when it samples,
    /// none otherwise.
    pub fn logits(&self) -> LogitsRows {
        if self.pooling.is_some() {
            LogitsRows::None
        } else if self.prompt_logprobs || self.draft > 0 {
            LogitsRows::All
        } else if self.sample {
            LogitsRows::Last
        } else {
            LogitsRows::None
        }
    }

    /// How many rows [`logits`](Self::logits) selects.
    pub fn num_logit_rows(&self) -> usize {
        self.logits().rows(self.tokens.len()).len()
    }

    /// When the chunk samples, where its sampled rows start among its logit rows: the pending
    /// token's row, then one per draft token, which end the chunk's rows.
    pub fn first_sampled_row(&self) -> Option<usize> {
        (self.sample && self.pooling.is_none()).then(|| self.num_logit_rows() - 1 - self.draft)
    }

    /// The final hidden rows the model returns for this chunk (embeddings only).
    pub fn hidden(&self) -> LogitsRows {
        match self.pooling {
            Some(p) => p.rows(self.context_len, self.sample),
            None => LogitsRows::None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub chunks: Vec<ScheduledChunk>,
    /// Sequences preempted this step (their blocks are already freed).
    pub preempted: Vec<SeqId>,
    /// Blocks no sequence holds any more since the previous plan (finished, aborted, preempted):
    /// the runner drops what it keeps per block for them before running this plan.
    pub freed_blocks: Vec<u32>,
    pub num_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and how many were found.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

#[derive(Debug)]
struct Seq {
    spec: SeqSpec,
    salt: Option<u64>,
    tokens: Vec<u32>,
    num_computed: usize,
    running: bool,
    /// Prompt tokens served from the prefix cache at first admission.
    cached_prompt_tokens: Option<usize>,
    /// Proposed tokens to verify with the next decode step.
    draft: Vec<u32>,
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvManager,
    seqs: HashMap<SeqId, Seq>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    pub stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        let kv = KvManager::new(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching);
        Self { cfg, kv, seqs: HashMap::new(), waiting: VecDeque::new(), running: Vec::new(), stats: Default::default() }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Prompt and generated tokens of `id`.
    pub fn tokens(&self, id: SeqId) -> &[u32] {
        self.seqs.get(&id).map_or(&[], |s| &s.tokens)
    }

    pub fn cached_prompt_tokens(&self, id: SeqId) -> usize {
        self.seqs.get(&id).and_then(|s| s.cached_prompt_tokens).unwrap_or(0)
    }

    /// Would a request of `prompt` tokens generating up to `max_tokens` ever fit?
    pub fn check_admissible(&self, prompt: usize, max_tokens: usize) -> Result<(), AdmissionError> {
        self.cfg.check_admissible(prompt, max_tokens)
    }

    /// Queue a sequence, or refuse it now if it could never run.
    pub fn add(&mut self, spec: SeqSpec) -> Result<(), AdmissionError> {
        self.check_admissible(spec.prompt.len(), spec.max_tokens)?;
        if self.seqs.contains_key(&spec.id) {
            return Err(AdmissionError::Duplicate(spec.id));
        }
        let id = spec.id;
        let salt = spec.cache_salt.as_deref().map(salt_hash);
        let tokens = spec.prompt.clone();
        self.seqs.insert(
            id,
            Seq { spec, salt, tokens, num_computed: 0, running: false, cached_prompt_tokens: None, draft: Vec::new() },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Decide the next step.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(s) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (s.tokens.len() - s.num_computed).min(budget);
            if n == 0 {
                // Nothing new to compute (cannot happen while every step samples; never a 0-token chunk).
                i += 1;
                continue;
            }
            let end = s.num_computed + n;
            // A draft rides along only when its blocks are free; it never costs a preemption.
            let room = if s.tokens.len() - s.num_computed == 1 { self.draft_room(s).min(budget - 1) } else { 0 };
            let draft: Vec<u32> = s.draft.iter().copied().take(room).collect();
            if !draft.is_empty() && self.kv.allocate(id, end + draft.len()) {
                self.push_chunk(&mut plan, id, n, &draft);
                budget -= n + draft.len();
                if let Some(s) = self.seqs.get_mut(&id) {
                    s.draft.clear();
                }
                i += 1;
                continue;
            }
            let mut scheduled = true;
            while !self.kv.allocate(id, end) {
                let Some(victim) = self.running.pop() else { break };
                self.preempt(victim);
                plan.preempted.push(victim);
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            self.push_chunk(&mut plan, id, n, &[]);
            budget -= n;
            if let Some(s) = self.seqs.get_mut(&id) {
                s.draft.clear();
            }
            i += 1;
        }
        // As vLLM: no admissions in a step that had to preempt, the pool is already short.
        if plan.preempted.is_empty() {
            self.admit(&mut plan, budget);
        }
        plan.freed_blocks = self.kv.take_freed();
        plan
    }

    fn admit(&mut self, plan: &mut StepPlan, mut budget: usize) {
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let Some(s) = self.seqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            if let Some(leader) = s.spec.after.and_then(|l| self.seqs.get(&l)) {
                if !leader.running || leader.num_computed < leader.spec.prompt.len() {
                    break;
                }
            }
            let every_row = s.spec.prompt_logprobs || s.spec.pooling.is_some_and(PoolingType::needs_every_row);
            let hit = if every_row { PrefixHit::default() } else { self.kv.lookup(&s.tokens, s.salt) };
            let ctx = hit.blocks.len() * self.kv.block_size();
            let n = (s.tokens.len() - ctx).min(budget);
            if !self.kv.can_allocate(id, ctx + n, &hit) {
                break;
            }
            let first_admission = s.cached_prompt_tokens.is_none();
            let (prompt_len, salt) = (s.spec.prompt.len(), s.salt);
            if self.kv.prefix_caching() && !every_row && first_admission {
                self.stats.prefix_queries += prompt_len as u64;
                self.stats.prefix_hits += ctx.min(prompt_len) as u64;
            }
            self.kv.start(id, hit, salt);
            if !self.kv.allocate(id, ctx + n) {
                // can_allocate said yes; if the pool disagrees, undo and wait.
                self.kv.free(id);
                break;
            }
            self.waiting.pop_front();
            if let Some(s) = self.seqs.get_mut(&id) {
                s.num_computed = ctx;
                s.running = true;
                if first_admission {
                    s.cached_prompt_tokens = Some(ctx.min(prompt_len));
                }
            }
            self.running.push(id);
            self.push_chunk(plan, id, n, &[]);
            budget -= n;
        }
    }

    /// Most draft tokens a decode step of `s` may verify: each accepted one is an output token,
    /// so within `max_tokens` and the model length; with a quantizing cache, never as far as the
    /// end of the block the draft starts in.
    fn draft_room(&self, s: &Seq) -> usize {
        self.room_for(s, s.draft.len())
    }

    fn room_for(&self, s: &Seq, want: usize) -> usize {
        if want == 0 {
            return 0;
        }
        let generated = s.tokens.len() - s.spec.prompt.len();
        // The verification yields up to draft + 1 tokens after the pending one.
        let by_tokens = s.spec.max_tokens.saturating_sub(generated + 1);
        let by_len = self.cfg.max_model_len.saturating_sub(s.tokens.len() + 1);
        let mut room = want.min(by_tokens).min(by_len);
        if self.cfg.quantize_full_blocks {
            let bs = self.cfg.block_size.max(1);
            let first = s.num_computed + 1;
            let block_end = (first / bs + 1) * bs;
            room = room.min(block_end.saturating_sub(first + 1));
        }
        room
    }

    fn push_chunk(&self, plan: &mut StepPlan, id: SeqId, n: usize, draft: &[u32]) {
        let Some(s) = self.seqs.get(&id) else { return };
        let ctx = s.num_computed;
        let mut tokens = s.tokens[ctx..ctx + n].to_vec();
        tokens.extend_from_slice(draft);
        plan.chunks.push(ScheduledChunk {
            seq: id,
            context_len: ctx,
            tokens,
            blocks: self.kv.blocks(id).to_vec(),
            sample: ctx + n == s.tokens.len(),
            prompt_logprobs: s.spec.prompt_logprobs && ctx < s.spec.prompt.len(),
            draft: draft.len(),
            pooling: s.spec.pooling,
        });
        plan.num_tokens += n + draft.len();
    }

    fn preempt(&mut self, id: SeqId) {
        self.kv.free(id);
        if let Some(s) = self.seqs.get_mut(&id) {
            s.num_computed = 0;
            s.running = false;
            s.draft.clear();
        }
        self.waiting.push_front(id);
        self.stats.preemptions += 1;
    }

    /// The model ran `plan`: its tokens are now in the cache (a draft's only once accepted).
    pub fn on_step_done(&mut self, plan: &StepPlan) {
        for c in &plan.chunks {
            if let Some(s) = self.seqs.get_mut(&c.seq) {
                s.num_computed = c.context_len + c.tokens.len() - c.draft;
                self.kv.commit(c.seq, &s.tokens, s.num_computed);
            }
        }
    }

    /// Whether `id` runs and has exactly one token to compute: it decodes next step.
    pub fn is_decoding(&self, id: SeqId) -> bool {
        self.seqs.get(&id).is_some_and(|s| s.running && s.tokens.len() == s.num_computed + 1)
    }

    /// How many of `want` draft tokens `id`'s next decode step could verify (its limits, as for
    /// [`Scheduler::set_draft`]), with blocks for them taken now: a draft model writes them into
    /// the cache as it proposes. 0 when the pool is short.
    pub fn reserve_draft(&mut self, id: SeqId, want: usize) -> usize {
        let Some(s) = self.seqs.get(&id) else { return 0 };
        let room = self.room_for(s, want);
        let end = s.tokens.len() + room;
        if room == 0 || !self.kv.allocate(id, end) {
            return 0;
        }
        room
    }

    /// Tokens to verify with `id`'s next decode step (replacing any earlier draft).
    pub fn set_draft(&mut self, id: SeqId, draft: Vec<u32>) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.draft = draft;
        }
    }

    /// The first `accepted` draft tokens of `id`'s last step were accepted (and appended, with
    /// the target's token after them): they are computed; the cache past them is rolled back.
    pub fn accept_draft(&mut self, id: SeqId, accepted: usize) -> Result<(), String> {
        let Some(s) = self.seqs.get_mut(&id) else { return Ok(()) };
        s.num_computed += accepted;
        if s.num_computed >= s.tokens.len() {
            return Err(format!(
                "sequence {id}: {accepted} accepted draft tokens exceed its {} tokens",
                s.tokens.len()
            ));
        }
        self.kv.commit(id, &s.tokens, s.num_computed);
        // Keep the blocks the next token needs; the rejected tail's go back to the pool. The
        // partial block a draft wrote into is this sequence's own (only full blocks are
        // shared), so the rollback never has to copy one.
        match self.kv.truncate(id, s.tokens.len()) {
            Some(copies) if copies.is_empty() => Ok(()),
            _ => Err(format!("sequence {id}: rolling back a draft would have to copy a shared block")),
        }
    }

    /// A token was sampled for `id`; it is computed in a later step.
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens.push(token);
        }
    }

    /// Remove `id` (finished or aborted) and free its blocks at once.
    pub fn finish(&mut self, id: SeqId) {
        if self.seqs.remove(&id).is_some() {
            self.kv.free(id);
            self.running.retain(|&r| r != id);
            self.waiting.retain(|&w| w != id);
        }
    }

    /// Block-pool, table and queue invariants (run every step in debug builds and tests).
    pub fn check(&self) -> Result<(), String> {
        self.kv.check()?;
        for &id in &self.running {
            let s = self.seqs.get(&id).ok_or(format!("running sequence {id} is unknown"))?;
            if self.kv.blocks(id).len() < self.kv.blocks_for(s.num_computed) {
                return Err(format!("sequence {id} computed {} tokens without blocks for them", s.num_computed));
            }
        }
        if self.running.len() + self.waiting.len() != self.seqs.len() {
            return Err(format!(
                "{} running + {} waiting != {} sequences",
                self.running.len(),
                self.waiting.len(),
                self.seqs.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(budget: usize, blocks: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 8,
            max_model_len: 1000,
            block_size: 4,
            num_blocks: blocks,
            enable_prefix_caching: false,
            quantize_full_blocks: false,
        }
    }

    fn spec(id: SeqId, len: usize, max_tokens: usize) -> SeqSpec {
        SeqSpec { id, prompt: (0..len as u32).map(|t| t + 100 * id as u32).collect(), max_tokens, ..Default::default() }
    }

    /// Marks the plan computed and appends a token to every chunk that samples.
    fn finish_step(s: &mut Scheduler, plan: &StepPlan) {
        s.on_step_done(plan);
        for c in plan.chunks.iter().filter(|c| c.sample) {
            s.append_token(c.seq, 7);
        }
        s.check().unwrap();
    }

    fn shape(plan: &StepPlan) -> Vec<(SeqId, usize, usize, bool)> {
        plan.chunks.iter().map(|c| (c.seq, c.context_len, c.tokens.len(), c.sample)).collect()
    }

    #[test]
    fn budget_chunked_prefill_and_decodes_first() {
        let mut s = Scheduler::new(cfg(10, 100));
        s.add(spec(1, 25, 5)).unwrap();
        s.add(spec(2, 3, 5)).unwrap();
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 0, 10, false)], "the long prompt takes the whole budget");
        finish_step(&mut s, &p);
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 10, 10, false)], "a running prefill goes before admissions");
        finish_step(&mut s, &p);
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 20, 5, true), (2, 0, 3, true)]);
        assert_eq!(p.num_tokens, 8);
        finish_step(&mut s, &p);
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 25, 1, true), (2, 3, 1, true)], "then one decode token each");
        assert_eq!(p.chunks[0].tokens, vec![7]);
        assert!(p.chunks.iter().all(|c| c.blocks.len() * 4 >= c.context_len + c.tokens.len()));
    }

    #[test]
    fn newest_is_preempted_and_requeued_first() {
        let mut s = Scheduler::new(cfg(100, 4));
        s.add(spec(1, 8, 8)).unwrap();
        s.add(spec(2, 8, 8)).unwrap();
        s.add(spec(3, 2, 2)).unwrap();
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 0, 8, true), (2, 0, 8, true)], "3 waits: no blocks left");
        finish_step(&mut s, &p);
        // Both need a third block; only the oldest gets it, the newest is preempted.
        let p = s.schedule();
        assert_eq!(p.preempted, vec![2]);
        assert_eq!(p.freed_blocks.len(), 2, "the victim's two blocks");
        assert_eq!(shape(&p), vec![(1, 8, 1, true)]);
        assert_eq!(s.stats.preemptions, 1);
        assert_eq!(s.waiting.front(), Some(&2), "preempted goes to the front");
        finish_step(&mut s, &p);
        s.finish(1);
        // Recompute: prompt plus the token generated before preemption.
        let p = s.schedule();
        assert_eq!(shape(&p)[0], (2, 0, 9, true));
        assert_eq!(p.chunks[0].tokens.last(), Some(&7));
    }

    #[test]
    fn max_num_seqs_limits_admission() {
        let mut s = Scheduler::new(SchedulerConfig { max_num_seqs: 2, ..cfg(100, 100) });
        for id in 0..3 {
            s.add(spec(id, 2, 2)).unwrap();
        }
        let p = s.schedule();
        assert_eq!(p.chunks.len(), 2);
        assert_eq!(s.num_waiting(), 1);
    }

    #[test]
    fn admission_refuses_what_can_never_fit() {
        let s = Scheduler::new(cfg(100, 4));
        assert!(matches!(s.check_admissible(0, 1), Err(AdmissionError::EmptyPrompt)));
        assert!(matches!(s.check_admissible(990, 20), Err(AdmissionError::ContextLength { total: 1010, .. })));
        assert!(matches!(s.check_admissible(10, 7), Err(AdmissionError::PoolTooSmall { needed: 5, .. })));
        assert!(s.check_admissible(10, 6).is_ok());
        let mut s = s;
        s.add(spec(1, 2, 2)).unwrap();
        assert!(matches!(s.add(spec(1, 2, 2)), Err(AdmissionError::Duplicate(1))));
    }

    #[test]
    fn drafts_ride_decodes_within_limits_and_roll_back() {
        let mut s = Scheduler::new(cfg(100, 100));
        s.add(spec(1, 6, 6)).unwrap();
        let p = s.schedule();
        finish_step(&mut s, &p);
        assert!(s.is_decoding(1));
        // max_tokens 6, one generated: a verification may yield 5 more, so 4 draft tokens.
        s.set_draft(1, vec![11, 12, 13, 14, 15, 16]);
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 6, 5, true)]);
        assert_eq!((p.chunks[0].draft, &p.chunks[0].tokens[1..]), (4, &[11, 12, 13, 14][..]));
        assert_eq!(p.chunks[0].blocks.len(), 3, "blocks for positions up to 10");
        s.on_step_done(&p);
        assert_eq!(s.seqs[&1].num_computed, 7, "only the pending token counts as computed");
        // Two accepted, then the target's own token.
        for t in [11, 12, 40] {
            s.append_token(1, t);
        }
        s.accept_draft(1, 2).unwrap();
        assert_eq!(s.seqs[&1].num_computed, 9);
        assert_eq!(s.kv().blocks(1).len(), 3, "blocks for the 10 tokens");
        s.check().unwrap();
        // 4 of 6 generated: a verification may yield 2 more, so one draft token of three.
        s.set_draft(1, vec![50, 51, 52]);
        let p = s.schedule();
        assert_eq!((p.chunks[0].draft, p.chunks[0].tokens.len()), (1, 2));

        // A quantizing cache: drafts stop short of filling the block they start in.
        let mut s = Scheduler::new(SchedulerConfig { quantize_full_blocks: true, ..cfg(100, 100) });
        s.add(spec(2, 5, 50)).unwrap();
        let p = s.schedule();
        finish_step(&mut s, &p);
        s.set_draft(2, vec![1; 8]);
        let p = s.schedule();
        // Pending token at 5, drafts from 6: position 7 would fill block 1, so one draft only.
        assert_eq!(p.chunks[0].draft, 1);
        // And the token budget counts drafts.
        let mut s = Scheduler::new(cfg(3, 100));
        s.add(spec(3, 2, 50)).unwrap();
        let p = s.schedule();
        finish_step(&mut s, &p);
        s.set_draft(3, vec![1; 8]);
        assert_eq!(s.schedule().chunks[0].draft, 2);
    }

    #[test]
    fn prefix_hit_skips_cached_blocks_and_siblings_wait_for_the_leader() {
        let mut s = Scheduler::new(SchedulerConfig { enable_prefix_caching: true, ..cfg(6, 100) });
        s.add(spec(1, 10, 4)).unwrap();
        s.add(SeqSpec { id: 2, after: Some(1), ..spec(1, 10, 4) }).unwrap();
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 0, 6, false)], "the sibling waits for the leader's prompt");
        finish_step(&mut s, &p);
        let p = s.schedule();
        assert_eq!(shape(&p), vec![(1, 6, 4, true)]);
        finish_step(&mut s, &p);
        let p = s.schedule();
        // The sibling starts after the leader's two full blocks (8 tokens).
        assert_eq!(shape(&p), vec![(1, 10, 1, true), (2, 8, 2, true)]);
        assert_eq!(s.cached_prompt_tokens(2), 8);
        assert_eq!(p.chunks[1].blocks[..2], p.chunks[0].blocks[..2]);
    }

    /// Each kind of chunk names its logit rows and where its sampled rows start.
    #[test]
    fn chunks_name_their_logit_rows() {
        let chunk = |n: usize, sample, prompt_logprobs, draft| ScheduledChunk {
            seq: 0,
            context_len: 0,
            tokens: vec![1; n],
            blocks: Vec::new(),
            sample,
            prompt_logprobs,
            draft,
            pooling: None,
        };
        let rows = |c: &ScheduledChunk| (c.logits(), c.num_logit_rows(), c.first_sampled_row());
        assert_eq!(rows(&chunk(6, false, false, 0)), (LogitsRows::None, 0, None), "mid-prompt");
        assert_eq!(rows(&chunk(6, true, false, 0)), (LogitsRows::Last, 1, Some(0)), "ends the prompt");
        assert_eq!(rows(&chunk(1, true, false, 0)), (LogitsRows::Last, 1, Some(0)), "decode");
        assert_eq!(rows(&chunk(6, false, true, 0)), (LogitsRows::All, 6, None), "prompt logprobs");
        assert_eq!(rows(&chunk(6, true, true, 0)), (LogitsRows::All, 6, Some(5)), "prompt logprobs, last chunk");
        assert_eq!(rows(&chunk(4, true, false, 3)), (LogitsRows::All, 4, Some(0)), "pending token and a draft");
        // Embeddings: hidden rows by pooling type, no logits, nothing sampled.
        for (p, mid, last) in [
            (PoolingType::Last, LogitsRows::None, LogitsRows::Last),
            (PoolingType::Mean, LogitsRows::All, LogitsRows::All),
        ] {
            let c = ScheduledChunk { pooling: Some(p), ..chunk(6, false, false, 0) };
            assert_eq!((rows(&c), c.hidden()), ((LogitsRows::None, 0, None), mid), "{p:?} mid-prompt");
            let c = ScheduledChunk { pooling: Some(p), ..chunk(6, true, false, 0) };
            assert_eq!((rows(&c), c.hidden()), ((LogitsRows::None, 0, None), last), "{p:?} ends the prompt");
        }
        let c = ScheduledChunk { pooling: Some(PoolingType::Cls), context_len: 6, ..chunk(6, true, false, 0) };
        assert_eq!(c.hidden(), LogitsRows::None, "CLS takes the first chunk's first row only");
    }
}
