//! Prometheus metrics under vLLM's names (so existing Grafana dashboards, routers and an inference
//! gateway's endpoint picker work unchanged), exposed through `prometheus-client`, the Prometheus
//! org's Rust client, in the classic text format (0.0.4) that vLLM serves.
//!
//! Two kinds of series, kept apart:
//! - recorded by the server as requests pass (latency histograms, finish and failure counters):
//!   `prometheus-client` metrics held by [`Metrics`];
//! - the engine's gauges and counters, per worker ([`engine`]) and the grammar-mask histogram
//!   ([`masks`]): read from the [`EngineStats`] snapshots the router already keeps, by collectors
//!   at scrape time, so the step loop copies nothing for `/metrics`.
//!
//! Every family keeps the name, labels, type and help it had when the text was written by hand
//! (`tests/fixtures/metrics_before.txt`); `model_name` is a constant label on every series.

mod engine;
mod grammar;
mod masks;

#[cfg(test)]
mod exposition;
#[cfg(test)]
mod fixture;
#[cfg(test)]
mod tests;

use std::borrow::Cow;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use flint_engine::structured::CompileStats;
use flint_engine::{CacheInfo, EngineStats, WorkerStatus};

use engine::EngineSnapshot;
use grammar::CompileSnapshot;
use masks::MaskSnapshot;

/// What `/metrics` answers with: the classic Prometheus text format, as vLLM's server does.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// vLLM's bucket boundaries (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// Finish reasons shown at zero before any request ends (more appear as they happen: tool_calls).
const SUCCESS_REASONS: [&str; 4] = ["stop", "length", "abort", "error"];
/// Failure reasons, all known up front.
const FAILURE_REASONS: [&str; 4] = ["overloaded", "validation", "aborted", "internal"];

/// Counters by one label (`finished_reason` or `reason`).
type ByReason = Family<[(&'static str, &'static str); 1], Counter>;

/// The series the server records; the engine's are read at scrape time.
pub struct Metrics {
    model_name: String,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    success: ByReason,
    failure: ByReason,
}

fn count(family: &ByReason, label: &'static str, reason: &'static str) {
    family.get_or_create(&[(label, reason)]).inc();
}

/// A histogram that skips what it cannot sum (a NaN or infinite duration), as before.
fn observe(h: &Histogram, v: f64) {
    if v.is_finite() {
        h.observe(v);
    }
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        let m = Self {
            model_name: model_name.to_string(),
            ttft: Histogram::new(TTFT_BUCKETS.iter().copied()),
            itl: Histogram::new(ITL_BUCKETS.iter().copied()),
            e2e: Histogram::new(LATENCY_BUCKETS.iter().copied()),
            queue: Histogram::new(LATENCY_BUCKETS.iter().copied()),
            success: ByReason::default(),
            failure: ByReason::default(),
        };
        // Zeros from the start, so a rate() over the first requests has a baseline.
        for r in SUCCESS_REASONS {
            drop(m.success.get_or_create(&[("finished_reason", r)]));
        }
        for r in FAILURE_REASONS {
            drop(m.failure.get_or_create(&[("reason", r)]));
        }
        m
    }

    pub fn ttft(&self, s: f64) {
        observe(&self.ttft, s);
    }

    pub fn itl(&self, s: f64) {
        observe(&self.itl, s);
    }

    pub fn queue_time(&self, s: f64) {
        observe(&self.queue, s);
    }

    /// A request that ran to an end (one count per request, by its first choice's reason).
    pub fn finished(&self, reason: &'static str, e2e: f64) {
        observe(&self.e2e, e2e);
        count(&self.success, "finished_reason", reason);
    }

    /// A request whose client went away: vLLM counts it as finished with reason `abort`; flint's
    /// failure counter also says why.
    pub fn aborted(&self) {
        count(&self.success, "finished_reason", "abort");
        count(&self.failure, "reason", "aborted");
    }

    /// A request refused or lost: overloaded, validation, aborted (client gone), internal.
    pub fn failed(&self, reason: &'static str) {
        count(&self.failure, "reason", reason);
    }

    /// The exposition text: `st` the whole server's totals (unlabeled series), `workers` each
    /// worker's own (`flint:worker_…` with a `worker` label); `cache` and `compiles` are `None`
    /// while the model loads.
    pub fn render(
        &self,
        st: EngineStats,
        workers: Vec<WorkerStatus>,
        cache: Option<CacheInfo>,
        compiles: Option<CompileStats>,
    ) -> String {
        let model = (Cow::Borrowed("model_name"), Cow::Owned(self.model_name.clone()));
        // A registry per scrape: it only holds handles (the histograms and counters are shared
        // behind `Arc`s) and this scrape's snapshot, in the order the families have always had.
        let mut registry = Registry::with_labels(std::iter::once(model));
        let masks = MaskSnapshot(st.grammar_masks);
        registry.register_collector(Box::new(EngineSnapshot { total: st, workers, cache }));
        let server = registry.sub_registry_with_labels(std::iter::empty());
        // The registry ends each help with a full stop.
        server.register("vllm:request_success", "Finished requests by finish reason", self.success.clone());
        server.register("flint:request_failure", "Requests refused or lost, by reason", self.failure.clone());
        server.register("vllm:time_to_first_token_seconds", "Time to first token", self.ttft.clone());
        server.register("vllm:inter_token_latency_seconds", "Time between output tokens", self.itl.clone());
        server.register("vllm:e2e_request_latency_seconds", "End-to-end request latency", self.e2e.clone());
        server.register("vllm:request_queue_time_seconds", "Time from arrival to first scheduling", self.queue.clone());
        server.register_collector(Box::new(masks));
        if let Some(c) = compiles {
            server.register_collector(Box::new(CompileSnapshot(c)));
        }
        let mut out = String::new();
        if let Err(e) = prometheus_text::encode(&mut out, &registry) {
            // Writing to a String cannot fail; should an encoder refuse, say so and serve the rest.
            tracing::warn!("/metrics: encoding stopped: {e}");
        }
        out
    }
}
