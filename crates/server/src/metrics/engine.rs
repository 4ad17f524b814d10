//! The engine's gauges and counters, encoded from one scrape's snapshot of the router: the whole
//! server's totals under vLLM's names, each worker's own under flint's (a `worker` label), the
//! router's pricing, speculative
//! decoding's counters and the KV cache's geometry. Nothing is copied per engine step: the step
//! loop already publishes [`EngineStats`]; this reads them when Prometheus asks.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::TypedMetric;

use flint_engine::{CacheInfo, EngineStats, WorkerStatus};

/// One scrape's view of the engine.
#[derive(Debug)]
pub(super) struct EngineSnapshot {
    /// The whole server (every worker added up).
    pub total: EngineStats,
    pub workers: Vec<WorkerStatus>,
    /// `None` while the model loads.
    pub cache: Option<CacheInfo>,
}

/// A series' labels beyond the registry's `model_name`.
type Labels<'a> = Vec<(&'static str, &'a str)>;

fn gauge(v: impl TryInto<i64>) -> ConstGauge<i64> {
    ConstGauge::new(v.try_into().unwrap_or(i64::MAX))
}

fn ratio(v: f64) -> ConstGauge<f64> {
    ConstGauge::new(v)
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

/// One family: `series` its (labels, value) pairs; a family with no series (no workers yet) is
/// still described. Counters are named without `_total`: the encoder adds it, to the samples and to
/// the `HELP`/`TYPE` lines alike.
fn family<'a, M: EncodeMetric + TypedMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (Labels<'a>, M)>,
) -> fmt::Result {
    let mut metric = enc.encode_descriptor(name, help, None, M::TYPE)?;
    for (labels, m) in series {
        m.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

impl EngineSnapshot {
    /// vLLM's family holds the whole server, unlabeled (what dashboards built for vLLM, a
    /// scraper that keeps one series per name and an inference gateway's endpoint picker
    /// read); each worker's own series are `flint:worker_<name>` with a `worker` label. Apart, so
    /// `sum(vllm:num_requests_running)` is the server's count, not twice it.
    fn per_worker<M: EncodeMetric + TypedMetric>(
        &self,
        enc: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        value: impl Fn(&EngineStats) -> M,
    ) -> fmt::Result {
        family(enc, name, help, [(Labels::new(), value(&self.total))])?;
        let own = format!("flint:worker_{}", name.trim_start_matches("vllm:"));
        let own_help = format!("{}, per worker.", help.trim_end_matches('.'));
        let workers = self.workers.iter().map(|w| (vec![("worker", w.name.as_str())], value(&w.stats)));
        family(enc, &own, &own_help, workers)
    }

    /// Only per worker: the router's own view of each.
    fn each_worker<M: EncodeMetric + TypedMetric>(
        &self,
        enc: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        value: impl Fn(&WorkerStatus) -> M,
    ) -> fmt::Result {
        family(enc, name, help, self.workers.iter().map(|w| (vec![("worker", w.name.as_str())], value(w))))
    }

    /// vLLM's info-gauge convention: the geometry as labels on a gauge at 1.
    fn cache_config(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let values: Vec<(&'static str, String)> = match &self.cache {
            Some(c) => vec![
                ("block_size", c.block_size.to_string()),
                ("num_gpu_blocks", c.num_blocks.to_string()),
                ("cache_dtype", c.dtype.clone()),
                ("enable_prefix_caching", c.prefix_caching.to_string()),
                ("bytes_per_token", format!("{:.1}", c.bytes_per_token)),
                ("capacity_tokens", c.capacity_tokens.to_string()),
            ],
            None => vec![
                ("block_size", self.total.block_size.to_string()),
                ("num_gpu_blocks", self.total.num_blocks.to_string()),
            ],
        };
        let labels = values.iter().map(|(k, v)| (*k, v.as_str())).collect();
        family(enc, "vllm:cache_config_info", "KV-cache configuration.", [(labels, gauge(1))])
    }
}

impl Collector for EngineSnapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let e = &mut enc;
        self.per_worker(e, "vllm:num_requests_running", "Requests in the running batch.", |s| gauge(s.num_running))?;
        self.per_worker(e, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", |s| gauge(s.num_waiting))?;
        self.per_worker(e, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", |s| {
            ratio(s.kv_cache_usage)
        })?;
        self.per_worker(e, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", |s| {
            counter(s.prefix_cache_queries)
        })?;
        self.per_worker(e, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", |s| {
            counter(s.prefix_cache_hits)
        })?;
        self.per_worker(e, "vllm:num_preemptions", "Preemptions (recompute).", |s| counter(s.num_preemptions))?;
        self.per_worker(e, "vllm:prompt_tokens", "Prompt tokens submitted.", |s| counter(s.prompt_tokens))?;
        self.per_worker(e, "vllm:generation_tokens", "Tokens generated.", |s| counter(s.generation_tokens))?;
        self.each_worker(e, "flint:router_decisions", "Requests the router sent to each worker.", |w| {
            counter(w.decisions)
        })?;
        self.each_worker(e, "flint:worker_healthy", "1 while the worker's step loop runs.", |w| gauge(w.healthy))?;
        self.each_worker(
            e,
            "flint:prefill_rate_tokens_per_second",
            "Prefill throughput the router prices with.",
            |w| ratio(w.stats.prefill_rate),
        )?;
        self.each_worker(
            e,
            "flint:decode_step_base_seconds",
            "Decode step time the router prices with: the part paid once per step.",
            |w| ratio(w.stats.decode_cost.base_secs),
        )?;
        self.each_worker(
            e,
            "flint:decode_step_per_sequence_seconds",
            "Decode step time the router prices with: the part paid per sequence in the batch.",
            |w| ratio(w.stats.decode_cost.per_row_secs),
        )?;
        let spec = self.total.spec_counters();
        if let Some(spec) = &spec {
            let one = |v| [(Labels::new(), counter(v))];
            family(e, "vllm:spec_decode_num_drafts", "Verifications that carried a draft.", one(spec.drafts))?;
            family(e, "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", one(spec.draft_tokens))?;
            family(e, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", one(spec.accepted_tokens))?;
        }
        self.cache_config(e)?;
        if let Some(c) = &self.cache {
            family(
                e,
                "flint:kv_cache_bytes_per_token",
                "KV-cache bytes per token (full blocks).",
                [(Labels::new(), ratio(c.bytes_per_token))],
            )?;
            family(
                e,
                "flint:kv_cache_capacity_tokens",
                "Tokens the KV pool holds.",
                [(Labels::new(), gauge(c.capacity_tokens))],
            )?;
        }
        if let Some(spec) = &spec {
            let positions: Vec<String> = (0..spec.accepted_per_pos.len()).map(|p| p.to_string()).collect();
            let series = positions
                .iter()
                .zip(&spec.accepted_per_pos)
                .map(|(p, &n)| (vec![("position", p.as_str())], counter(n)));
            family(
                e,
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position was accepted.",
                series,
            )?;
        }
        Ok(())
    }
}
