//! The grammar compile queue (structured outputs, forced tool calls): how many constraints are
//! compiling and waiting, how many were compiled, and how many were dropped unstarted because
//! their request had gone (see `flint_engine::structured`'s compile queue).

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::TypedMetric;

use flint_engine::structured::CompileStats;

#[derive(Debug)]
pub(super) struct CompileSnapshot(pub CompileStats);

fn one<M: EncodeMetric + TypedMetric>(enc: &mut DescriptorEncoder, name: &str, help: &str, m: M) -> fmt::Result {
    m.encode(enc.encode_descriptor(name, help, None, M::TYPE)?.encode_family(&Vec::<(&str, &str)>::new())?)
}

impl Collector for CompileSnapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let s = &self.0;
        let gauge = |v: usize| ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
        one(&mut enc, "flint:grammar_compile_threads", "Constraints that may compile at once.", gauge(s.threads))?;
        one(&mut enc, "flint:grammar_compiles_running", "Constraints compiling now.", gauge(s.running))?;
        one(&mut enc, "flint:grammar_compiles_queued", "Constraints waiting for a compile thread.", gauge(s.queued))?;
        one(&mut enc, "flint:grammar_compiles", "Constraints compiled (cache misses).", ConstCounter::new(s.started))?;
        one(
            &mut enc,
            "flint:grammar_compiles_skipped",
            "Queued compiles dropped unstarted: their request had timed out or gone.",
            ConstCounter::new(s.skipped),
        )
    }
}
