//! What the router has sent each worker and how far along it is: the load its cost prices.
//!
//! Each routed request gets a [`Progress`], shared with the request's event stream, which counts
//! the tokens as they come out. Its prefill is priced at the uncached prompt estimated when the
//! request was routed until its first output arrives — a request still queued keeps that
//! discount (recomputing it from the cache as it is later would count blocks the request will
//! hit as work) — and its decode at `max_tokens × n` minus the tokens already out.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::cost::Work;

#[derive(Debug)]
pub struct Progress {
    uncached_prompt: usize,
    decode_budget: usize,
    seqs: usize,
    generated: AtomicUsize,
    prefilled: AtomicBool,
    over: AtomicBool,
}

impl Progress {
    pub fn new(uncached_prompt: usize, decode_budget: usize, seqs: usize) -> Arc<Self> {
        Arc::new(Self {
            uncached_prompt,
            decode_budget,
            seqs,
            generated: AtomicUsize::new(0),
            prefilled: AtomicBool::new(false),
            over: AtomicBool::new(false),
        })
    }

    /// `tokens` more output tokens (the first output also means the prompt is done).
    pub fn output(&self, tokens: usize) {
        self.prefilled.store(true, Ordering::Relaxed);
        self.generated.fetch_add(tokens, Ordering::Relaxed);
    }

    /// The request ended (finished, failed or dropped): no more work.
    pub fn end(&self) {
        self.over.store(true, Ordering::Relaxed);
    }

    pub fn remaining(&self) -> Work {
        if self.over.load(Ordering::Relaxed) {
            return Work::default();
        }
        let prefill = if self.prefilled.load(Ordering::Relaxed) { 0 } else { self.uncached_prompt };
        Work { prefill, decode: self.decode_budget.saturating_sub(self.generated.load(Ordering::Relaxed)) }
    }

    fn live_seqs(&self) -> usize {
        if self.over.load(Ordering::Relaxed) {
            0
        } else {
            self.seqs
        }
    }
}

/// One worker's routed requests still in flight.
#[derive(Debug, Default)]
pub struct Ledger(Mutex<Vec<Weak<Progress>>>);

impl Ledger {
    pub fn add(&self, p: &Arc<Progress>) {
        if let Ok(mut v) = self.0.lock() {
            v.push(Arc::downgrade(p));
        }
    }

    /// The work left on this worker and its sequences in flight; forgets requests that ended.
    pub fn load(&self) -> (Work, usize) {
        let Ok(mut v) = self.0.lock() else { return (Work::default(), 0) };
        let (mut work, mut seqs) = (Work::default(), 0);
        v.retain(|w| match w.upgrade() {
            Some(p) if !p.over.load(Ordering::Relaxed) => {
                work = work + p.remaining();
                seqs += p.live_seqs();
                true
            }
            _ => false,
        });
        (work, seqs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queued_request_keeps_its_routing_discount_until_it_starts() {
        let ledger = Ledger::default();
        // Routed with 496 of 516 prompt tokens cached: 20 to prefill, whatever the cache does
        // afterwards.
        let p = Progress::new(20, 128, 1);
        ledger.add(&p);
        assert_eq!(ledger.load(), (Work { prefill: 20, decode: 128 }, 1));
        p.output(1);
        assert_eq!(ledger.load(), (Work { prefill: 0, decode: 127 }, 1), "first token: prefill done");
        p.output(7);
        assert_eq!(ledger.load().0, Work { prefill: 0, decode: 120 });
        p.output(500);
        assert_eq!(ledger.load().0.decode, 0, "never below zero (a stop string may overshoot)");
    }

    #[test]
    fn ended_and_dropped_requests_leave_the_ledger() {
        let ledger = Ledger::default();
        let (a, b) = (Progress::new(10, 10, 2), Progress::new(5, 5, 1));
        ledger.add(&a);
        ledger.add(&b);
        assert_eq!(ledger.load(), (Work { prefill: 15, decode: 15 }, 3));
        a.end();
        assert_eq!(ledger.load(), (Work { prefill: 5, decode: 5 }, 1));
        drop(b);
        assert_eq!(ledger.load(), (Work::default(), 0));
        assert!(ledger.0.lock().unwrap().is_empty());
    }
}
