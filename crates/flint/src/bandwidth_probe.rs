//! `flint bench latency --bandwidth-probe`: one more generation run, of one sequence or of several
//! decoding together (`--probe-seqs`), with a read of a large buffer (the memory bandwidth at that
//! moment, [`ReadProbe`]) before the first step and after every step, so each decode step's
//! weight stream is set against the bandwidth of its own moments. On a shared host whose
//! bandwidth moves from minute to minute, a decode's share of a ceiling measured in other minutes
//! (`scripts/membw.c` before and after) mostly says which minutes each ran in. A step's weight
//! bytes are what its kernels counted ([`streamed`]): for a mixture of experts, the experts its
//! batch chose in that step.

use std::time::Instant;

use anyhow::Result;
use flint_engine::engine_core::EventSink;
use flint_engine::{EngineCore, PagedModelRunner, Request, RequestParams};
use flint_model::kernels::read_probe::ReadProbe;
use flint_model::kernels::streamed;

/// The probe's buffer: 1 GiB, as `scripts/membw.c` reads (far beyond any cache).
pub const PROBE_BYTES: usize = 1 << 30;

/// A generation run's steps, and the probe's reads around them: `reads[i]` just before step `i`,
/// `reads[i + 1]` just after it.
pub struct ProbedRun {
    pub step_s: Vec<f64>,
    pub reads_gb_s: Vec<f64>,
    /// The weight bytes each step's kernels streamed.
    pub bytes: Vec<u64>,
    /// Whether the step was a decode step of every sequence (one token each), the steps counted.
    pub decode: Vec<bool>,
    /// Tokens of the longest prompt (context included): the KV cache the first decode step reads.
    pub prompt_tokens: usize,
}

/// Generate `gen` tokens after each of `prompts`, all at once, one step at a time, reading the
/// probe before the first step and after each. The engine must have room for them all.
pub fn run(
    core: &mut EngineCore<PagedModelRunner>,
    prompts: Vec<Vec<u32>>,
    gen: usize,
    probe: &ReadProbe,
) -> Result<ProbedRun> {
    let (n, prompt_tokens) = (prompts.len(), prompts.iter().map(Vec::len).max().unwrap_or(0));
    for (i, prompt) in prompts.into_iter().enumerate() {
        let sink: EventSink = Box::new(|_| true);
        let params = RequestParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
        core.add(Request { id: format!("bandwidth-probe-{i}"), prompt, params }, sink)?;
    }
    let mut run = ProbedRun {
        step_s: Vec::new(),
        reads_gb_s: vec![probe.gb_per_s()],
        bytes: Vec::new(),
        decode: Vec::new(),
        prompt_tokens,
    };
    while core.has_work() {
        let (b0, t0) = (streamed::weight_bytes(), Instant::now());
        let plan = core.step();
        run.step_s.push(t0.elapsed().as_secs_f64());
        run.bytes.push(streamed::weight_bytes().wrapping_sub(b0));
        run.decode.push(plan.chunks.len() == n && plan.num_tokens == n);
        run.reads_gb_s.push(probe.gb_per_s());
    }
    Ok(run)
}

/// What a run says.
#[derive(Debug, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Sequences decoding together.
    pub seqs: usize,
    /// Tokens of the longest of their prompts.
    pub prompt_tokens: usize,
    /// Decode steps counted: those of every sequence at once, but the run's first step (which also
    /// admits the requests).
    pub steps: usize,
    pub step_ms_median: f64,
    /// The weight bytes of a counted step (median; a mixture's steps differ with the routing).
    pub step_gb_median: f64,
    /// Each counted step's weight bytes over its time: the median.
    pub weights_gb_s: f64,
    pub read_gb_s_median: f64,
    pub read_gb_s_min: f64,
    pub read_gb_s_max: f64,
    /// Each counted step's weight bytes a second over the mean of the two reads around it:
    /// quartiles.
    pub share: [f64; 3],
}

impl ProbedRun {
    /// `None` when no step counts (a run of one step, or kernels that count nothing).
    pub fn summary(&self, seqs: usize) -> Option<Summary> {
        let counted: Vec<usize> = (1..self.step_s.len()).filter(|&i| self.decode[i] && self.bytes[i] > 0).collect();
        if counted.is_empty() {
            return None;
        }
        let rate = |i: usize| self.bytes[i] as f64 / self.step_s[i] / 1e9;
        let mut shares: Vec<f64> =
            counted.iter().map(|&i| rate(i) / ((self.reads_gb_s[i] + self.reads_gb_s[i + 1]) / 2.0)).collect();
        let mut rates: Vec<f64> = counted.iter().map(|&i| rate(i)).collect();
        let mut step_s: Vec<f64> = counted.iter().map(|&i| self.step_s[i]).collect();
        let mut gb: Vec<f64> = counted.iter().map(|&i| self.bytes[i] as f64 / 1e9).collect();
        let mut reads = self.reads_gb_s.clone();
        let read = quartiles(&mut reads);
        Some(Summary {
            seqs,
            prompt_tokens: self.prompt_tokens,
            steps: counted.len(),
            step_ms_median: quartiles(&mut step_s)[1] * 1e3,
            step_gb_median: quartiles(&mut gb)[1],
            weights_gb_s: quartiles(&mut rates)[1],
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
            "bandwidth probe, {test}, {} sequence(s) after {}-token prompts: {} decode steps, median {:.2} ms and {:.3} GB of weights \
             ({:.1} GB/s); reads of 1 GiB between steps: median {:.1} GB/s ({:.1} to {:.1}); each step's weight \
             stream against the reads around it: median {:.0}% (quartiles {:.0}% to {:.0}%)",
            self.seqs,
            self.prompt_tokens,
            self.steps,
            self.step_ms_median,
            self.step_gb_median,
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
        // Step 0 (admission) is left out; step 1 streamed 1 GB in 0.1 s between reads of 10 and 30
        // GB/s (10 GB/s against 20: 50%), step 2 2 GB in 0.1 s between 30 and 20 (20 against 25:
        // 80%); step 3 was not a decode step of every sequence (a prefill, or one sequence left).
        let run = ProbedRun {
            step_s: vec![9.0, 0.1, 0.1, 0.01],
            reads_gb_s: vec![99.0, 10.0, 30.0, 20.0, 1.0],
            bytes: vec![5_000_000_000, 1_000_000_000, 2_000_000_000, 1_000_000_000],
            decode: vec![true, true, true, false],
            prompt_tokens: 7,
        };
        let s = run.summary(2).unwrap();
        assert_eq!((s.seqs, s.prompt_tokens, s.steps), (2, 7, 2));
        assert!((s.share[0] - 0.5).abs() < 1e-12 && (s.share[2] - 0.8).abs() < 1e-12, "{s:?}");
        assert_eq!((s.read_gb_s_min, s.read_gb_s_max), (1.0, 99.0));
        assert!((s.step_ms_median - 100.0).abs() < 1e-9, "{s:?}");
        assert!(s.step_gb_median == 1.0 || s.step_gb_median == 2.0, "{s:?}");
        assert!(s.weights_gb_s == 10.0 || s.weights_gb_s == 20.0, "{s:?}");
        let one = |decode: bool, bytes: u64| ProbedRun {
            step_s: vec![1.0, 1.0],
            reads_gb_s: vec![1.0; 3],
            bytes: vec![bytes; 2],
            decode: vec![decode; 2],
            prompt_tokens: 1,
        };
        assert!(one(true, 1).summary(1).is_some());
        assert!(one(false, 1).summary(1).is_none(), "no decode step");
        assert!(one(true, 0).summary(1).is_none(), "kernels that count nothing");
    }
}
