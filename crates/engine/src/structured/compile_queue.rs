//! Where requests' constraints are compiled: a few threads of their own, so that compiles can
//! neither crowd the step loop's cores nor outlive the requests that asked for them.
//!
//! - **Bounded:** at most `threads` compiles run at once (default: one per four cores, at least
//!   one), however many requests wait; the rest queue.
//! - **Below the step loop:** the threads run at a lower CPU priority (Linux `nice` +10), so when
//!   every core is busy a compile takes the leftovers and decoding keeps its pace.
//! - **Never started for nobody:** a queued compile whose request timed out or went away (its
//!   [`CompileTicket`] dropped) is skipped. llguidance has no way to stop a compile once it runs,
//!   so that one finishes (its result is cached for a retry); the size and depth bounds keep it
//!   short, and only `threads` of them can run.
//! - **Deep stacks:** [`STACK_BYTES`] each, sized for [`super::bounds::MAX_LEVELS`] with a wide
//!   margin (the memory is reserved, and only touched as deep as a compile goes).
//! - **Scratch returned:** a long compile may have built a lexer of a few hundred MB before it
//!   failed or was cut to size; the allocator would keep those pages (the binary keeps up to
//!   256 MiB of free heap for the step loop's activations), so they are handed back to the OS.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{CompiledGrammar, Constraint, GrammarCompiler, GrammarError};

/// Each compile thread's stack: ~6.4 KB per level at most was measured, so the bound's 5,000
/// levels need ~32 MB.
pub const STACK_BYTES: usize = 256 << 20;

/// How much lower than the step loop the compile threads run (a `nice` increment).
const NICENESS: i32 = 10;

/// A compile that ran this long may have left a large transient heap behind (see
/// [`release_free_heap`]); short ones allocate little.
const LONG_COMPILE: Duration = Duration::from_millis(50);

/// What the queue has done (updated as it goes).
#[derive(Debug, Default)]
pub(super) struct CompileCounters {
    started: AtomicU64,
    skipped: AtomicU64,
    running: AtomicUsize,
    queued: AtomicUsize,
}

/// A snapshot of the compile queue, for `/metrics` and the tests.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CompileStats {
    pub threads: usize,
    pub started: u64,
    /// Queued compiles dropped because their request had gone before a thread was free.
    pub skipped: u64,
    pub running: usize,
    pub queued: usize,
}

struct Job {
    constraint: Constraint,
    cancelled: Arc<AtomicBool>,
    reply: oneshot::Sender<Result<CompiledGrammar, GrammarError>>,
}

/// The shared queue; the compiler owns it and its threads hold it.
pub(super) struct CompileQueue {
    jobs: Mutex<VecDeque<Job>>,
    ready: Condvar,
    closed: AtomicBool,
    threads: AtomicUsize,
    started_threads: AtomicUsize,
    counters: CompileCounters,
}

/// A compile waiting or running for one request. Dropping it (the request timed out or its
/// client left) withdraws the compile if no thread has started it yet.
pub struct CompileTicket {
    /// Taken by whoever waits (the ticket itself must stay, for its drop to withdraw the job).
    rx: Option<oneshot::Receiver<Result<CompiledGrammar, GrammarError>>>,
    cancelled: Arc<AtomicBool>,
}

impl CompileTicket {
    /// A ticket already answered (a cached grammar).
    pub(super) fn ready(result: Result<CompiledGrammar, GrammarError>) -> Self {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(result);
        Self { rx: Some(rx), cancelled: Arc::new(AtomicBool::new(false)) }
    }

    /// The compiled grammar, once a thread has compiled it.
    pub async fn wait(mut self) -> Result<CompiledGrammar, GrammarError> {
        match self.rx.take() {
            Some(rx) => rx.await.unwrap_or_else(|_| Err(stopped())),
            None => Err(stopped()),
        }
    }

    /// [`wait`](Self::wait) for a caller outside an async runtime (the CLI).
    pub fn wait_blocking(mut self) -> Result<CompiledGrammar, GrammarError> {
        match self.rx.take() {
            Some(rx) => rx.blocking_recv().unwrap_or_else(|_| Err(stopped())),
            None => Err(stopped()),
        }
    }
}

impl Drop for CompileTicket {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

fn stopped() -> GrammarError {
    GrammarError::Unavailable("the grammar compiler stopped".into())
}

/// The default number of compile threads for `cores` cores.
fn default_threads(cores: usize) -> usize {
    (cores / 4).clamp(1, 4)
}

impl CompileQueue {
    pub(super) fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            jobs: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            closed: AtomicBool::new(false),
            threads: AtomicUsize::new(default_threads(cores)),
            started_threads: AtomicUsize::new(0),
            counters: CompileCounters::default(),
        }
    }

    pub(super) fn set_threads(&self, n: usize) {
        self.threads.store(n.max(1), Ordering::Relaxed);
    }

    pub(super) fn threads(&self) -> usize {
        self.threads.load(Ordering::Relaxed)
    }

    pub(super) fn stats(&self) -> CompileStats {
        let c = &self.counters;
        CompileStats {
            threads: self.threads(),
            started: c.started.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            running: c.running.load(Ordering::Relaxed),
            queued: c.queued.load(Ordering::Relaxed),
        }
    }

    /// Queue `constraint`; the first call starts the threads.
    pub(super) fn submit(self: &Arc<Self>, compiler: &Arc<GrammarCompiler>, constraint: Constraint) -> CompileTicket {
        let (reply, rx) = oneshot::channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.push_back(Job { constraint, cancelled: cancelled.clone(), reply });
        self.counters.queued.store(jobs.len(), Ordering::Relaxed);
        drop(jobs);
        self.start_threads(compiler);
        self.ready.notify_one();
        CompileTicket { rx: Some(rx), cancelled }
    }

    fn start_threads(self: &Arc<Self>, compiler: &Arc<GrammarCompiler>) {
        let want = self.threads();
        while self.started_threads.load(Ordering::Relaxed) < want {
            let n = self.started_threads.fetch_add(1, Ordering::Relaxed);
            if n >= want {
                break;
            }
            let (queue, compiler) = (self.clone(), Arc::downgrade(compiler));
            let spawned = std::thread::Builder::new()
                .name(format!("flint-grammar-{n}"))
                .stack_size(STACK_BYTES)
                .spawn(move || queue.serve(compiler));
            if spawned.is_err() {
                // Without any thread nothing would ever answer: say so to whoever waits.
                if self.started_threads.fetch_sub(1, Ordering::Relaxed) == 1 {
                    self.fail_all("no thread could be started for grammar compiles");
                }
                break;
            }
        }
    }

    fn fail_all(&self, why: &str) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        for job in jobs.drain(..) {
            let _ = job.reply.send(Err(GrammarError::Unavailable(why.into())));
        }
        self.counters.queued.store(0, Ordering::Relaxed);
    }

    /// The next job whose request still waits; `None` once the compiler is gone.
    fn next(&self) -> Option<Job> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.closed.load(Ordering::Relaxed) {
                return None;
            }
            while let Some(job) = jobs.pop_front() {
                if job.cancelled.load(Ordering::Relaxed) || job.reply.is_closed() {
                    self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                self.counters.queued.store(jobs.len(), Ordering::Relaxed);
                return Some(job);
            }
            self.counters.queued.store(0, Ordering::Relaxed);
            jobs = self.ready.wait(jobs).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn serve(&self, compiler: Weak<GrammarCompiler>) {
        lower_priority();
        while let Some(job) = self.next() {
            let Some(compiler) = compiler.upgrade() else { break };
            self.counters.started.fetch_add(1, Ordering::Relaxed);
            self.counters.running.fetch_add(1, Ordering::Relaxed);
            let t0 = Instant::now();
            let result = compiler.compile(&job.constraint);
            self.counters.running.fetch_sub(1, Ordering::Relaxed);
            let _ = job.reply.send(result);
            if t0.elapsed() >= LONG_COMPILE {
                release_free_heap();
            }
        }
    }

    /// The compiler is going away: its threads end once their current compile is done.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.ready.notify_all();
        self.fail_all("the grammar compiler stopped");
    }
}

/// Run the calling thread below normal priority, where the OS allows it (Linux sets `nice` per
/// thread). Failing is harmless: the thread runs at normal priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid takes no arguments; setpriority only changes this thread's nice value.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, NICENESS);
    }
}

/// Hand the heap's free pages back to the OS (glibc keeps them otherwise: `M_TRIM_THRESHOLD` is
/// raised at start-up). Measured in the soak run: a refused `(ab){500}{500}` peaks at ~300 MB of
/// lexer, all freed at once, and without this the RSS stayed that much higher.
fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the OS; it takes the allocator's locks.
    unsafe {
        libc::malloc_trim(0);
    }
}
