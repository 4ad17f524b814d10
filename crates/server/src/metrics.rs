//! Prometheus metrics under vLLM's names (so existing Grafana dashboards and routers work): engine
//! gauges and counters read from the engine's stats, request histograms recorded by the server.

use flint_engine::structured::{MaskHistogram, MASK_BUCKETS};
use std::fmt::Write;
use std::sync::Mutex;

use flint_engine::{CacheInfo, EngineStats, WorkerStatus};

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

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        for (c, &b) in self.counts.iter_mut().zip(self.bounds) {
            if v <= b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

#[derive(Debug, Clone)]
struct Inner {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    /// stop, length, abort, error, tool_calls.
    success: Vec<(&'static str, u64)>,
    /// overloaded, validation, aborted, internal.
    failure: Vec<(&'static str, u64)>,
}

pub struct Metrics {
    model_name: String,
    inner: Mutex<Inner>,
}

fn bump(v: &mut Vec<(&'static str, u64)>, key: &'static str) {
    match v.iter_mut().find(|(k, _)| *k == key) {
        Some((_, c)) => *c += 1,
        None => v.push((key, 1)),
    }
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        let success = ["stop", "length", "abort", "error"].iter().map(|&k| (k, 0)).collect();
        let failure = ["overloaded", "validation", "aborted", "internal"].iter().map(|&k| (k, 0)).collect();
        Self {
            model_name: model_name.to_string(),
            inner: Mutex::new(Inner {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(LATENCY_BUCKETS),
                queue: Histogram::new(LATENCY_BUCKETS),
                success,
                failure,
            }),
        }
    }

    fn with(&self, f: impl FnOnce(&mut Inner)) {
        if let Ok(mut g) = self.inner.lock() {
            f(&mut g);
        }
    }

    pub fn ttft(&self, s: f64) {
        self.with(|m| m.ttft.observe(s));
    }

    pub fn itl(&self, s: f64) {
        self.with(|m| m.itl.observe(s));
    }

    pub fn queue_time(&self, s: f64) {
        self.with(|m| m.queue.observe(s));
    }

    /// A request that ran to an end (one count per request, by its first choice's reason).
    pub fn finished(&self, reason: &'static str, e2e: f64) {
        self.with(|m| {
            m.e2e.observe(e2e);
            bump(&mut m.success, reason);
        });
    }

    /// A request whose client went away: vLLM counts it as finished with reason `abort`; flint's
    /// failure counter also says why.
    pub fn aborted(&self) {
        self.with(|m| {
            bump(&mut m.success, "abort");
            bump(&mut m.failure, "aborted");
        });
    }

    /// A request refused or lost: overloaded, validation, aborted (client gone), internal.
    pub fn failed(&self, reason: &'static str) {
        self.with(|m| bump(&mut m.failure, reason));
    }

    /// The exposition text: `st` the whole server's totals (unlabeled series), `workers` each
    /// worker's own (the same names with a `worker` label); `cache` is `None` while the model loads.
    pub fn render(&self, st: &EngineStats, workers: &[WorkerStatus], cache: Option<&CacheInfo>) -> String {
        let labels = format!("model_name=\"{}\"", escape(&self.model_name));
        let worker_labels: Vec<(String, &WorkerStatus)> =
            workers.iter().map(|w| (format!("{labels},worker=\"{}\"", escape(&w.name)), w)).collect();
        let mut out = String::new();
        // The total first: a scraper that keeps one series per name (an inference gateway's
        // endpoint picker) sees the whole server.
        let mut per_worker = |name: &str, help: &str, kind: &str, v: &dyn Fn(&EngineStats) -> f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {}", v(st));
            for (l, w) in &worker_labels {
                let _ = writeln!(out, "{name}{{{l}}} {}", v(&w.stats));
            }
        };
        per_worker("vllm:num_requests_running", "Requests in the running batch.", "gauge", &|s| s.num_running as f64);
        per_worker("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "gauge", &|s| {
            s.num_waiting as f64
        });
        per_worker("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "gauge", &|s| {
            s.kv_cache_usage
        });
        per_worker(
            "vllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            "counter",
            &|s| s.prefix_cache_queries as f64,
        );
        per_worker("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", "counter", &|s| {
            s.prefix_cache_hits as f64
        });
        per_worker("vllm:num_preemptions_total", "Preemptions (recompute).", "counter", &|s| s.num_preemptions as f64);
        per_worker("vllm:prompt_tokens_total", "Prompt tokens submitted.", "counter", &|s| s.prompt_tokens as f64);
        per_worker("vllm:generation_tokens_total", "Tokens generated.", "counter", &|s| s.generation_tokens as f64);
        let mut labeled = |name: &str, help: &str, kind: &str, v: &dyn Fn(&WorkerStatus) -> f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (l, w) in &worker_labels {
                let _ = writeln!(out, "{name}{{{l}}} {}", v(w));
            }
        };
        labeled("flint:router_decisions_total", "Requests the router sent to each worker.", "counter", &|w| {
            w.decisions as f64
        });
        labeled("flint:worker_healthy", "1 while the worker's step loop runs.", "gauge", &|w| {
            f64::from(u8::from(w.healthy))
        });
        labeled("flint:prefill_rate_tokens_per_second", "Prefill throughput the router prices with.", "gauge", &|w| {
            w.stats.prefill_rate
        });
        labeled(
            "flint:decode_step_base_seconds",
            "Decode step time the router prices with: the part paid once per step.",
            "gauge",
            &|w| w.stats.decode_cost.base_secs,
        );
        labeled(
            "flint:decode_step_per_sequence_seconds",
            "Decode step time the router prices with: the part paid per sequence in the batch.",
            "gauge",
            &|w| w.stats.decode_cost.per_row_secs,
        );
        let mut gauge = |name: &str, help: &str, kind: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}");
        };
        if let Some(spec) = st.spec_counters() {
            gauge(
                "vllm:spec_decode_num_drafts_total",
                "Verifications that carried a draft.",
                "counter",
                spec.drafts as f64,
            );
            gauge(
                "vllm:spec_decode_num_draft_tokens_total",
                "Draft tokens proposed.",
                "counter",
                spec.draft_tokens as f64,
            );
            gauge(
                "vllm:spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted.",
                "counter",
                spec.accepted_tokens as f64,
            );
        }
        gauge("vllm:cache_config_info", "KV-cache configuration.", "gauge", 1.0);
        if let Some(c) = cache {
            gauge(
                "flint:kv_cache_bytes_per_token",
                "KV-cache bytes per token (full blocks).",
                "gauge",
                c.bytes_per_token,
            );
            gauge("flint:kv_cache_capacity_tokens", "Tokens the KV pool holds.", "gauge", c.capacity_tokens as f64);
        }
        if let Some(spec) = st.spec_counters() {
            let name = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
            let _ =
                writeln!(out, "# HELP {name} Drafts whose token at this position was accepted.\n# TYPE {name} counter");
            for (pos, n) in spec.accepted_per_pos.iter().enumerate() {
                let _ = writeln!(out, "{name}{{{labels},position=\"{pos}\"}} {n}");
            }
        }
        let Ok(m) = self.inner.lock().map(|g| g.clone()) else { return out };
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Finished requests by finish reason.\n# TYPE vllm:request_success_total counter"
        );
        for (reason, c) in &m.success {
            let _ = writeln!(out, "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "# HELP flint:request_failure_total Requests refused or lost, by reason.\n# TYPE flint:request_failure_total counter"
        );
        for (reason, c) in &m.failure {
            let _ = writeln!(out, "flint:request_failure_total{{{labels},reason=\"{reason}\"}} {c}");
        }
        m.ttft.render(&mut out, "vllm:time_to_first_token_seconds", "Time to first token.", &labels);
        m.itl.render(&mut out, "vllm:inter_token_latency_seconds", "Time between output tokens.", &labels);
        m.e2e.render(&mut out, "vllm:e2e_request_latency_seconds", "End-to-end request latency.", &labels);
        m.queue.render(&mut out, "vllm:request_queue_time_seconds", "Time from arrival to first scheduling.", &labels);
        render_masks(&mut out, &st.grammar_masks, &labels);
        // The cache geometry as labels (vLLM's info-gauge convention) on the line written above.
        let geometry = match cache {
            Some(c) => format!(
                "block_size=\"{}\",num_gpu_blocks=\"{}\",cache_dtype=\"{}\",enable_prefix_caching=\"{}\",\
                 bytes_per_token=\"{:.1}\",capacity_tokens=\"{}\"",
                c.block_size, c.num_blocks, c.dtype, c.prefix_caching, c.bytes_per_token, c.capacity_tokens
            ),
            None => format!("block_size=\"{}\",num_gpu_blocks=\"{}\"", st.block_size, st.num_blocks),
        };
        out = out.replace(
            &format!("vllm:cache_config_info{{{labels}}} 1"),
            &format!("vllm:cache_config_info{{{labels},{geometry}}} 1"),
        );
        out
    }
}

/// A label value with Prometheus's escapes.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Grammar-mask time (structured outputs) as a Prometheus histogram (cumulative buckets).
fn render_masks(out: &mut String, h: &MaskHistogram, labels: &str) {
    let name = "flint:structured_output_mask_seconds";
    let _ = writeln!(out, "# HELP {name} Grammar time per constrained token: its mask, then taking the drawn token.\n# TYPE {name} histogram");
    let mut cum = 0;
    for (b, c) in MASK_BUCKETS.iter().zip(h.counts) {
        cum += c;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum_secs);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

#[cfg(test)]
mod fixture;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_and_histograms() {
        let m = Metrics::new("demo");
        m.ttft(0.03);
        m.ttft(3.0);
        m.finished("stop", 1.2);
        m.failed("overloaded");
        let cache = CacheInfo {
            dtype: "int8".into(),
            block_size: 128,
            num_blocks: 8,
            bytes_per_token: 6264.0,
            capacity_tokens: 1024,
            prefix_caching: true,
        };
        let stats =
            EngineStats { num_running: 2, kv_cache_usage: 0.25, block_size: 128, num_blocks: 8, ..Default::default() };
        let workers = [
            WorkerStatus {
                name: "cpu0".into(),
                healthy: true,
                stats: EngineStats { num_running: 2, ..stats },
                decisions: 5,
            },
            WorkerStatus { name: "cpu1".into(), healthy: false, stats: EngineStats::default(), decisions: 1 },
        ];
        let text = m.render(&stats, &workers, Some(&cache));
        assert!(text.contains("vllm:num_requests_running{model_name=\"demo\",worker=\"cpu0\"} 2"), "{text}");
        assert!(text.contains("vllm:num_requests_running{model_name=\"demo\",worker=\"cpu1\"} 0"), "{text}");
        assert!(text.contains("flint:router_decisions_total{model_name=\"demo\",worker=\"cpu0\"} 5"), "{text}");
        assert!(text.contains("flint:worker_healthy{model_name=\"demo\",worker=\"cpu1\"} 0"), "{text}");
        let total = text.find("vllm:num_requests_running{model_name=\"demo\"} 2").unwrap();
        let labeled = text.find("vllm:num_requests_running{model_name=\"demo\",worker=").unwrap();
        assert!(total < labeled, "the unlabeled total comes first");
        assert!(text.contains("vllm:num_requests_running{model_name=\"demo\"} 2"), "{text}");
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"demo\"} 0.25"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.04\"} 1"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"+Inf\"} 2"));
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"demo\"} 2"));
        assert!(text.contains("vllm:request_success_total{model_name=\"demo\",finished_reason=\"stop\"} 1"));
        assert!(text.contains("flint:request_failure_total{model_name=\"demo\",reason=\"overloaded\"} 1"));
        assert!(text.contains("block_size=\"128\",num_gpu_blocks=\"8\",cache_dtype=\"int8\""), "{text}");
        assert!(text.contains("capacity_tokens=\"1024\""));
        assert!(text.contains("flint:kv_cache_bytes_per_token{model_name=\"demo\"} 6264"));
        assert!(m.render(&stats, &[], None).contains("vllm:cache_config_info{model_name=\"demo\",block_size=\"128\""));
    }
}
