//! The kernels' persistent thread pool: `threads − 1` workers plus the calling thread, each job
//! split into numbered tasks that the threads take from a shared counter.
//!
//! Decode runs a few hundred small kernel calls per token, microseconds apart. A pool whose
//! workers go to sleep in the kernel between calls (rayon's) pays a futex wake and a context
//! switch per call; these workers spin on a generation counter for a short while first (as
//! llama.cpp's do) and only then park. Which thread runs which task never changes a result:
//! every task writes its own outputs, computed whole.
//!
//! [`run_ranges`] hands out ranges of a sequence of units instead (a matrix's column panels): each
//! thread owns a contiguous share and takes it from the front, so one thread's units follow one
//! another in memory and its weight stream never breaks between them; a thread whose share is
//! done takes half of what is left of the largest other share, from the back.
//!
//! Tasks that write an output each write their own part of it: [`run_parts`] and [`run_chunks`]
//! hand each task its slice, and [`Disjoint`] is what both (and the matrix kernels' column
//! stripes) are built on, the one place a buffer is shared between tasks.
//!
//! A task that panics does not take a worker down or leave the caller waiting: the panic is
//! caught, the other tasks finish, and `run` then panics on the caller's thread, where the
//! engine's per-step recovery sees it like any other failure.
//!
//! One process-wide pool serves any thread by default. A server with several CPU workers gives
//! each worker's engine thread its own [`KernelPool`] ([`install`]), pinned to cores no other
//! worker uses: with one shared pool, a second engine stepping at the same time would find it
//! busy and run every kernel on its own thread alone.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(200);

static THREADS: OnceLock<usize> = OnceLock::new();
static POOL: OnceLock<Pool> = OnceLock::new();

/// Fix the number of threads kernels use (the caller included). Only the first call before the
/// pool starts counts; returns false if the pool was already sized.
pub fn set_threads(n: usize) -> bool {
    THREADS.set(n.max(1)).is_ok()
}

thread_local! {
    /// The pool this thread's kernel calls use instead of the process-wide one (see [`install`]).
    static LOCAL: RefCell<Option<Arc<KernelPool>>> = const { RefCell::new(None) };
}

/// The number of threads the kernels called from this thread use: its own pool's when one is
/// [installed](install), else the process-wide [`global_threads`].
pub fn threads() -> usize {
    LOCAL.with(|l| l.borrow().as_ref().map(|p| p.0.threads)).unwrap_or_else(global_threads)
}

/// The process-wide pool's size: [`set_threads`], else `FLINT_THREADS`, else the physical cores
/// this process may run on (see [`physical_cores`]).
pub fn global_threads() -> usize {
    *THREADS.get_or_init(|| {
        std::env::var("FLINT_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or_else(
            || {
                let logical = thread::available_parallelism().map_or(1, |n| n.get());
                physical_cores().map_or(logical, |p| p.min(logical))
            },
        )
    })
}

/// Physical cores among the CPUs this process may run on, from Linux's sysfs topology (`None`
/// elsewhere or when it cannot be read). The kernels stream weights and keep the vector units
/// busy, so a second thread on a core's SMT sibling only contends for them (llama.cpp also
/// defaults to physical cores).
pub fn physical_cores() -> Option<usize> {
    core_cpus().map(|c| c.len())
}

/// The CPUs this process may run on, grouped by physical core (SMT siblings together), cores in
/// the order of their first CPU; `None` where Linux's topology cannot be read.
pub fn core_cpus() -> Option<Vec<Vec<usize>>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let allowed = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    let mut cores: Vec<(String, Vec<usize>)> = Vec::new();
    for cpu in parse_cpu_list(allowed.trim())? {
        let topology = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let siblings = std::fs::read_to_string(format!("{topology}/core_cpus_list"))
            .or_else(|_| std::fs::read_to_string(format!("{topology}/thread_siblings_list")))
            .ok()?;
        let key = siblings.trim().to_string();
        match cores.iter_mut().find(|(k, _)| *k == key) {
            Some((_, cpus)) => cpus.push(cpu),
            None => cores.push((key, vec![cpu])),
        }
    }
    (!cores.is_empty()).then(|| cores.into_iter().map(|(_, cpus)| cpus).collect())
}

/// Restrict the calling thread to `cpus` (Linux; elsewhere, or if the kernel refuses, `false`
/// and the thread runs where the OS puts it: slower under contention, never wrong).
pub fn pin_current_thread(cpus: &[usize]) -> bool {
    #[cfg(target_os = "linux")]
    {
        if cpus.is_empty() {
            return false;
        }
        // SAFETY: `set` is a plain bitmask owned by this frame; CPU_SET bounds-checks indices
        // against the mask size, and pid 0 names the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_ZERO(&mut set);
            for &c in cpus {
                if c < libc::CPU_SETSIZE as usize {
                    libc::CPU_SET(c, &mut set);
                }
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpus;
        false
    }
}

/// A kernel thread pool of its own, for one worker's engine thread: `threads − 1` kernel threads
/// plus the thread it is [installed](install) on, all pinned to `cpus` when given. Its kernel
/// threads end when the last handle goes.
pub struct KernelPool(Pool);

impl KernelPool {
    pub fn start(threads: usize, cpus: Option<Vec<usize>>) -> Arc<Self> {
        Arc::new(Self(Pool::start(threads.max(1), cpus)))
    }

    pub fn threads(&self) -> usize {
        self.0.threads
    }

    /// The CPUs its threads are pinned to (`None`: not pinned).
    pub fn cpus(&self) -> Option<&[usize]> {
        self.0.cpus.as_deref()
    }
}

/// From now on, kernels called from this thread run on `pool` (and the thread is pinned to the
/// pool's CPUs, if it has any). Returns whether pinning took.
pub fn install(pool: Arc<KernelPool>) -> bool {
    let pinned = pool.cpus().is_some_and(pin_current_thread);
    LOCAL.with(|l| *l.borrow_mut() = Some(pool));
    pinned
}

/// A Linux CPU list (`0-3,8,10-11`) as CPU numbers; `None` if malformed.
fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 65_536 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// Run `f(0) … f(n − 1)`, spread over the pool; returns when all have finished.
pub fn run(n: usize, f: impl Fn(usize) + Sync) {
    if n == 0 {
        return;
    }
    run_job(n, || (0..n).for_each(&f), |_| Work::Tasks { f: &f, next: AtomicUsize::new(0) });
}

/// Run `f` on ranges that together cover `0..n` once each, spread over the pool; returns when
/// all have finished. Thread `t` of `T` owns units `t·n/T .. (t+1)·n/T` and takes them from the
/// front, a shrinking piece at a time (so that others can still take what it has not reached);
/// when its share is done it takes half of what is left of the largest other share, from the
/// back, and makes that its own. The units a thread runs are thus a few long runs, not a
/// sequence of scattered pieces: for a matrix kernel streaming its weights from memory each new
/// run is a stream the hardware prefetcher must find again, which costs about a microsecond on
/// Zen 4 (see `by_panel_stripes_grouped`).
pub fn run_ranges(n: usize, f: impl Fn(Range<usize>) + Sync) {
    if n == 0 {
        return;
    }
    // Shares are packed as two 32-bit halves; a larger job (never a matrix's panels) runs whole.
    if n > u32::MAX as usize {
        return f(0..n);
    }
    run_job(
        n,
        || f(0..n),
        |threads| {
            let share = |t: usize| Share(AtomicU64::new(pack(t * n / threads, (t + 1) * n / threads)));
            Work::Ranges { f: &f, shares: (0..threads).map(share).collect() }
        },
    );
}

/// Run a job of `n` (at least 1) tasks or units on the pool that kernels called from this thread use:
/// `work(threads)` spread over its threads, or `whole()` on this thread alone where the pool has
/// no workers, the job is one unit, or the pool is busy.
fn run_job<'a>(n: usize, whole: impl FnOnce(), work: impl FnOnce(usize) -> Work<'a>) {
    let local = LOCAL.with(|l| l.borrow().clone());
    let pool = match &local {
        Some(p) => &p.0,
        None => POOL.get_or_init(|| Pool::start(global_threads(), None)),
    };
    if n == 1 || pool.workers.is_empty() {
        return whole();
    }
    // One job at a time; a second caller (another thread, or a task that itself calls a
    // kernel) runs its tasks on its own thread rather than wait.
    let Ok(_busy) = pool.busy.try_lock() else {
        return whole();
    };
    let job = Job { work: work(pool.threads), n, done: AtomicUsize::new(0), panicked: AtomicBool::new(false) };
    publish(pool, &job);
}

/// Hand `job` to the pool's workers, work on it on this thread (thread 0), and wait until every
/// unit is done and no worker still holds it.
fn publish(pool: &Pool, job: &Job) {
    let n = job.n;
    // SAFETY (lifetime erasure): the pointer is only dereferenced by workers that took a
    // reference under `shared.slot` while it was published, and this function waits for all of
    // them to give it back (`refs == 0`) before `job` and `f` go out of scope.
    let ptr: *const Job<'static> = (job as *const Job).cast();
    {
        let mut slot = lock(&pool.shared.slot);
        slot.job = Some(JobPtr(ptr));
        slot.generation += 1;
        pool.shared.generation.store(slot.generation, Ordering::Release);
    }
    for w in &pool.workers {
        w.unpark();
    }
    job.work(0);
    while job.done.load(Ordering::Acquire) < n {
        std::hint::spin_loop();
    }
    lock(&pool.shared.slot).job = None;
    while pool.shared.refs.load(Ordering::Acquire) != 0 {
        std::hint::spin_loop();
    }
    if job.panicked.load(Ordering::Acquire) {
        panic!("a CPU kernel task panicked");
    }
}

/// [`run`] with task `i` given `buf[bounds[i]..bounds[i + 1]]`, for `i` in `0..bounds.len() − 1`.
/// The bounds must ascend (so the parts are disjoint) and stay within `buf`.
pub fn run_parts<T: Send>(buf: &mut [T], bounds: &[usize], f: impl Fn(usize, &mut [T]) + Sync) {
    assert!(bounds.windows(2).all(|b| b[0] <= b[1]), "part bounds must ascend");
    assert!(bounds.last().is_none_or(|&e| e <= buf.len()), "parts past the end of the buffer");
    let buf = Disjoint::new(buf);
    run(bounds.len().saturating_sub(1), |i| {
        // SAFETY: ascending bounds make the parts disjoint, and each is handed to one task.
        f(i, unsafe { buf.part(bounds[i]..bounds[i + 1]) })
    });
}

/// [`run`] with task `i` given the `i`-th `len`-element chunk of `buf` (the last may be shorter),
/// one task per chunk.
pub fn run_chunks<T: Send>(buf: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    assert!(len > 0, "chunks of no elements");
    let total = buf.len();
    let buf = Disjoint::new(buf);
    run(total.div_ceil(len), |i| {
        // SAFETY: consecutive chunks are disjoint, and each is handed to one task.
        f(i, unsafe { buf.part(i * len..((i + 1) * len).min(total)) })
    });
}

/// A buffer that the tasks of one [`run`] write into, each in parts no other task touches while it
/// holds them. [`run_parts`] and [`run_chunks`] are the safe way to use it; the matrix kernels'
/// column stripes ([`super::Stripe`]), which are not contiguous, take their rows' pieces from it.
pub(crate) struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _buf: PhantomData<&'a mut [T]>,
}

// SAFETY: the buffer is only reached through `part`, whose callers guarantee that no two parts in
// use at once overlap; the elements are written from other threads, hence `T: Send`.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}
unsafe impl<T: Send> Send for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    pub(crate) fn new(buf: &'a mut [T]) -> Self {
        Disjoint { ptr: buf.as_mut_ptr(), len: buf.len(), _buf: PhantomData }
    }

    /// Where the buffer starts, for address hints (prefetches): nothing is read or written
    /// through it.
    pub(crate) fn start(&self) -> *const T {
        self.ptr
    }

    /// Elements `range` of the buffer (bounds-checked).
    ///
    /// # Safety
    /// No other part overlapping `range` may be in use at the same time, on any thread.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn part(&self, range: Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "part out of bounds");
        // SAFETY: within the buffer (checked above), which outlives `'a`; exclusive by the
        // caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start) }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A worker never panics while holding the lock (it only copies a pointer), so a poisoned
    // lock still holds consistent data.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Job<'a> {
    work: Work<'a>,
    /// Tasks, or units of the ranges.
    n: usize,
    /// Tasks or units finished.
    done: AtomicUsize,
    panicked: AtomicBool,
}

enum Work<'a> {
    /// [`run`]: task indices from one counter.
    Tasks { f: &'a (dyn Fn(usize) + Sync), next: AtomicUsize },
    /// [`run_ranges`]: each thread's share of the units.
    Ranges { f: &'a (dyn Fn(Range<usize>) + Sync), shares: Vec<Share> },
}

/// What is left of one thread's share, `front..back`, in one word: the owner takes from the front
/// and others from the back, each by compare-and-swap, so no unit is taken twice. A cache line
/// each, so that owners taking their next piece do not contend.
#[repr(align(64))]
struct Share(AtomicU64);

fn pack(front: usize, back: usize) -> u64 {
    ((front as u64) << 32) | back as u64
}

fn unpack(w: u64) -> (usize, usize) {
    ((w >> 32) as usize, (w & u32::MAX as u64) as usize)
}

impl Share {
    /// Take up to `len(front, back)` units from the front; `None` when the share is empty.
    fn take_front(&self, len: impl Fn(usize) -> usize) -> Option<Range<usize>> {
        let mut w = self.0.load(Ordering::Acquire);
        loop {
            let (front, back) = unpack(w);
            if front >= back {
                return None;
            }
            let end = front + len(back - front).clamp(1, back - front);
            match self.0.compare_exchange_weak(w, pack(end, back), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(front..end),
                Err(now) => w = now,
            }
        }
    }

    /// Take the back half (rounded up) of what is left; `None` when the share is empty.
    fn take_back_half(&self) -> Option<Range<usize>> {
        let mut w = self.0.load(Ordering::Acquire);
        loop {
            let (front, back) = unpack(w);
            if front >= back {
                return None;
            }
            let start = back - (back - front).div_ceil(2);
            match self.0.compare_exchange_weak(w, pack(front, start), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(start..back),
                Err(now) => w = now,
            }
        }
    }

    fn left(&self) -> usize {
        let (front, back) = unpack(self.0.load(Ordering::Acquire));
        back.saturating_sub(front)
    }
}

impl Job<'_> {
    /// Work on the job as thread `me` (0 is the caller) until nothing is left to take, then count
    /// what it did towards `done` once (a shared counter updated per task would move its cache
    /// line between the cores at every task).
    fn work(&self, me: usize) {
        let did = match &self.work {
            Work::Tasks { f, next } => {
                let mut did = 0;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= self.n {
                        break did;
                    }
                    self.attempt(|| f(i));
                    did += 1;
                }
            }
            Work::Ranges { f, shares } => self.work_ranges(*f, shares, me),
        };
        self.done.fetch_add(did, Ordering::Release);
    }

    /// [`Self::work`] on a [`run_ranges`] job: this thread's share, then stolen halves of others'.
    fn work_ranges(&self, f: &(dyn Fn(Range<usize>) + Sync), shares: &[Share], me: usize) -> usize {
        let Some(own) = shares.get(me) else { return 0 };
        let mut did = 0;
        loop {
            // Half of what is left at a time: few calls, and a tail fine enough for others to
            // balance the finish.
            while let Some(r) = own.take_front(|left| left / 2) {
                did += r.len();
                self.attempt(|| f(r));
            }
            let stolen = loop {
                let others = shares.iter().enumerate().filter(|&(t, s)| t != me && s.left() > 0);
                let Some((_, victim)) = others.max_by_key(|(_, s)| s.left()) else { break None };
                // Emptied meanwhile: look again.
                if let Some(r) = victim.take_back_half() {
                    break Some(r);
                }
            };
            let Some(stolen) = stolen else { return did };
            // Own share is empty and only this thread refills it: the stolen run becomes it, for
            // the others to take from in turn.
            own.0.store(pack(stolen.start, stolen.end), Ordering::Release);
        }
    }

    /// Run one task or range, recording (not propagating) a panic.
    fn attempt(&self, task: impl FnOnce()) {
        if catch_unwind(AssertUnwindSafe(task)).is_err() {
            self.panicked.store(true, Ordering::Release);
        }
    }
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job<'static>);
// SAFETY: the job it points to is `Sync` (atomics and a `Sync` closure) and outlives every use
// (see `run`).
unsafe impl Send for JobPtr {}

struct Slot {
    job: Option<JobPtr>,
    generation: usize,
}

struct Shared {
    slot: Mutex<Slot>,
    /// A copy of `slot.generation` that idle workers can watch without the lock.
    generation: AtomicUsize,
    /// Workers holding a job pointer.
    refs: AtomicUsize,
    /// The pool is gone: its workers exit.
    stop: AtomicBool,
}

struct Pool {
    shared: Arc<Shared>,
    workers: Vec<Thread>,
    busy: Mutex<()>,
    threads: usize,
    cpus: Option<Vec<usize>>,
}

impl Pool {
    fn start(threads: usize, cpus: Option<Vec<usize>>) -> Self {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot { job: None, generation: 0 }),
            generation: AtomicUsize::new(0),
            refs: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        for i in 1..threads {
            let (s, pin) = (shared.clone(), cpus.clone());
            let spawned = thread::Builder::new().name(format!("flint-kernel-{i}")).spawn(move || {
                if let Some(c) = pin {
                    pin_current_thread(&c);
                }
                worker(&s, i)
            });
            match spawned {
                Ok(h) => workers.push(h.thread().clone()),
                // Fewer threads is slower, not wrong.
                Err(_) => break,
            }
        }
        let threads = workers.len() + 1;
        Pool { shared, workers, busy: Mutex::new(()), threads, cpus }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for w in &self.workers {
            w.unpark();
        }
    }
}

/// Worker `me` (1..threads) of a pool.
fn worker(s: &Shared, me: usize) {
    let mut seen = 0usize;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.generation.load(Ordering::Acquire) == seen {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                // `unpark` before `park` returns at once, so a job published in between is
                // not missed; a spurious wake just loops.
                thread::park_timeout(Duration::from_millis(100));
            }
        }
        let job = {
            let slot = lock(&s.slot);
            seen = slot.generation;
            let job = slot.job;
            if job.is_some() {
                s.refs.fetch_add(1, Ordering::AcqRel);
            }
            job
        };
        if let Some(JobPtr(p)) = job {
            // SAFETY: taken under the lock while published, and `run` waits for `refs` to drop
            // before the job goes away.
            unsafe { (*p).work(me) };
            s.refs.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_lists_parse() {
        assert_eq!(super::parse_cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(super::parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(super::parse_cpu_list(""), Some(vec![]));
        assert_eq!(super::parse_cpu_list("3-1"), None);
        assert_eq!(super::parse_cpu_list("a"), None);
    }

    #[test]
    fn physical_cores_are_at_most_the_allowed_cpus() {
        #[cfg(target_os = "linux")]
        {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap();
            let allowed = super::parse_cpu_list(list.trim()).unwrap().len();
            let p = super::physical_cores().expect("Linux exposes its CPU topology");
            assert!(p >= 1 && p <= allowed, "{p} physical cores of {allowed} allowed CPUs");
        }
        assert!(super::threads() >= 1);
    }

    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn a_panicking_task_fails_the_call_not_the_pool() {
        let r = std::panic::catch_unwind(|| {
            run(16, |i| {
                if i == 5 {
                    panic!("task 5");
                }
            })
        });
        assert!(r.is_err(), "the panic reaches the caller");
        let hits = AtomicU64::new(0);
        run(16, |_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 16, "the pool still runs jobs");
    }

    #[test]
    fn each_installed_pool_runs_its_caller_on_its_own_threads() {
        // Two "workers" stepping at once: with one shared pool the second would run alone.
        let callers: Vec<_> = (0..2)
            .map(|_| {
                thread::spawn(|| {
                    install(KernelPool::start(2, None));
                    assert_eq!(threads(), 2);
                    let mut both = 0;
                    for _ in 0..20 {
                        let seen = Mutex::new(std::collections::HashSet::new());
                        run(8, |_| {
                            seen.lock().unwrap().insert(thread::current().id());
                            thread::sleep(Duration::from_millis(2));
                        });
                        both += usize::from(seen.lock().unwrap().len() == 2);
                    }
                    both
                })
            })
            .collect();
        for c in callers {
            // Sharing one pool, the two callers would take turns running alone most rounds.
            let both = c.join().unwrap();
            assert!(both >= 10, "both threads of its own pool took tasks in only {both} of 20 rounds");
        }
        assert_eq!(threads(), global_threads(), "a thread without a pool of its own uses the global one");
    }

    #[test]
    fn pinning_to_an_allowed_cpu_takes() {
        #[cfg(target_os = "linux")]
        {
            let cores = core_cpus().expect("Linux exposes its CPU topology");
            let cpu = cores[0][0];
            let pinned = thread::spawn(move || {
                let ok = pin_current_thread(&[cpu]);
                let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
                let list =
                    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string();
                (ok, list)
            })
            .join()
            .unwrap();
            assert_eq!(pinned, (true, cpu.to_string()));
        }
    }

    #[test]
    fn parts_and_chunks_reach_each_task_whole() {
        let mut buf = vec![0usize; 103];
        run_parts(&mut buf, &[0, 10, 10, 57, 100], |i, part| part.iter_mut().for_each(|v| *v += i + 1));
        // Task 1's part is empty; elements past the last bound are no task's.
        let want: Vec<usize> = (0..103)
            .map(|k| match k {
                0..10 => 1,
                10..57 => 3,
                57..100 => 4,
                _ => 0,
            })
            .collect();
        assert_eq!(buf, want);
        let mut buf = vec![0usize; 103];
        run_chunks(&mut buf, 8, |i, chunk| {
            assert_eq!(chunk.len(), if i == 12 { 7 } else { 8 });
            chunk.iter_mut().for_each(|v| *v = i);
        });
        assert!(buf.iter().enumerate().all(|(k, &v)| v == k / 8));
    }

    #[test]
    #[should_panic(expected = "ascend")]
    fn overlapping_parts_are_refused() {
        run_parts(&mut [0u8; 8], &[0, 5, 3, 8], |_, _| {});
    }

    /// Runs `f` on a thread with a pool of its own of `threads` threads.
    fn on_pool<R: Send + 'static>(threads: usize, f: impl FnOnce() -> R + Send + 'static) -> R {
        thread::spawn(move || {
            install(KernelPool::start(threads, None));
            f()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn ranges_cover_every_unit_exactly_once() {
        for threads in 1..=4 {
            on_pool(threads, move || {
                for n in (0..40).chain([255, 256, 1000, 9496]) {
                    let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
                    run_ranges(n, |r| {
                        assert!(!r.is_empty() && r.end <= n, "{threads} threads, {n} units: range {r:?}");
                        r.for_each(|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{threads} threads, {n} units");
                }
            });
        }
    }

    #[test]
    fn each_thread_runs_a_few_long_runs_of_units() {
        // Each thread's share goes in halves, then the finish is balanced by halves: about 20
        // ranges. A worker that wakes late (a busy machine) leaves its share to the caller, whose
        // stolen halves each go in halves too: about 55. One unit at a time would be 1000.
        let ranges = on_pool(2, || {
            let ranges = Mutex::new(Vec::new());
            run_ranges(1000, |r| {
                std::hint::black_box((0..2000).sum::<u64>());
                ranges.lock().unwrap().push(r)
            });
            ranges.into_inner().unwrap()
        });
        assert!(ranges.len() <= 100, "{} ranges: {ranges:?}", ranges.len());
        assert_eq!(ranges.iter().map(|r| r.len()).sum::<usize>(), 1000);
    }

    #[test]
    fn a_stalled_threads_share_is_taken_over() {
        let caller_did = on_pool(2, || {
            let caller = thread::current().id();
            let (mine, stalled) = (AtomicUsize::new(0), AtomicBool::new(false));
            run_ranges(64, |r| {
                if thread::current().id() == caller {
                    mine.fetch_add(r.len(), Ordering::Relaxed);
                } else if !stalled.swap(true, Ordering::Relaxed) {
                    thread::sleep(Duration::from_millis(50));
                }
            });
            mine.into_inner()
        });
        // Its own 32, then halves of what the stalled worker had not taken.
        assert!(caller_did >= 40, "the caller ran {caller_did} of 64 units");
    }

    #[test]
    fn a_panicking_range_fails_the_call_not_the_pool() {
        on_pool(2, || {
            let r = std::panic::catch_unwind(|| {
                run_ranges(100, |r| {
                    if r.contains(&70) {
                        panic!("unit 70");
                    }
                })
            });
            assert!(r.is_err(), "the panic reaches the caller");
            let hits = AtomicUsize::new(0);
            run_ranges(100, |r| {
                hits.fetch_add(r.len(), Ordering::Relaxed);
            });
            assert_eq!(hits.into_inner(), 100, "the pool still runs jobs");
        });
    }

    #[test]
    fn every_task_runs_exactly_once_even_with_concurrent_callers() {
        let callers: Vec<_> = (0..4)
            .map(|c| {
                thread::spawn(move || {
                    for round in 0..200 {
                        let n = 1 + (round * 7 + c) % 37;
                        let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
                        run(n, |i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
    }
}
