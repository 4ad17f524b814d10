//! A worker's prefill and decode rates, tracked from its real step times.
//!
//! A step that only decodes gives a decode sample (tokens / seconds: at the batch it ran, so
//! the rate is the worker's aggregate throughput, which is what the remaining decode budget of
//! all its requests is divided by). A step with prompt tokens gives a prefill sample, after
//! taking out the time its decode rows cost at the current decode rate (at least a quarter of
//! the step is left to the prompt, so one noisy decode estimate cannot make prefill look free).
//! Both are exponentially weighted; the first sample of each is taken whole.

/// Weight of a new decode sample (a step per token: many samples, each noisy).
const DECODE_ALPHA: f64 = 0.1;
/// Weight of a new prefill sample (fewer, larger steps).
const PREFILL_ALPHA: f64 = 0.3;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepRates {
    prefill: Option<f64>,
    decode: Option<f64>,
}

fn ewma(old: Option<f64>, sample: f64, alpha: f64) -> Option<f64> {
    if !sample.is_finite() || sample <= 0.0 {
        return old;
    }
    Some(old.map_or(sample, |o| o + alpha * (sample - o)))
}

impl StepRates {
    /// Rates measured elsewhere (the start-up profile); non-positive ones stay unmeasured.
    pub fn seeded(prefill: f64, decode: f64) -> Self {
        Self { prefill: ewma(None, prefill, 1.0), decode: ewma(None, decode, 1.0) }
    }

    /// A step of `prefill` prompt tokens and `decode` decode rows took `secs`.
    pub fn observe(&mut self, prefill: usize, decode: usize, secs: f64) {
        if secs <= 0.0 || prefill + decode == 0 {
            return;
        }
        if prefill == 0 {
            self.decode = ewma(self.decode, decode as f64 / secs, DECODE_ALPHA);
            return;
        }
        let decode_secs = self.decode.map_or(0.0, |r| decode as f64 / r);
        let prefill_secs = (secs - decode_secs).max(secs / 4.0);
        self.prefill = ewma(self.prefill, prefill as f64 / prefill_secs, PREFILL_ALPHA);
    }

    /// Tokens per second; 0 until measured.
    pub fn prefill(&self) -> f64 {
        self.prefill.unwrap_or(0.0)
    }

    pub fn decode(&self) -> f64 {
        self.decode.unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_samples_are_taken_whole_then_smoothed() {
        let mut r = StepRates::default();
        assert_eq!((r.prefill(), r.decode()), (0.0, 0.0));
        r.observe(0, 4, 0.1);
        assert!((r.decode() - 40.0).abs() < 1e-9);
        r.observe(0, 4, 0.05);
        assert!((r.decode() - 44.0).abs() < 1e-9, "40 + 0.1 × (80 − 40)");
        r.observe(512, 0, 2.0);
        assert!((r.prefill() - 256.0).abs() < 1e-9);
    }

    #[test]
    fn a_mixed_step_charges_its_decode_rows_at_the_decode_rate() {
        let mut r = StepRates::default();
        r.observe(0, 10, 1.0); // 10 tok/s decode
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
        assert_eq!(r, StepRates::default());
    }
}
