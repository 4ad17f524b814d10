//! Shared harness of the fuzz property tests (`fuzz_files.rs` here, `fuzz_chat_template.rs` in the
//! engine, which includes this file by path).
//!
//! Every case runs on its own thread (2 MiB of stack, as a tokio worker has) under
//! `catch_unwind`, with a wall-clock limit; a panic, a timeout or an allocation over the limit
//! fails the test with the target, the seed and the case number, and the line to rerun it.
//!
//! Environment:
//! - `FLINT_FUZZ_CASES`: random cases per target (default: each target's CI budget);
//! - `FLINT_FUZZ_SEED`: the base seed (default fixed, so CI is reproducible);
//! - `FLINT_FUZZ_CASE`: run only this case number (to reproduce a failure);
//! - `FLINT_FUZZ_CASE_SECS`: per-case time limit (default 20 s in debug builds, 5 s in release);
//! - `FLINT_FUZZ_SLOW`: set to list the cases that take over 100 ms.
//!
//! The global allocator of the test binary refuses (returns null for) any single allocation over
//! [`MAX_ALLOC`] and any allocation that would take the process over [`MAX_LIVE`] bytes, after
//! writing the current case to stderr: an infallible allocation then aborts the process with
//! that line as the last output, a fallible one fails the case when it ends.

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write as _;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;

/// No single allocation of a case may be larger than this.
pub const MAX_ALLOC: usize = 512 << 20;
/// Nor may the process hold more than this in all.
pub const MAX_LIVE: usize = 3 << 30;

pub struct Guard;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// (target name, case number, seed) of the case this thread runs.
    static CURRENT: Cell<(&'static str, u64, u64)> = const { Cell::new(("", u64::MAX, 0)) };
    /// Whether the case this thread runs called [`accepted`].
    static ACCEPTED: Cell<bool> = const { Cell::new(false) };
}

fn refuse(size: usize) {
    REFUSED.fetch_add(1, Ordering::SeqCst);
    let (target, case, seed) = CURRENT.try_with(Cell::get).unwrap_or(("", u64::MAX, 0));
    // No allocation here: fixed pieces and numbers formatted into a stack buffer.
    let mut buf = [0u8; 256];
    let mut w = &mut buf[..];
    let _ = write!(
        w,
        "\nfuzz: refused an allocation of {size} bytes (live {}) in target `{target}` case {case} seed {seed}\n",
        LIVE.load(Ordering::SeqCst)
    );
    let used = 256 - w.len();
    let _ = std::io::stderr().write_all(&buf[..used]);
}

fn admit(size: usize) -> bool {
    if size > MAX_ALLOC || LIVE.load(Ordering::Relaxed).saturating_add(size) > MAX_LIVE {
        refuse(size);
        return false;
    }
    true
}

unsafe impl GlobalAlloc for Guard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !admit(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        if new_size > MAX_ALLOC {
            refuse(new_size);
            return std::ptr::null_mut();
        }
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    match parsed {
        Ok(n) => Some(n),
        Err(_) => panic!("{name}={v:?} is not a number"),
    }
}

/// Random cases to run: `FLINT_FUZZ_CASES`, else `default`.
pub fn case_count(default: u64) -> u64 {
    env_u64("FLINT_FUZZ_CASES").unwrap_or(default)
}

pub fn base_seed() -> u64 {
    env_u64("FLINT_FUZZ_SEED").unwrap_or(0x5EED_F11E)
}

fn case_limit() -> Duration {
    let default = if cfg!(debug_assertions) { 20 } else { 5 };
    Duration::from_secs(env_u64("FLINT_FUZZ_CASE_SECS").unwrap_or(default))
}

/// The rng of case `case` of `target` under `seed`: a pure function of the three, so one case
/// can be rerun alone.
pub fn case_rng(target: &str, seed: u64, case: u64) -> StdRng {
    let mut h = seed ^ 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(case.wrapping_add(1));
    for b in target.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
    }
    StdRng::seed_from_u64(h)
}

/// Count a case whose input was accepted (loaded or rendered), to show the mutations do not
/// all stop at the first check.
pub fn accepted() {
    ACCEPTED.with(|a| a.set(true));
}

/// What a case reported when it ended without panicking.
pub type Outcome = Result<(), String>;

/// Run one case on a fresh 2 MiB-stack thread with a time limit. A panic, a timeout, a refused
/// allocation or an `Err` outcome (a failed property) all fail the test naming the case.
/// Returns whether the case called [`accepted`].
pub fn run_case(target: &'static str, seed: u64, case: u64, f: impl FnOnce() -> Outcome + Send + 'static) -> bool {
    let rerun = format!("rerun: FLINT_FUZZ_SEED={seed} FLINT_FUZZ_CASE={case}");
    let refused_before = REFUSED.load(Ordering::SeqCst);
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new().name(format!("{target}#{case}")).stack_size(2 << 20).spawn(move || {
        CURRENT.with(|c| c.set((target, case, seed)));
        let r = std::panic::catch_unwind(AssertUnwindSafe(f));
        let r = r.map(|outcome| (outcome, ACCEPTED.with(Cell::get)));
        let _ = tx.send(r.map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "non-string panic".into())
        }));
    });
    if let Err(e) = spawned {
        panic!("{target} case {case}: cannot spawn a thread: {e}");
    }
    let started = Instant::now();
    let accepted = match rx.recv_timeout(case_limit()) {
        Ok(Ok((Ok(()), accepted))) => {
            if std::env::var_os("FLINT_FUZZ_SLOW").is_some() && started.elapsed() > Duration::from_millis(100) {
                eprintln!("slow: {target} case {case}: {:?}", started.elapsed());
            }
            accepted
        }
        Ok(Ok((Err(property), _))) => panic!("{target} seed {seed} case {case}: {property} ({rerun})"),
        Ok(Err(panic)) => panic!("{target} seed {seed} case {case} PANICKED: {panic} ({rerun})"),
        Err(_) => panic!(
            "{target} seed {seed} case {case}: still running after {:?} (unbounded time?) ({rerun})",
            started.elapsed()
        ),
    };
    if REFUSED.load(Ordering::SeqCst) != refused_before {
        panic!("{target} seed {seed} case {case}: tried an allocation over the limit ({rerun})");
    }
    accepted
}

/// Run `make_case(rng, case)` for the configured number of cases (or the one `FLINT_FUZZ_CASE`
/// names), each under [`run_case`]; prints how many ran and how long they took.
pub fn run_target<F>(target: &'static str, default_cases: u64, make_case: impl Fn(StdRng, u64) -> F)
where
    F: FnOnce() -> Outcome + Send + 'static,
{
    let seed = base_seed();
    let t0 = Instant::now();
    let only = env_u64("FLINT_FUZZ_CASE");
    let cases: Box<dyn Iterator<Item = u64>> = match only {
        Some(c) => Box::new(std::iter::once(c)),
        None => Box::new(0..case_count(default_cases)),
    };
    let (mut n, mut ok) = (0, 0);
    for case in cases {
        ok += u64::from(run_case(target, seed, case, make_case(case_rng(target, seed, case), case)));
        n += 1;
    }
    eprintln!("fuzz target {target}: {n} cases ({ok} accepted), seed {seed}, {:.2?}", t0.elapsed());
}
