//! Progress of long work — loading and packing a checkpoint, writing a synthetic one, a
//! benchmark's requests — reported to whoever shows it. The model crate knows no terminal: the
//! binary installs a [`ProgressSink`] (a progress bar on a terminal, log lines otherwise), and the
//! server reads [`current`] for its 503 body while the model loads.
//!
//! With no sink installed a task costs two atomic adds per step: libraries and tests pay nothing
//! they can notice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Shows tasks as they advance. Called from whichever thread does the work.
pub trait ProgressSink: Send + Sync {
    /// A task of `total` units (`unit` names them: "layers", "tensors", "requests") began.
    fn start(&self, name: &str, unit: &str, total: u64);
    /// `done` of the current task's units are finished.
    fn advance(&self, done: u64);
    /// The current task ended (finished or abandoned).
    fn finish(&self);
}

static SINK: OnceLock<Box<dyn ProgressSink>> = OnceLock::new();
static CURRENT: Mutex<Option<Arc<Shared>>> = Mutex::new(None);

/// Install the process's sink (once; later calls are ignored).
pub fn set_sink(sink: Box<dyn ProgressSink>) {
    let _ = SINK.set(sink);
}

struct Shared {
    name: String,
    unit: String,
    total: u64,
    done: AtomicU64,
}

/// How far the task running now is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub name: String,
    pub unit: String,
    pub done: u64,
    pub total: u64,
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = (self.done * 100).checked_div(self.total).unwrap_or(100);
        write!(f, "{}: {}/{} {} ({pct}%)", self.name, self.done, self.total, self.unit)
    }
}

/// The task running now, if any (the latest begun, when several run at once).
pub fn current() -> Option<Snapshot> {
    let cur = CURRENT.lock().ok()?.clone()?;
    Some(cur.snapshot())
}

impl Shared {
    fn snapshot(&self) -> Snapshot {
        let done = self.done.load(Ordering::Relaxed).min(self.total);
        Snapshot { name: self.name.clone(), unit: self.unit.clone(), done, total: self.total }
    }
}

/// A task in progress; it ends when dropped (on success or on an early error return alike).
pub struct Task {
    shared: Arc<Shared>,
}

/// Begin a task of `total` `unit`s.
pub fn task(name: &str, unit: &str, total: u64) -> Task {
    let shared = Arc::new(Shared { name: name.to_string(), unit: unit.to_string(), total, done: AtomicU64::new(0) });
    if let Ok(mut cur) = CURRENT.lock() {
        *cur = Some(shared.clone());
    }
    if let Some(s) = SINK.get() {
        s.start(name, unit, total);
    }
    Task { shared }
}

impl Task {
    pub fn snapshot(&self) -> Snapshot {
        self.shared.snapshot()
    }

    /// `n` more units are done.
    pub fn inc(&self, n: u64) {
        let done = self.shared.done.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(s) = SINK.get() {
            s.advance(done.min(self.shared.total));
        }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        if let Ok(mut cur) = CURRENT.lock() {
            if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, &self.shared)) {
                *cur = None;
            }
        }
        if let Some(s) = SINK.get() {
            s.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_counts_its_units_and_says_how_far_it_is() {
        // Other tests load models (tasks of their own) in parallel: only this task's own
        // snapshot is deterministic here.
        let t = task("loading weights", "layers", 4);
        t.inc(1);
        t.inc(2);
        assert_eq!(t.snapshot().to_string(), "loading weights: 3/4 layers (75%)");
        t.inc(5);
        assert_eq!((t.snapshot().done, t.snapshot().total), (4, 4), "never past the total");
    }
}
