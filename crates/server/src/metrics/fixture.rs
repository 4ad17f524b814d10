//! A fixed server state for the exposition tests: two workers, every engine field set to its own
//! value, speculation on, grammar masks timed, the cache known, and each server-recorded series
//! observed. `tests/fixtures/metrics_before.txt` is what the hand-written renderer wrote for it
//! (and `metrics_before_loading.txt` for a server still loading its model), captured before the
//! switch to `prometheus-client`: the reference that `/metrics` must keep.

use flint_engine::router::rates::DecodeCost;
use flint_engine::structured::MaskHistogram;
use flint_engine::{CacheInfo, EngineStats, WorkerStatus};

use super::Metrics;

/// A model name with a quote and a backslash, so label escaping is compared too.
pub(super) const MODEL: &str = "org/demo-\"7b\"\\v1";

pub(super) struct Scrape {
    pub metrics: Metrics,
    pub stats: EngineStats,
    pub workers: Vec<WorkerStatus>,
    pub cache: CacheInfo,
}

fn masks(secs: &[f64]) -> MaskHistogram {
    let mut h = MaskHistogram::default();
    for &s in secs {
        h.observe(s);
    }
    h
}

fn engine(seed: u64, spec: bool) -> EngineStats {
    let mut per_pos = [0; flint_engine::speculative::MAX_SPECULATIVE_TOKENS];
    per_pos[..3].copy_from_slice(&[seed * 7, seed * 5, seed * 2]);
    EngineStats {
        num_running: 2 + seed as usize,
        num_waiting: 3 + seed as usize,
        kv_cache_usage: 0.125 * (seed + 1) as f64,
        num_blocks: 64,
        block_size: 16,
        prefix_cache_queries: 1000 + seed,
        prefix_cache_hits: 400 + seed,
        num_preemptions: 4 + seed,
        prompt_tokens: 5000 + seed,
        generation_tokens: 6000 + seed,
        steps: 700 + seed,
        failed_steps: seed,
        healthy: true,
        spec_enabled: spec,
        spec_drafts: 80 + seed,
        spec_draft_tokens: 240 + seed,
        spec_accepted_tokens: 150 + seed,
        spec_accepted_per_pos: per_pos,
        spec_positions: if spec { 3 } else { 0 },
        grammar_masks: masks(&[1e-5, 3e-5, 3e-5, 2e-4, 2e-3, 0.02, 1.0]),
        prefill_rate: 1234.5 + seed as f64,
        decode_cost: DecodeCost { base_secs: 0.0125 * (seed + 1) as f64, per_row_secs: 0.00075 * (seed + 1) as f64 },
    }
}

/// The state, with server-recorded series observed in a fixed order.
pub(super) fn scrape() -> Scrape {
    let metrics = Metrics::new(MODEL);
    for s in [0.0005, 0.03, 0.03, 0.3, 3.0, 3000.0] {
        metrics.ttft(s);
    }
    metrics.ttft(f64::NAN);
    for s in [0.005, 0.012, 0.09, 0.09, 0.6, 25.0, 100.0] {
        metrics.itl(s);
    }
    for s in [0.0, 0.04, 1.7, 12.0] {
        metrics.queue_time(s);
    }
    metrics.finished("stop", 1.2);
    metrics.finished("stop", 4.5);
    metrics.finished("length", 9000.0);
    metrics.finished("tool_calls", 0.7);
    metrics.aborted();
    metrics.failed("overloaded");
    metrics.failed("validation");
    metrics.failed("validation");
    let stats = engine(10, true);
    let cpu0 = WorkerStatus { name: "cpu0".into(), healthy: true, stats: engine(1, true), decisions: 17 };
    let cpu1 = WorkerStatus {
        name: "cpu1".into(),
        healthy: false,
        stats: EngineStats { healthy: false, ..engine(2, true) },
        decisions: 3,
    };
    let cache = CacheInfo {
        dtype: "int8".into(),
        block_size: 16,
        num_blocks: 64,
        bytes_per_token: 6264.25,
        capacity_tokens: 1024,
        prefix_caching: true,
    };
    Scrape { metrics, stats, workers: vec![cpu0, cpu1], cache }
}

impl Scrape {
    /// `/metrics` for this state.
    pub fn render(&self) -> String {
        self.metrics.render(self.stats, self.workers.clone(), Some(self.cache.clone()), None)
    }

    /// `/metrics` while the model loads: no workers, no cache, speculation off.
    pub fn render_loading(&self) -> String {
        self.metrics.render(EngineStats::default(), Vec::new(), None, None)
    }
}

/// The committed fixture `name`.
pub(super) fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
