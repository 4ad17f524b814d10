//! `flint bench latency --bandwidth-probe`: one more generation run with a read of a large
//! buffer (the memory bandwidth at that moment, [`ReadProbe`]) before the first step and after
//! every step, so each decode step's weight stream is set against the bandwidth of its own
//! moments. On a shared host whose bandwidth moves from minute to minute, a decode's share of a
//! ceiling measured in other minutes (`scripts/membw.c` before and after) mostly says which
//! minutes each ran in.

use std::time::Instant;

use anyhow::Result;
use flint_engine::engine_core::EventSink;
use flint_engine::{EngineCore, PagedModelRunner, Request, RequestParams};
use flint_model::kernels::read_probe::ReadProbe;

/// The probe's buffer: 1 GiB, as `scripts/membw.c` reads (far beyond any cache).
pub const PROBE_BYTES: usize = 1 << 30;

/// A generation run's step times, and the probe's reads around them: `reads[i]` just before
/// step `i`, `reads[i + 1]` just after it.
pub struct ProbedRun {
    pub step_s: Vec<f64>,
    pub reads_gb_s: Vec<f64>,
}

/// Generate `gen` tokens after `prompt`, one step at a time, reading the probe before the first
/// step and after each.
pub fn run(
    core: &mut EngineCore<PagedModelRunner>,
    prompt: Vec<u32>,
    gen: usize,
    probe: &ReadProbe,
) -> Result<ProbedRun> {
    let sink: EventSink = Box::new(|_| true);
    let params = RequestParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
    core.add(Request { id: "bandwidth-probe".into(), prompt, params }, sink)?;
    let mut run = ProbedRun { step_s: Vec::new(), reads_gb_s: vec![probe.gb_per_s()] };
    while core.has_work() {
        let t0 = Instant::now();
        core.step();
        run.step_s.push(t0.elapsed().as_secs_f64());
        run.reads_gb_s.push(probe.gb_per_s());
    }
    Ok(run)
}

/// What a run says, for `weight_bytes` read a step.
#[derive(Debug, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Decode steps counted (every step but the first, which also admits the request).
    pub steps: usize,
    pub step_ms_median: f64,
    /// `weight_bytes` over the median step time.
    pub weights_gb_s: f64,
    pub read_gb_s_median: f64,
    pub read_gb_s_min: f64,
    pub read_gb_s_max: f64,
    /// Each step's weight bytes a second over the mean of the two reads around it: quartiles.
    pub share: [f64; 3],
}

impl ProbedRun {
    pub fn summary(&self, weight_bytes: f64) -> Option<Summary> {
        let steps = self.step_s.len().checked_sub(1).filter(|&n| n > 0)?;
        let mut shares: Vec<f64> = (1..=steps)
            .map(|i| {
                let around = (self.reads_gb_s[i] + self.reads_gb_s[i + 1]) / 2.0;
                weight_bytes / self.step_s[i] / 1e9 / around
            })
            .collect();
        let mut step_s = self.step_s[1..].to_vec();
        let mut reads = self.reads_gb_s.clone();
        let step = quartiles(&mut step_s)[1];
        let read = quartiles(&mut reads);
        Some(Summary {
            steps,
            step_ms_median: step * 1e3,
            weights_gb_s: weight_bytes / step / 1e9,
            read_gb_s_median: read[1],
            read_gb_s_min: reads[0],
            read_gb_s_max: reads[reads.len() - 1],
            share: quartiles(&mut shares),
        })
    }
}

impl Summary {
    pub fn line(&self, test: &str) -> String {
        format!(
            "bandwidth probe, {test}: {} steps, median {:.2} ms ({:.1} GB/s of weights); reads of 1 GiB between \
             steps: median {:.1} GB/s ({:.1} to {:.1}); each step's weight stream against the reads around it: \
             median {:.0}% (quartiles {:.0}% to {:.0}%)",
            self.steps,
            self.step_ms_median,
            self.weights_gb_s,
            self.read_gb_s_median,
            self.read_gb_s_min,
            self.read_gb_s_max,
            100.0 * self.share[1],
            100.0 * self.share[0],
            100.0 * self.share[2]
        )
    }
}

/// The lower quartile, median and upper quartile of `v` (sorted in place; nearest rank).
fn quartiles(v: &mut [f64]) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    [at(0.25), at(0.5), at(0.75)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_step_is_set_against_the_reads_around_it() {
        // 1 GB a step. Step 0 (admission) is left out; step 1 took 0.1 s between reads of 10 and
        // 30 GB/s (10 GB/s against 20: 50%), step 2 0.05 s between 30 and 20 (20 against 25: 80%).
        let run = ProbedRun { step_s: vec![9.0, 0.1, 0.05], reads_gb_s: vec![99.0, 10.0, 30.0, 20.0] };
        let s = run.summary(1e9).unwrap();
        assert_eq!(s.steps, 2);
        assert!((s.share[0] - 0.5).abs() < 1e-12 && (s.share[2] - 0.8).abs() < 1e-12, "{s:?}");
        assert_eq!((s.read_gb_s_min, s.read_gb_s_max), (10.0, 99.0));
        assert!(s.step_ms_median == 100.0 || s.step_ms_median == 50.0);
        assert!(ProbedRun { step_s: vec![1.0], reads_gb_s: vec![1.0, 1.0] }.summary(1.0).is_none(), "no decode step");
    }
}
