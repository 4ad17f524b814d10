//! The engine core: one synchronous step = schedule → run the model → sample → detokenize →
//! check stops → send events. Owns the scheduler, the per-sample state (sampler, detokenizer,
//! stop matcher) and each request's event sink. The threaded, async-facing [`crate::engine`]
//! drives it; tests drive it directly with a fake runner.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::detokenizer::IncrementalDecoder;
use crate::kv_manager::SeqId;
use crate::request::{EngineEvent, FinishReason, Finished, Request, RequestParams, SampleOutput, StopMatch};
use crate::runner::{DraftRequest, ModelRunner, StepLogits};
use crate::sampler::{token_logprobs, Sampler, TokenLogprobs};
use crate::scheduler::{Scheduler, SchedulerConfig, SeqSpec, StepPlan};
use crate::speculative::{Drafter, SpecCounters, SpecMethod, SpeculativeConfig};
use crate::stop::StopStrings;
use crate::structured::{GrammarState, MaskHistogram};
use crate::tokenizer::Tokenizer;
use crate::EngineError;

/// Receives a request's events; returns `false` once nobody listens (the request is aborted).
pub type EventSink = Box<dyn FnMut(EngineEvent) -> bool + Send>;

/// What validation needs to know about the model and the pool.
#[derive(Debug, Clone, Default)]
pub struct ModelInfo {
    /// Rows of the model's logits (the padded vocabulary).
    pub vocab_size: usize,
    /// Ids that may be sampled (the tokenizer's).
    pub valid_vocab: usize,
    pub eos_token_ids: Vec<u32>,
}

/// Identifies one submitted request inside the engine (request ids come from clients and need
/// not be unique; aborting by handle can never hit someone else's request).
pub type Handle = u64;

/// Rows (decode tokens plus draft tokens) up to which a step stays cheap enough for drafts.
/// Every row costs its share of compute, most of it the vocabulary projection (152k × hidden);
/// on a 2-core CPU a row costs about a fifth of a one-row step of qwen2.5-0.5b, so at 16
/// sequences the step is compute-bound and verifying drafts there measured 0.96× of plain
/// decoding even at 97% acceptance (docs/benchmarks.md, "Speculative decoding").
pub const SPEC_STEP_ROWS: usize = 16;

/// Handles `add` assigns itself start here, apart from those the threaded engine assigns.
const OWN_HANDLES: Handle = 1 << 63;

struct Group {
    request_id: String,
    added: Instant,
    sink: EventSink,
    prompt_len: usize,
    live: usize,
    prompt_logprobs: Option<(usize, Vec<Option<TokenLogprobs>>)>,
    prompt_logprobs_sent: bool,
}

struct Sample {
    group: Handle,
    index: usize,
    params: Arc<RequestParams>,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    stops: StopStrings,
    stop_ids: Vec<u32>,
    generated: usize,
    /// When the scheduler first gave this sample a chunk; taken by its first event.
    scheduled: Option<Instant>,
    queue_reported: bool,
    /// Proposes this sample's drafts when speculative decoding is on.
    drafter: Option<Drafter>,
    /// The sample's walk through its request's grammar (structured outputs).
    grammar: Option<GrammarState>,
}

/// What one sample's rows of a step produced: its new tokens (with logprobs) and how many draft
/// tokens were proposed and accepted.
struct Drawn {
    tokens: Vec<(u32, Vec<TokenLogprobs>)>,
    proposed: usize,
    accepted: usize,
    /// The grammar is complete after the last token: the sample ends there.
    grammar_done: bool,
    /// The grammar failed (nothing it allows, or a token it refuses): the request ends.
    grammar_error: Option<String>,
    masks: MaskHistogram,
}

/// Counters since start, for logs and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CoreCounters {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub steps: u64,
    pub failed_steps: u64,
}

pub struct EngineCore<R: ModelRunner> {
    runner: R,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    info: ModelInfo,
    groups: HashMap<Handle, Group>,
    next_handle: Handle,
    samples: HashMap<SeqId, Sample>,
    next_seq: SeqId,
    pub counters: CoreCounters,
    /// Check every pool and scheduler invariant after each step (debug builds and tests).
    pub check_invariants: bool,
    speculative: Option<SpeculativeConfig>,
    /// Speculative decoding's acceptance since start.
    pub spec_counters: SpecCounters,
    /// Time spent computing grammar masks since start.
    pub mask_times: MaskHistogram,
}

impl<R: ModelRunner> EngineCore<R> {
    pub fn new(runner: R, sched: SchedulerConfig, tokenizer: Arc<Tokenizer>, info: ModelInfo) -> Self {
        Self {
            runner,
            scheduler: Scheduler::new(sched),
            tokenizer,
            info,
            groups: HashMap::new(),
            next_handle: OWN_HANDLES,
            samples: HashMap::new(),
            next_seq: 0,
            counters: CoreCounters::default(),
            check_invariants: cfg!(debug_assertions),
            speculative: None,
            spec_counters: SpecCounters::default(),
            mask_times: MaskHistogram::default(),
        }
    }

    /// Turn speculative decoding on for the requests added from now on (before the first).
    pub fn set_speculative(&mut self, cfg: Option<SpeculativeConfig>) {
        self.speculative = cfg;
    }

    pub fn speculative(&self) -> Option<&SpeculativeConfig> {
        self.speculative.as_ref()
    }

    pub fn runner_mut(&mut self) -> &mut R {
        &mut self.runner
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    pub fn num_requests(&self) -> usize {
        self.groups.len()
    }

    /// Queue `req`; its events go to `sink`. Invalid requests are refused here, nothing queued.
    pub fn add(&mut self, req: Request, sink: EventSink) -> Result<Handle, EngineError> {
        let handle = self.next_handle;
        self.next_handle += 1;
        self.add_with_handle(handle, req, sink)?;
        Ok(handle)
    }

    /// [`add`](Self::add) under a handle the caller chose (unique, below `1 << 63`).
    pub fn add_with_handle(&mut self, handle: Handle, req: Request, sink: EventSink) -> Result<(), EngineError> {
        crate::validation::validate(&req, &self.info, self.scheduler.config())?;
        self.add_validated(handle, req, sink)
    }

    /// [`add_with_handle`](Self::add_with_handle) for a request the caller validated against this
    /// engine already ([`Engine::submit`](crate::Engine::submit) does, on the caller's thread).
    pub(crate) fn add_validated(&mut self, handle: Handle, req: Request, sink: EventSink) -> Result<(), EngineError> {
        if self.groups.contains_key(&handle) {
            return Err(EngineError::Internal(format!("request handle {handle} is already in use")));
        }
        let params = Arc::new(req.params);
        let mut leader = None;
        for index in 0..params.n {
            let seq = self.next_seq;
            self.next_seq += 1;
            let mut sampling = params.sampling.clone();
            // Each sample draws its own stream; a seed still makes the whole request reproducible.
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(index as u64));
            let mut sampler = Sampler::new(sampling, self.info.valid_vocab);
            sampler.set_prompt(&req.prompt);
            let mut stop_ids: Vec<u32> = if params.ignore_eos { Vec::new() } else { self.info.eos_token_ids.clone() };
            stop_ids.extend(params.stop_token_ids.iter().copied());
            let grammar = match &params.structured {
                Some(so) => Some(GrammarState::new(&so.grammar, so.after.as_deref()).map_err(EngineError::Internal)?),
                None => None,
            };
            let spec = SeqSpec {
                id: seq,
                prompt: req.prompt.clone(),
                max_tokens: params.max_tokens,
                cache_salt: params.cache_salt.clone(),
                prompt_logprobs: index == 0 && params.prompt_logprobs.is_some(),
                after: leader,
            };
            self.scheduler.add(spec)?;
            leader.get_or_insert(seq);
            self.samples.insert(
                seq,
                Sample {
                    group: handle,
                    index,
                    params: params.clone(),
                    sampler,
                    decoder: IncrementalDecoder::new(params.skip_special_tokens),
                    stops: StopStrings::new(params.stop.clone(), params.include_stop_str_in_output),
                    stop_ids,
                    generated: 0,
                    scheduled: None,
                    queue_reported: false,
                    drafter: self.speculative.as_ref().map(Drafter::new),
                    grammar,
                },
            );
        }
        self.counters.prompt_tokens += req.prompt.len() as u64;
        let prompt_logprobs = params.prompt_logprobs.map(|k| (k, vec![None; req.prompt.len()]));
        self.groups.insert(
            handle,
            Group {
                request_id: req.id,
                added: Instant::now(),
                sink,
                prompt_len: req.prompt.len(),
                live: params.n,
                prompt_logprobs,
                prompt_logprobs_sent: false,
            },
        );
        Ok(())
    }

    /// Stop every request with client id `id` now and free its blocks; each stream gets a final
    /// `abort` event.
    pub fn abort(&mut self, id: &str) {
        let handles: Vec<Handle> = self.groups.iter().filter(|(_, g)| g.request_id == id).map(|(&h, _)| h).collect();
        for h in handles {
            self.abort_handle(h);
        }
    }

    /// Stop the request submitted under `handle` (a no-op once it is over).
    pub fn abort_handle(&mut self, handle: Handle) {
        for seq in self.group_seqs(handle) {
            self.end_sample(seq, Finished { reason: FinishReason::Abort, stop: None }, String::new());
        }
    }

    /// Run one step. Returns the plan that ran (empty when there was nothing to do).
    pub fn step(&mut self) -> StepPlan {
        // Scopes for `--trace-dir`; unrecorded they cost a cached check each.
        let _step = tracing::trace_span!("engine_step").entered();
        let plan = tracing::trace_span!("schedule").in_scope(|| self.scheduler.schedule());
        if !plan.freed_blocks.is_empty() {
            self.runner.release(&plan.freed_blocks);
        }
        if plan.chunks.is_empty() {
            return plan;
        }
        self.counters.steps += 1;
        let now = Instant::now();
        for c in &plan.chunks {
            if let Some(s) = self.samples.get_mut(&c.seq) {
                s.scheduled.get_or_insert(now);
            }
        }
        let forward = tracing::trace_span!("forward", sequences = plan.chunks.len());
        let result = forward
            .in_scope(|| catch_unwind(AssertUnwindSafe(|| self.runner.execute(&plan))))
            .unwrap_or_else(|_| Err(EngineError::Internal("the model runner panicked".into())));
        match result {
            Ok(logits) if logits.num_rows() == expected_rows(&plan) => {
                self.scheduler.on_step_done(&plan);
                tracing::trace_span!("sample").in_scope(|| self.process(&plan, &logits));
                tracing::trace_span!("propose").in_scope(|| self.propose());
            }
            Ok(logits) => self.fail_step(
                &plan,
                &format!(
                    "the model returned {} logit rows, the plan needs {}",
                    logits.num_rows(),
                    expected_rows(&plan)
                ),
            ),
            Err(e) => self.fail_step(&plan, &e.to_string()),
        }
        if self.check_invariants {
            if let Err(e) = self.scheduler.check() {
                panic!("engine invariant violated after a step: {e}");
            }
        }
        plan
    }

    /// A step failed: end every request it touched with an error; the others carry on.
    fn fail_step(&mut self, plan: &StepPlan, message: &str) {
        self.counters.failed_steps += 1;
        let mut groups: Vec<Handle> =
            plan.chunks.iter().filter_map(|c| self.samples.get(&c.seq).map(|s| s.group)).collect();
        groups.sort_unstable();
        groups.dedup();
        for g in groups {
            self.fail_group(g, message);
        }
    }

    fn fail_group(&mut self, group: Handle, message: &str) {
        if let Some(mut g) = self.drop_group(group) {
            (g.sink)(EngineEvent::Error(format!("request failed: {message}")));
        }
    }

    /// The samples of request `group`, in sample order.
    fn group_seqs(&self, group: Handle) -> Vec<SeqId> {
        let mut seqs: Vec<SeqId> = self.samples.iter().filter(|(_, s)| s.group == group).map(|(&q, _)| q).collect();
        seqs.sort_unstable();
        seqs
    }

    /// Remove request `group` and all its samples, freeing their blocks; no event is sent.
    fn drop_group(&mut self, group: Handle) -> Option<Group> {
        for seq in self.group_seqs(group) {
            self.samples.remove(&seq);
            self.scheduler.finish(seq);
        }
        self.groups.remove(&group)
    }

    fn process(&mut self, plan: &StepPlan, logits: &StepLogits) {
        let mut row = 0;
        let mut picks = Vec::new();
        for chunk in &plan.chunks {
            let first_row = row;
            row += chunk.num_logit_rows();
            if self.samples.get(&chunk.seq).is_some_and(|s| s.params.max_tokens == 0) {
                // Prompt scoring (max_tokens 0): the prompt is in, nothing is drawn.
                continue;
            }
            if let Some(first) = chunk.first_sampled_row() {
                picks.push((chunk.seq, first_row + first, chunk.tokens[chunk.tokens.len() - chunk.draft..].to_vec()));
            }
        }
        let mut drawn = self.draw(&picks, logits);
        let mut row = 0;
        for chunk in &plan.chunks {
            let rows = chunk.num_logit_rows();
            let first_row = row;
            row += rows;
            if chunk.prompt_logprobs {
                self.collect_prompt_logprobs(chunk.seq, chunk.context_len, first_row, rows, logits);
            }
            if chunk.sample {
                if let Some(d) = drawn.remove(&chunk.seq) {
                    self.take_drawn(chunk.seq, d);
                } else if self.samples.get(&chunk.seq).is_some_and(|s| s.params.max_tokens == 0) {
                    self.end_sample(chunk.seq, Finished { reason: FinishReason::Length, stop: None }, String::new());
                }
            }
        }
    }

    /// Emit a sample's new tokens in order, stopping where it finishes; after a verification,
    /// keep the accepted draft tokens in the cache and roll back the rest.
    fn take_drawn(&mut self, seq: SeqId, d: Drawn) {
        self.mask_times.merge(&d.masks);
        if let Some(e) = d.grammar_error {
            if let Some(g) = self.samples.get(&seq).map(|s| s.group) {
                self.fail_group(g, &e);
            }
            return;
        }
        if d.proposed > 0 {
            self.spec_counters.record(d.proposed, d.accepted);
            if let Some(dr) = self.samples.get_mut(&seq).and_then(|s| s.drafter.as_mut()) {
                dr.observe(d.proposed, d.accepted);
            }
        }
        let emitted = d.tokens.len();
        for (i, (tok, lp)) in d.tokens.into_iter().enumerate() {
            self.sample_next(seq, tok, lp, d.grammar_done && i + 1 == emitted);
            if !self.samples.contains_key(&seq) {
                return;
            }
        }
        if d.proposed > 0 {
            // Still running: the last token is the target's own, the ones before it accepted drafts.
            if let Err(e) = self.scheduler.accept_draft(seq, emitted - 1) {
                if let Some(g) = self.samples.get(&seq).map(|s| s.group) {
                    self.fail_group(g, &format!("internal error: {e}"));
                }
            }
        }
    }

    /// Propose drafts for every sample that decodes next step (speculative decoding), unless
    /// more sequences run than `disable_by_batch_size` allows. Each sample's draft is also held
    /// to its share of [`SPEC_STEP_ROWS`]: verification rows are worth their compute only
    /// while a step is bound by reading the weights.
    fn propose(&mut self) {
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

    /// Draw the next token (and its logprobs, if asked) of every `(seq, logits row, draft)` at
    /// once, spread over the kernel threads: each sample's sampler is its own state (its own
    /// seeded generator), so the draws do not depend on which thread makes them or in what
    /// order. With a draft, rows `row..=row + draft.len()` verify it token by token.
    fn draw(&mut self, picks: &[(SeqId, usize, Vec<u32>)], logits: &StepLogits) -> HashMap<SeqId, Drawn> {
        type Slot<'a> = Mutex<(SeqId, &'a mut Sample, usize, &'a [u32], Option<Drawn>)>;
        let rows: HashMap<SeqId, (usize, &[u32])> = picks.iter().map(|(q, r, d)| (*q, (*r, &d[..]))).collect();
        let valid_vocab = self.info.valid_vocab;
        let work: Vec<Slot> = self
            .samples
            .iter_mut()
            .filter_map(|(&seq, s)| rows.get(&seq).map(|&(r, d)| Mutex::new((seq, s, r, d, None))))
            .collect();
        flint_model::kernels::pool::run(work.len(), |i| {
            let mut slot = work[i].lock().unwrap_or_else(|e| e.into_inner());
            let (_, s, r, draft, out) = &mut *slot;
            *out = Some(draw_rows(s, logits, *r, draft, valid_vocab));
        });
        work.into_iter()
            .filter_map(|m| {
                let (seq, _, _, _, out) = m.into_inner().unwrap_or_else(|e| e.into_inner());
                out.map(|o| (seq, o))
            })
            .collect()
    }

    fn collect_prompt_logprobs(&mut self, seq: SeqId, ctx: usize, first_row: usize, rows: usize, logits: &StepLogits) {
        let Some(s) = self.samples.get(&seq) else { return };
        let prompt = self.scheduler.tokens(seq);
        let Some(g) = self.groups.get_mut(&s.group) else { return };
        let Some((k, slots)) = g.prompt_logprobs.as_mut() else { return };
        for r in 0..rows {
            // Row r (position ctx + r) predicts the prompt token at ctx + r + 1.
            let pos = ctx + r + 1;
            if pos < g.prompt_len && slots[pos].is_none() {
                slots[pos] = Some(token_logprobs(logits.row(first_row + r), self.info.valid_vocab, prompt[pos], *k));
            }
        }
    }

    /// Record the drawn token `tok` of `seq`: detokenize, match stops, emit, finish
    /// (`grammar_done`: the token completed the sample's grammar, so nothing may follow).
    fn sample_next(&mut self, seq: SeqId, tok: u32, logprobs: Vec<TokenLogprobs>, grammar_done: bool) {
        let Some(s) = self.samples.get_mut(&seq) else { return };
        s.generated += 1;
        self.counters.generation_tokens += 1;
        self.scheduler.append_token(seq, tok);
        let total_len = self.scheduler.tokens(seq).len();
        let mut text = String::new();
        let mut finished = None;
        if s.stop_ids.contains(&tok) {
            finished = Some(Finished { reason: FinishReason::Stop, stop: Some(StopMatch::Token(tok)) });
        } else {
            let piece = match s.decoder.push(&self.tokenizer, tok) {
                Ok(p) => p,
                Err(e) => {
                    let group = s.group;
                    self.fail_group(group, &e.to_string());
                    return;
                }
            };
            if s.generated < s.params.min_tokens {
                // As vLLM: stop strings only count once min_tokens are out; earlier text passes.
                text = s.stops.pass_through(&piece);
            } else {
                let out = s.stops.push(&piece);
                text = out.released;
                if let Some(m) = out.matched {
                    finished = Some(Finished { reason: FinishReason::Stop, stop: Some(StopMatch::Text(m)) });
                }
            }
        }
        if finished.is_none() && grammar_done {
            finished = Some(Finished { reason: FinishReason::Stop, stop: None });
        }
        let at_limit = s.generated >= s.params.max_tokens || total_len >= self.scheduler.config().max_model_len;
        if finished.is_none() && at_limit {
            finished = Some(Finished { reason: FinishReason::Length, stop: None });
        }
        let output_ids = vec![tok];
        match finished {
            Some(mut f) => {
                if !matches!(f.stop, Some(StopMatch::Text(_))) {
                    let (tail, matched) = self.flush(seq);
                    text.push_str(&tail);
                    if let Some(m) = matched {
                        // The flushed tail completed a stop string: that is why it ended.
                        f = Finished { reason: FinishReason::Stop, stop: Some(StopMatch::Text(m)) };
                    }
                }
                self.emit(seq, text, output_ids, logprobs, Some(f));
                self.remove_sample(seq);
            }
            None => self.emit(seq, text, output_ids, logprobs, None),
        }
    }

    /// Text still held by the detokenizer and the stop matcher, at a finish without a stop string,
    /// and the stop string that text completes, if any.
    fn flush(&mut self, seq: SeqId) -> (String, Option<String>) {
        let Some(s) = self.samples.get_mut(&seq) else { return (String::new(), None) };
        let rest = s.decoder.flush(&self.tokenizer).unwrap_or_default();
        let out = s.stops.push(&rest);
        let mut text = out.released;
        if out.matched.is_none() {
            text.push_str(&s.stops.flush());
        }
        (text, out.matched)
    }

    fn end_sample(&mut self, seq: SeqId, f: Finished, text: String) {
        self.emit(seq, text, Vec::new(), Vec::new(), Some(f));
        self.remove_sample(seq);
    }

    fn remove_sample(&mut self, seq: SeqId) {
        self.scheduler.finish(seq);
        if let Some(s) = self.samples.remove(&seq) {
            if let Some(g) = self.groups.get_mut(&s.group) {
                g.live = g.live.saturating_sub(1);
                if g.live == 0 {
                    self.groups.remove(&s.group);
                }
            }
        }
    }

    fn emit(
        &mut self,
        seq: SeqId,
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
        finished: Option<Finished>,
    ) {
        let Some(s) = self.samples.get_mut(&seq) else { return };
        let cached_tokens = self.scheduler.cached_prompt_tokens(seq);
        let Some(g) = self.groups.get_mut(&s.group) else { return };
        let queue_secs = match (s.queue_reported, s.scheduled) {
            (false, Some(t)) => {
                s.queue_reported = true;
                Some(t.duration_since(g.added).as_secs_f64())
            }
            _ => None,
        };
        let prompt_logprobs = if s.index == 0 && !g.prompt_logprobs_sent && g.prompt_logprobs.is_some() {
            g.prompt_logprobs_sent = true;
            g.prompt_logprobs.as_ref().map(|(_, v)| v.clone())
        } else {
            None
        };
        let out = SampleOutput {
            index: s.index,
            text,
            token_ids,
            logprobs,
            finished,
            completion_tokens: s.generated,
            prompt_tokens: g.prompt_len,
            cached_tokens,
            prompt_logprobs,
            queue_secs,
        };
        if !(g.sink)(EngineEvent::Output(out)) {
            // The client is gone: stop its request and free its blocks now.
            let group = s.group;
            self.drop_group(group);
        }
    }
}

fn expected_rows(plan: &StepPlan) -> usize {
    plan.chunks.iter().map(|c| c.num_logit_rows()).sum()
}

/// One sample's tokens from its rows: a plain draw from `first`, or with a draft, the pending
/// token's row and then one row per draft token, each verifying the next proposal, until one is
/// rejected (the target's token replaces it) or all pass (the last row adds the target's next
/// token). Penalties and `min_tokens` see each token before the next row is read, as they would
/// one step at a time.
fn draw_rows(s: &mut Sample, logits: &StepLogits, first: usize, draft: &[u32], valid_vocab: usize) -> Drawn {
    let mut d = Drawn {
        tokens: Vec::with_capacity(draft.len() + 1),
        proposed: draft.len(),
        accepted: 0,
        grammar_done: false,
        grammar_error: None,
        masks: MaskHistogram::default(),
    };
    for i in 0..=draft.len() {
        let row = logits.row(first + i);
        let generated = s.generated + i;
        let mut banned: &[u32] = if generated < s.params.min_tokens { &s.stop_ids } else { &[] };
        // The grammar's time for this token: its mask and then taking the token.
        let mut grammar_secs = None;
        if let Some(g) = s.grammar.as_mut().filter(|g| g.is_active()) {
            let t = Instant::now();
            // The mask is written straight into the sampler's buffer.
            let stop_ids = &s.stop_ids;
            let r = s.sampler.set_allowed_with(|words| g.mask(stop_ids, words));
            grammar_secs = Some(t.elapsed().as_secs_f64());
            if let Err(e) = r {
                d.grammar_error = Some(e);
                return d;
            }
            // min_tokens holds the stop ids back unless the grammar allows nothing else.
            if !banned.is_empty() && !allows_other_than(s.sampler.allowed().unwrap_or_default(), banned) {
                banned = &[];
            }
        } else {
            s.sampler.set_allowed(None);
        }
        let (tok, ok) = match draft.get(i) {
            Some(&d) => s.sampler.verify(row, banned, d),
            None => (s.sampler.sample(row, banned), false),
        };
        s.sampler.record(tok);
        let lp = s.params.logprobs.map(|k| token_logprobs(row, valid_vocab, tok, k)).into_iter().collect();
        d.tokens.push((tok, lp));
        d.accepted += usize::from(ok);
        if let Some(g) = s.grammar.as_mut() {
            let t = Instant::now();
            let r = g.advance(tok, &s.stop_ids);
            if let Some(secs) = grammar_secs {
                d.masks.observe(secs + t.elapsed().as_secs_f64());
            }
            if let Err(e) = r {
                d.grammar_error = Some(e);
                return d;
            }
            d.grammar_done = g.is_finished();
        }
        // A rejection ends the draft; so does a stop id or a complete grammar, which end the sample.
        if !ok || s.stop_ids.contains(&tok) || d.grammar_done {
            break;
        }
    }
    d
}

/// Whether bitset `mask` allows some id not in `ids`.
fn allows_other_than(mask: &[u32], ids: &[u32]) -> bool {
    mask.iter().enumerate().any(|(i, &w)| {
        let listed = ids.iter().filter(|&&id| id as usize / 32 == i).fold(0u32, |m, &id| m | 1 << (id % 32));
        w & !listed != 0
    })
}
