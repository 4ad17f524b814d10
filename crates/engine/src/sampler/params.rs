//! A request's sampling settings. The rules they must follow are checked in
//! [`crate::validation`]; a sampler takes them as valid.

/// Validated sampling settings for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 0 disables; otherwise tokens less likely than `min_p` times the most likely one are dropped.
    pub min_p: f32,
    /// Subtracted once from the logit of every token the output already holds; 0 disables.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the output; 0 disables.
    pub frequency_penalty: f32,
    /// 1.0 disables; positive logits of prompt and output tokens are divided by it, negative ones
    /// multiplied, so it always makes a repeat less likely.
    pub repetition_penalty: f32,
    /// Added to the listed ids' logits (each entry is applied, so repeated ids add up).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Temperatures below 1e-5 (vLLM's threshold) are greedy: dividing by them overflows.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5 || self.top_k == 1
    }

    pub(super) fn counts_output(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    pub(super) fn tracks_repeats(&self) -> bool {
        self.repetition_penalty != 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_greedy() {
        assert!(SamplingParams::default().is_greedy());
    }
}
