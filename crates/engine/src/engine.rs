//! The engine as the server and the benchmarks see it: a step loop on its own thread, fed by a
//! command channel; each submitted request gets an async stream of [`EngineEvent`]s. Dropping
//! the stream before it finishes aborts the request, which frees its blocks at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use flint_model::kernels::pool::KernelPool;

use crate::block_pool::PrefixIndex;
use crate::engine_core::{EngineCore, Handle, ModelInfo};
use crate::request::{EngineEvent, Request};
use crate::router::ledger::Progress;
use crate::router::rates::{DecodeCost, StepRates};
use crate::runner::ModelRunner;
use crate::scheduler::SchedulerConfig;
use crate::speculative::{SpecCounters, MAX_SPECULATIVE_TOKENS};
use crate::structured::{GrammarCompiler, MaskHistogram};
use crate::validation::validate;
use crate::EngineError;

/// A snapshot of the engine's state, refreshed after every step (for metrics and logs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Fraction of KV blocks held by sequences.
    pub kv_cache_usage: f64,
    pub num_blocks: usize,
    pub block_size: usize,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub steps: u64,
    pub failed_steps: u64,
    /// False once the step loop has died (it should not; the server reports it on /health).
    pub healthy: bool,
    /// Speculative decoding is on; its counters follow (see [`SpecCounters`]).
    pub spec_enabled: bool,
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    /// Entry `i`, for `i < spec_positions`: drafts whose token `i` was accepted.
    pub spec_accepted_per_pos: [u64; MAX_SPECULATIVE_TOKENS],
    pub spec_positions: usize,
    /// Time spent computing grammar masks (structured outputs).
    pub grammar_masks: MaskHistogram,
    /// Prompt tokens per second and decode step time by batch, tracked from step times (the
    /// router prices work with them); zero until measured.
    pub prefill_rate: f64,
    pub decode_cost: DecodeCost,
}

impl EngineStats {
    /// Speculative decoding's counters, when it is on.
    pub fn spec_counters(&self) -> Option<SpecCounters> {
        self.spec_enabled.then(|| SpecCounters {
            drafts: self.spec_drafts,
            draft_tokens: self.spec_draft_tokens,
            accepted_tokens: self.spec_accepted_tokens,
            accepted_per_pos: self.spec_accepted_per_pos[..self.spec_positions].to_vec(),
        })
    }
}

enum Command {
    Add(Handle, Box<Request>, tokio::sync::mpsc::UnboundedSender<EngineEvent>),
    Abort(String),
    AbortHandle(Handle),
    /// Forget the tracked rates (after a warm-up whose first-touch costs would skew them).
    ResetRates,
    /// Test hook: make the step loop panic, as a bug would.
    Fault,
    Shutdown,
}

/// How to run an engine's step loop thread.
#[derive(Clone, Default)]
pub struct EngineThread {
    /// Names the thread (`flint-engine-NAME`).
    pub name: Option<String>,
    /// The kernel pool the loop's kernels run on; `None`: the process-wide pool.
    pub kernels: Option<Arc<KernelPool>>,
}

/// Cheap to clone; every clone talks to the same engine thread.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    tx: Mutex<mpsc::Sender<Command>>,
    sched: SchedulerConfig,
    info: ModelInfo,
    grammars: Arc<GrammarCompiler>,
    stats: Arc<Mutex<EngineStats>>,
    alive: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    next_handle: AtomicU64,
    prefix_index: Arc<PrefixIndex>,
}

/// The events of one request. Ends after every sample finished, or after an error.
pub struct EventStream {
    id: String,
    handle: Handle,
    rx: UnboundedReceiver<EngineEvent>,
    engine: Engine,
    done: bool,
    live: usize,
    /// The router's record of this request, kept current as outputs arrive.
    progress: Option<Arc<Progress>>,
}

impl EventStream {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Count this stream's outputs into `p` (the router's load of the worker serving it).
    pub fn track_progress(&mut self, p: Arc<Progress>) {
        self.progress = Some(p);
    }

    /// The next event; `None` once the request is over.
    pub async fn next(&mut self) -> Option<EngineEvent> {
        if self.done {
            return None;
        }
        let ev = self.rx.recv().await;
        self.track(ev)
    }

    /// [`next`](Self::next) for callers outside an async runtime (the CLI, benchmarks).
    pub fn next_blocking(&mut self) -> Option<EngineEvent> {
        if self.done {
            return None;
        }
        let ev = self.rx.blocking_recv();
        self.track(ev)
    }

    /// The next event if one is ready, without waiting (`Ok(None)`: none yet; `Err(())`: over).
    #[allow(clippy::result_unit_err)]
    pub fn try_next(&mut self) -> Result<Option<EngineEvent>, ()> {
        if self.done {
            return Err(());
        }
        match self.rx.try_recv() {
            Ok(ev) => Ok(self.track(Some(ev))),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => Ok(self.track(None)),
        }
    }

    fn track(&mut self, ev: Option<EngineEvent>) -> Option<EngineEvent> {
        match &ev {
            None | Some(EngineEvent::Error(_) | EngineEvent::Rejected(_) | EngineEvent::Stopped(_)) => self.done = true,
            Some(EngineEvent::Output(o)) => {
                if let Some(p) = &self.progress {
                    p.output(o.token_ids.len());
                }
                if o.finished.is_some() {
                    self.live = self.live.saturating_sub(1);
                    self.done = self.live == 0;
                }
            }
        }
        if self.done {
            if let Some(p) = &self.progress {
                p.end();
            }
        }
        if ev.is_none() {
            // The loop marks itself dead before it drops the requests' channels, so a channel
            // that closed while the engine still reads as alive was closed by the engine (an
            // abort by id), not by a dying loop.
            if !self.engine.is_healthy() {
                return Some(EngineEvent::Stopped("the worker serving this request stopped before it finished".into()));
            }
            return Some(EngineEvent::Error("the engine stopped before the request finished".into()));
        }
        ev
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if let Some(p) = &self.progress {
            p.end();
        }
        if !self.done {
            let _ = self.engine.send(Command::AbortHandle(self.handle));
        }
    }
}

impl Engine {
    /// Start the step loop on its own thread.
    pub fn start<R: ModelRunner + 'static>(core: EngineCore<R>) -> Self {
        Self::start_with(core, EngineThread::default())
    }

    /// [`start`](Self::start) on a thread set up as `thread` says (a worker of several).
    pub fn start_with<R: ModelRunner + 'static>(core: EngineCore<R>, thread: EngineThread) -> Self {
        let (tx, rx) = mpsc::channel();
        let prefix_index = core.scheduler().kv().pool().prefix_index();
        let sched = core.scheduler().config().clone();
        let info = core.info().clone();
        let grammars =
            Arc::new(GrammarCompiler::new(core.tokenizer().clone(), info.vocab_size, info.eos_token_ids.clone()));
        let stats = Arc::new(Mutex::new(EngineStats {
            num_blocks: sched.num_blocks,
            block_size: sched.block_size,
            healthy: true,
            ..Default::default()
        }));
        // Speculation's counters exist (at zero) from the start, as vLLM exports them.
        publish(&core, &stats, &StepRates::default());
        let alive = Arc::new(AtomicBool::new(true));
        let (s, a) = (stats.clone(), alive.clone());
        let name = thread.name.map_or_else(|| "flint-engine".to_string(), |n| format!("flint-engine-{n}"));
        let kernels = thread.kernels;
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            if let Some(k) = kernels {
                flint_model::kernels::pool::install(k);
            }
            // Whatever ends the loop, a panic included, the engine must read as unhealthy
            // after: `MarkDead` says so as the loop unwinds, before its requests' channels close.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_loop(core, rx, &s, MarkDead { alive: a.clone(), stats: s.clone() })
            }));
            a.store(false, Ordering::SeqCst);
        });
        let thread = thread.ok();
        if thread.is_none() {
            alive.store(false, Ordering::SeqCst);
        }
        Self {
            inner: Arc::new(Inner {
                tx: Mutex::new(tx),
                sched,
                info,
                grammars,
                stats,
                alive,
                thread: Mutex::new(thread),
                next_handle: AtomicU64::new(0),
                prefix_index,
            }),
        }
    }

    pub fn scheduler_config(&self) -> &SchedulerConfig {
        &self.inner.sched
    }

    pub fn model_info(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// Compiles structured-output constraints for this model's vocabulary (call it off the async
    /// workers: a first use builds the token trie, and a big schema takes milliseconds).
    pub fn grammars(&self) -> &Arc<GrammarCompiler> {
        &self.inner.grammars
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.stats.lock().map(|s| *s).unwrap_or_default()
    }

    pub fn is_healthy(&self) -> bool {
        self.inner.alive.load(Ordering::SeqCst)
    }

    /// The hashes of the blocks its prefix cache holds (read by the router, on any thread).
    pub fn prefix_index(&self) -> &Arc<PrefixIndex> {
        &self.inner.prefix_index
    }

    /// Whether this engine would accept `req` (what [`submit`](Self::submit) checks first).
    pub fn validate(&self, req: &Request) -> Result<(), EngineError> {
        validate(req, &self.inner.info, &self.inner.sched)
    }

    /// Forget the prefill and decode rates tracked so far.
    pub fn reset_rates(&self) {
        let _ = self.send(Command::ResetRates);
    }

    /// Test hook: the step loop panics at its next command, as a bug in a step would, and the
    /// engine dies (its requests end with [`EngineEvent::Stopped`]).
    pub fn inject_fault(&self) {
        let _ = self.send(Command::Fault);
    }

    /// Validate and queue `req`. Invalid requests fail here, before any event.
    pub fn submit(&self, req: Request) -> Result<EventStream, EngineError> {
        self.validate(&req)?;
        self.submit_validated(req)
    }

    /// Queue `req`, which [`validate`](Self::validate) accepted (the router validates against
    /// every worker to choose one; this keeps the chosen worker from checking again).
    pub(crate) fn submit_validated(&self, req: Request) -> Result<EventStream, EngineError> {
        if !self.is_healthy() {
            return Err(EngineError::Internal("the engine is not running".into()));
        }
        let (etx, erx) = unbounded_channel();
        let (id, live) = (req.id.clone(), req.params.n);
        let handle = self.inner.next_handle.fetch_add(1, Ordering::SeqCst);
        self.send(Command::Add(handle, Box::new(req), etx))?;
        Ok(EventStream { id, handle, rx: erx, engine: self.clone(), done: false, live, progress: None })
    }

    /// Abort every live request with client id `id` (a no-op if none).
    pub fn abort(&self, id: &str) {
        let _ = self.send(Command::Abort(id.to_string()));
    }

    /// Stop the loop after the current step; pending requests end with an error event.
    pub fn shutdown(&self) {
        let _ = self.send(Command::Shutdown);
        if let Ok(mut t) = self.inner.thread.lock() {
            if let Some(h) = t.take() {
                let _ = h.join();
            }
        }
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        let tx = self.inner.tx.lock().map_err(|_| EngineError::Internal("engine channel poisoned".into()))?;
        tx.send(cmd).map_err(|_| EngineError::Internal("the engine is not running".into()))
    }
}

/// Marks the engine dead when dropped: as the step loop returns or unwinds, before the core (and
/// with it every request's event channel) goes.
struct MarkDead {
    alive: Arc<AtomicBool>,
    stats: Arc<Mutex<EngineStats>>,
}

impl Drop for MarkDead {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::SeqCst);
        if let Ok(mut st) = self.stats.lock() {
            st.healthy = false;
        }
    }
}

fn run_loop<R: ModelRunner>(
    mut core: EngineCore<R>,
    rx: mpsc::Receiver<Command>,
    stats: &Mutex<EngineStats>,
    dead: MarkDead,
) {
    // Moved into a local: locals drop before parameters, so the engine reads as dead before
    // `core`, and with it every request's channel, goes (on return and on unwind alike).
    let _dead = dead;
    let mut rates = StepRates::default();
    loop {
        // Idle: block until a command arrives. Busy: take what has arrived and step.
        if !core.has_work() {
            match rx.recv() {
                Ok(cmd) => {
                    if !apply(&mut core, cmd, &mut rates, stats) {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            if !apply(&mut core, cmd, &mut rates, stats) {
                return;
            }
        }
        let started = std::time::Instant::now();
        let plan = core.step();
        let (prefill, decode) = phase_tokens(&plan);
        rates.observe(prefill, decode, started.elapsed().as_secs_f64());
        publish(&core, stats, &rates);
        if plan.chunks.is_empty() && core.has_work() {
            // Work that cannot run yet (a sample waiting on its leader): do not spin.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// A step's prompt tokens and decode rows: a chunk that samples from its only pending token (plus
/// any draft it verifies) decodes; anything else computes prompt.
fn phase_tokens(plan: &crate::scheduler::StepPlan) -> (usize, usize) {
    plan.chunks.iter().fold((0, 0), |(p, d), c| {
        if c.sample && !c.prompt_logprobs && c.tokens.len() == c.draft + 1 {
            (p, d + c.tokens.len())
        } else {
            (p + c.tokens.len(), d)
        }
    })
}

/// Apply one command; `false` to stop the loop.
fn apply<R: ModelRunner>(
    core: &mut EngineCore<R>,
    cmd: Command,
    rates: &mut StepRates,
    stats: &Mutex<EngineStats>,
) -> bool {
    match cmd {
        Command::Add(handle, req, tx) => {
            let sink_tx = tx.clone();
            if let Err(e) = core.add_validated(handle, *req, Box::new(move |ev| sink_tx.send(ev).is_ok())) {
                let _ = tx.send(EngineEvent::Error(e.to_string()));
            }
            true
        }
        Command::Abort(id) => {
            core.abort(&id);
            true
        }
        Command::AbortHandle(h) => {
            core.abort_handle(h);
            true
        }
        Command::ResetRates => {
            *rates = StepRates::default();
            if let Ok(mut st) = stats.lock() {
                (st.prefill_rate, st.decode_cost) = (0.0, DecodeCost::default());
            }
            true
        }
        Command::Fault => panic!("fault injected into the engine's step loop (test hook)"),
        Command::Shutdown => false,
    }
}

fn publish<R: ModelRunner>(core: &EngineCore<R>, stats: &Mutex<EngineStats>, rates: &StepRates) {
    let s = core.scheduler();
    if let Ok(mut st) = stats.lock() {
        (st.prefill_rate, st.decode_cost) = (rates.prefill(), rates.decode());
        st.num_running = s.num_running();
        st.num_waiting = s.num_waiting();
        st.kv_cache_usage = s.kv().usage();
        st.prefix_cache_queries = s.stats.prefix_queries;
        st.prefix_cache_hits = s.stats.prefix_hits;
        st.num_preemptions = s.stats.preemptions;
        st.prompt_tokens = core.counters.prompt_tokens;
        st.generation_tokens = core.counters.generation_tokens;
        st.steps = core.counters.steps;
        st.failed_steps = core.counters.failed_steps;
        st.grammar_masks = core.mask_times;
        if let Some(cfg) = core.speculative() {
            let c = &core.spec_counters;
            st.spec_enabled = true;
            (st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens) =
                (c.drafts, c.draft_tokens, c.accepted_tokens);
            st.spec_positions = cfg.num_speculative_tokens.min(MAX_SPECULATIVE_TOKENS);
            for (dst, &src) in st.spec_accepted_per_pos.iter_mut().zip(&c.accepted_per_pos) {
                *dst = src;
            }
        }
    }
}
