//! A worker's prefill and decode rates, tracked from its real step times.
//!
//! Decode is priced by the batch it runs at: a decode step reads every weight once whatever its
//! rows, so its time is close to `base + per_row × rows`, and the decode rate of a worker running
//! `B` sequences is `B / (base + per_row × B)`. A rate measured at one batch size would price a
//! worker about to run 24 sequences as if it ran them one at a time — and route a burst by
//! single-stream speed, which at a batch of 24 is the wrong order (measured: see
//! docs/benchmarks.md, "Several workers and the router"). The two terms are an exponentially
//! weighted least-squares fit over decode-only steps (the start-up profile runs a step batch of
//! 1 and one of 8, so both are known before the first request).
//!
//! A step with prompt tokens gives a prefill sample (tokens / seconds), after taking out what its
//! decode rows cost by the fit (at least a quarter of the step is left to the prompt, so one
//! noisy estimate cannot make prefill look free), exponentially weighted.

/// Weight of a new prefill sample.
const PREFILL_ALPHA: f64 = 0.3;
/// Per decode step, the old samples' weight is multiplied by this (a window of ~100 steps).
const DECODE_DECAY: f64 = 0.99;

/// Decode step time as `base_secs + per_row_secs × rows`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeCost {
    pub base_secs: f64,
    pub per_row_secs: f64,
}

impl DecodeCost {
    /// Seconds of one decode step over `rows` sequences.
    pub fn step_secs(&self, rows: usize) -> f64 {
        self.base_secs + self.per_row_secs * rows as f64
    }

    /// Aggregate decode tokens per second at a batch of `rows` sequences; 0 until measured.
    pub fn rate_at(&self, rows: usize) -> f64 {
        let t = self.step_secs(rows.max(1));
        if t > 0.0 && t.is_finite() {
            rows.max(1) as f64 / t
        } else {
            0.0
        }
    }
}

/// Exponentially weighted sums for the least-squares fit of step time against rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Fit {
    w: f64,
    x: f64,
    xx: f64,
    y: f64,
    xy: f64,
}

impl Fit {
    fn add(&mut self, rows: f64, secs: f64) {
        let d = DECODE_DECAY;
        self.w = self.w * d + 1.0;
        self.x = self.x * d + rows;
        self.xx = self.xx * d + rows * rows;
        self.y = self.y * d + secs;
        self.xy = self.xy * d + rows * secs;
    }

    fn cost(&self) -> DecodeCost {
        if self.w <= 0.0 || self.x <= 0.0 {
            return DecodeCost::default();
        }
        let det = self.w * self.xx - self.x * self.x;
        // Rows spread over at least about one row's width: fit both terms. Otherwise (every
        // step at the same batch) nothing says how time grows with rows: price rows as
        // independent, the conservative reading (no batching gain assumed).
        if det > 1e-9 * self.w * self.w {
            let per_row = (self.w * self.xy - self.x * self.y) / det;
            let base = (self.y - per_row * self.x) / self.w;
            if per_row >= 0.0 && base >= 0.0 {
                return DecodeCost { base_secs: base, per_row_secs: per_row };
            }
            if per_row < 0.0 {
                // Bigger batches measured faster (noise): one step costs what steps cost on average.
                return DecodeCost { base_secs: self.y / self.w, per_row_secs: 0.0 };
            }
        }
        DecodeCost { base_secs: 0.0, per_row_secs: self.y / self.x }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepRates {
    prefill: Option<f64>,
    decode: Fit,
}

fn ewma(old: Option<f64>, sample: f64, alpha: f64) -> Option<f64> {
    if !sample.is_finite() || sample <= 0.0 {
        return old;
    }
    Some(old.map_or(sample, |o| o + alpha * (sample - o)))
}

impl StepRates {
    /// A step of `prefill` prompt tokens and `decode` decode rows took `secs`.
    pub fn observe(&mut self, prefill: usize, decode: usize, secs: f64) {
        if secs <= 0.0 || !secs.is_finite() || prefill + decode == 0 {
            return;
        }
        if prefill == 0 {
            self.decode.add(decode as f64, secs);
            return;
        }
        let decode_secs = if decode > 0 { self.decode.cost().step_secs(decode) } else { 0.0 };
        let prefill_secs = (secs - decode_secs).max(secs / 4.0);
        self.prefill = ewma(self.prefill, prefill as f64 / prefill_secs, PREFILL_ALPHA);
    }

    /// Prompt tokens per second; 0 until measured.
    pub fn prefill(&self) -> f64 {
        self.prefill.unwrap_or(0.0)
    }

    /// Decode step time by batch; zero until measured.
    pub fn decode(&self) -> DecodeCost {
        self.decode.cost()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_cost_separates_the_per_step_and_per_row_terms() {
        let mut r = StepRates::default();
        assert_eq!(r.decode().rate_at(4), 0.0, "unmeasured");
        // 20 ms per step plus 5 ms per row, at batches 1 and 8.
        for _ in 0..20 {
            r.observe(0, 1, 0.025);
            r.observe(0, 8, 0.060);
        }
        let c = r.decode();
        assert!((c.base_secs - 0.020).abs() < 1e-9 && (c.per_row_secs - 0.005).abs() < 1e-9, "{c:?}");
        assert!((c.rate_at(1) - 40.0).abs() < 1e-6);
        assert!((c.rate_at(24) - 24.0 / 0.14).abs() < 1e-6, "a batch of 24 decodes 171 tok/s, not 40");
        // Newer steps outweigh old ones: the worker slowed down by half.
        for _ in 0..400 {
            r.observe(0, 1, 0.050);
            r.observe(0, 8, 0.120);
        }
        assert!((r.decode().step_secs(8) - 0.120).abs() < 1e-3, "{:?}", r.decode());
    }

    #[test]
    fn one_batch_size_alone_prices_rows_independently() {
        let mut r = StepRates::default();
        r.observe(0, 4, 0.1);
        r.observe(0, 4, 0.1);
        let c = r.decode();
        assert_eq!(c.base_secs, 0.0);
        assert!((c.rate_at(1) - 40.0).abs() < 1e-9 && (c.rate_at(10) - 40.0).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn noisy_batches_never_give_negative_terms() {
        let mut r = StepRates::default();
        r.observe(0, 1, 0.050);
        r.observe(0, 8, 0.040);
        let c = r.decode();
        assert!(c.base_secs >= 0.0 && c.per_row_secs >= 0.0, "{c:?}");
        assert!((c.step_secs(3) - 0.045).abs() < 1e-4, "the weighted mean step: {c:?}");
    }

    #[test]
    fn a_mixed_step_charges_its_decode_rows_by_the_fit() {
        let mut r = StepRates::default();
        r.observe(512, 0, 2.0);
        assert!((r.prefill() - 256.0).abs() < 1e-9, "first sample taken whole");
        let mut r = StepRates::default();
        r.observe(0, 5, 0.5); // 0.1 s per row
                              // 100 prompt tokens and 5 decode rows in 1.5 s: 0.5 s of decode, 1 s of prefill.
        r.observe(100, 5, 1.5);
        assert!((r.prefill() - 100.0).abs() < 1e-9, "{}", r.prefill());
        // A decode estimate that would leave nothing for the prompt: a quarter of the step is.
        let mut r = StepRates::default();
        r.observe(0, 1, 1.0);
        r.observe(10, 4, 2.0);
        assert!((r.prefill() - 20.0).abs() < 1e-9, "{}", r.prefill());
    }

    #[test]
    fn empty_or_instant_steps_change_nothing() {
        let mut r = StepRates::default();
        r.observe(0, 0, 1.0);
        r.observe(5, 0, 0.0);
        r.observe(0, 3, f64::NAN);
        assert_eq!(r, StepRates::default());
    }
}
