//! The kernels' persistent thread pool: `threads − 1` workers plus the calling thread, each job
//! split into numbered tasks that the threads take from a shared counter.
//!
//! Decode runs a few hundred small kernel calls per token, microseconds apart. A pool whose
//! workers go to sleep in the kernel between calls (rayon's) pays a futex wake and a context
//! switch per call; these workers spin on a generation counter for a short while first (as
//! llama.cpp's do) and only then park. Which thread runs which task never changes a result:
//! every task writes its own outputs, computed whole.
//!
//! A task that panics does not take a worker down or leave the caller waiting: the panic is
//! caught, the other tasks finish, and `run` then panics on the caller's thread, where the
//! engine's per-step recovery sees it like any other failure.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// The number of threads the kernels use: [`set_threads`], else `FLINT_THREADS`, else the
/// physical cores this process may run on (see [`physical_cores`]).
pub fn threads() -> usize {
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
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let allowed = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    let mut cores = std::collections::HashSet::new();
    for cpu in parse_cpu_list(allowed.trim())? {
        let topology = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let siblings = std::fs::read_to_string(format!("{topology}/core_cpus_list"))
            .or_else(|_| std::fs::read_to_string(format!("{topology}/thread_siblings_list")))
            .ok()?;
        cores.insert(siblings.trim().to_string());
    }
    (!cores.is_empty()).then_some(cores.len())
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
    let pool = POOL.get_or_init(|| Pool::start(threads()));
    if n == 1 || pool.workers.is_empty() {
        (0..n).for_each(&f);
        return;
    }
    // One job at a time; a second caller (another thread, or a task that itself calls a
    // kernel) runs its tasks on its own thread rather than wait.
    let Ok(_busy) = pool.busy.try_lock() else {
        (0..n).for_each(&f);
        return;
    };
    let job = Job { f: &f, n, next: AtomicUsize::new(0), done: AtomicUsize::new(0), panicked: AtomicBool::new(false) };
    // SAFETY (lifetime erasure): the pointer is only dereferenced by workers that took a
    // reference under `shared.slot` while it was published, and this function waits for all of
    // them to give it back (`refs == 0`) before `job` and `f` go out of scope.
    let ptr: *const Job<'static> = (&job as *const Job).cast();
    {
        let mut slot = lock(&pool.shared.slot);
        slot.job = Some(JobPtr(ptr));
        slot.generation += 1;
        pool.shared.generation.store(slot.generation, Ordering::Release);
    }
    for w in &pool.workers {
        w.unpark();
    }
    job.work();
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A worker never panics while holding the lock (it only copies a pointer), so a poisoned
    // lock still holds consistent data.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.f)(i))).is_err() {
                self.panicked.store(true, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::Release);
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
}

struct Pool {
    shared: Arc<Shared>,
    workers: Vec<Thread>,
    busy: Mutex<()>,
}

impl Pool {
    fn start(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot { job: None, generation: 0 }),
            generation: AtomicUsize::new(0),
            refs: AtomicUsize::new(0),
        });
        let mut workers = Vec::new();
        for i in 1..threads {
            let s = shared.clone();
            match thread::Builder::new().name(format!("flint-kernel-{i}")).spawn(move || worker(&s)) {
                Ok(h) => workers.push(h.thread().clone()),
                // Fewer threads is slower, not wrong.
                Err(_) => break,
            }
        }
        Pool { shared, workers, busy: Mutex::new(()) }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0usize;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.generation.load(Ordering::Acquire) == seen {
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
            unsafe { (*p).work() };
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
