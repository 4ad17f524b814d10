//! The engine core: one synchronous step = schedule → run the model → sample → detokenize →
//! check stops → send events. Owns the scheduler, the per-sample state (sampler, detokenizer,
//! stop matcher) and each request's event sink. The threaded, async-facing [`crate::engine`]
//! drives it; tests drive it directly with a fake runner.
//!
//! The step's work is split by concept, one module each: `requests` takes requests in and ends
//! them (abort, failure, finish), `draws` turns a step's logit rows into each sample's tokens,
//! `outputs` turns a drawn token into its client's event (detokenizer, stops, limits) and
//! `propose` prepares the next step's drafts for speculative decoding. This file holds the state
//! they share and the step that runs them in order.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use crate::detokenizer::IncrementalDecoder;
use crate::kv_manager::SeqId;
use crate::pooling::Pooler;
use crate::request::{EngineEvent, RequestParams};
use crate::runner::ModelRunner;
use crate::sampler::{Sampler, TokenLogprobs};
use crate::scheduler::{Scheduler, SchedulerConfig, StepPlan};
use crate::speculative::{Drafter, SpecCounters, SpeculativeConfig};
use crate::stop::StopStrings;
use crate::structured::{GrammarState, MaskHistogram};
use crate::tokenizer::Tokenizer;
use crate::EngineError;

mod draws;
mod outputs;
mod propose;
mod requests;

pub use propose::SPEC_STEP_ROWS;

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
    /// An embedding request's pooled hidden states so far.
    pooler: Option<Pooler>,
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
}

fn expected_rows(plan: &StepPlan) -> usize {
    plan.chunks.iter().map(|c| c.num_logit_rows()).sum()
}
