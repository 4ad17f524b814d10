//! Grammar-mask time (structured outputs) as a Prometheus histogram. The engine keeps the counts
//! per bucket in its stats (plain data, so a snapshot stays cheap); this encodes one scrape's
//! snapshot, the encoder making the buckets cumulative and adding `+Inf`.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use flint_engine::structured::{MaskHistogram, MASK_BUCKETS};

#[derive(Debug)]
pub(super) struct MaskSnapshot(pub MaskHistogram);

impl Collector for MaskSnapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let h = &self.0;
        // Per bucket, not cumulative; the last count (above every bound) is the `+Inf` bucket's
        // part, which the encoder writes as the total count.
        let buckets: [(f64, u64); MASK_BUCKETS.len()] = std::array::from_fn(|i| (MASK_BUCKETS[i], h.counts[i]));
        let mut metric = enc.encode_descriptor(
            "flint:structured_output_mask_seconds",
            "Grammar time per constrained token: its mask, then taking the drawn token.",
            None,
            MetricType::Histogram,
        )?;
        metric.encode_histogram::<NoLabelSet>(h.sum_secs, h.count, &buckets, None)
    }
}
