//! Every rule a request's parameters must follow, checked here once, each failure typed with the
//! parameter it concerns. The server converts [`InvalidParam`] into its 400 by type (naming the
//! field as the endpoint spells it); the CLI prints it as one line.
//!
//! What is left to the callers is only what a rule cannot see from here: the JSON shape of a
//! field (the server's protocol module), the server's own `--max-logprobs`, and whether a prompt
//! fits a particular worker's pool (the scheduler's admission check).

use crate::engine_core::ModelInfo;
use crate::request::{Request, RequestParams, MAX_LOGPROBS, MAX_N};
use crate::sampler::SamplingParams;
use crate::scheduler::SchedulerConfig;
use crate::EngineError;

/// A request parameter, named as OpenAI's API names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// The prompt's tokens (`prompt`, `messages` or `input`, by endpoint).
    Prompt,
    N,
    MaxTokens,
    MinTokens,
    Temperature,
    TopP,
    MinP,
    PresencePenalty,
    FrequencyPenalty,
    RepetitionPenalty,
    LogitBias,
    StopTokenIds,
    /// Top logprobs per output token (`logprobs` or `top_logprobs`, by endpoint).
    Logprobs,
    PromptLogprobs,
}

impl Param {
    /// The field's name in a completions request.
    pub fn name(self) -> &'static str {
        match self {
            Param::Prompt => "prompt",
            Param::N => "n",
            Param::MaxTokens => "max_tokens",
            Param::MinTokens => "min_tokens",
            Param::Temperature => "temperature",
            Param::TopP => "top_p",
            Param::MinP => "min_p",
            Param::PresencePenalty => "presence_penalty",
            Param::FrequencyPenalty => "frequency_penalty",
            Param::RepetitionPenalty => "repetition_penalty",
            Param::LogitBias => "logit_bias",
            Param::StopTokenIds => "stop_token_ids",
            Param::Logprobs => "logprobs",
            Param::PromptLogprobs => "prompt_logprobs",
        }
    }
}

/// A parameter outside what flint accepts; the message says what it must be and what it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidParam {
    pub param: Param,
    pub message: String,
}

fn invalid(param: Param, message: String) -> Result<(), InvalidParam> {
    Err(InvalidParam { param, message })
}

/// `lo <= v <= hi` (NaN fails), else "`name` must be between lo and hi, got v".
fn range(param: Param, v: f32, lo: f32, hi: f32) -> Result<(), InvalidParam> {
    if v >= lo && v <= hi {
        return Ok(());
    }
    invalid(param, format!("`{}` must be between {lo} and {hi}, got {v}", param.name()))
}

impl SamplingParams {
    /// OpenAI's ranges (vLLM's where OpenAI has none). Token ids of `logit_bias` are checked
    /// against the vocabulary by [`validate_params`].
    pub fn validate(&self) -> Result<(), InvalidParam> {
        range(Param::Temperature, self.temperature, 0.0, 2.0)?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(Param::TopP, format!("`top_p` must be in (0, 1], got {}", self.top_p));
        }
        range(Param::MinP, self.min_p, 0.0, 1.0)?;
        range(Param::PresencePenalty, self.presence_penalty, -2.0, 2.0)?;
        range(Param::FrequencyPenalty, self.frequency_penalty, -2.0, 2.0)?;
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            let got = self.repetition_penalty;
            return invalid(Param::RepetitionPenalty, format!("`repetition_penalty` must be in (0, 2], got {got}"));
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            let msg = format!("`logit_bias` values must be in [-100, 100], got {bias} for token {token}");
            return invalid(Param::LogitBias, msg);
        }
        Ok(())
    }
}

/// The rules on the parameters alone (no prompt): cheap, so the server runs them before it
/// renders and tokenizes a prompt. Token ids must be ids of the model's real vocabulary (the
/// tokenizer's, not the checkpoint's padded embedding rows, which are never sampled).
pub fn validate_params(p: &RequestParams, info: &ModelInfo) -> Result<(), InvalidParam> {
    p.sampling.validate()?;
    if p.n == 0 || p.n > MAX_N {
        return invalid(Param::N, format!("`n` must be between 1 and {MAX_N}, got {}", p.n));
    }
    if p.min_tokens > p.max_tokens && p.max_tokens > 0 {
        let msg = format!("`min_tokens` ({}) must not exceed `max_tokens` ({})", p.min_tokens, p.max_tokens);
        return invalid(Param::MinTokens, msg);
    }
    for (param, k) in [(Param::Logprobs, p.logprobs), (Param::PromptLogprobs, p.prompt_logprobs)] {
        if let Some(k) = k.filter(|&k| k > MAX_LOGPROBS) {
            return invalid(param, format!("`{}` must be at most {MAX_LOGPROBS}, got {k}", param.name()));
        }
    }
    let vocab = info.valid_vocab;
    if let Some(&(t, _)) = p.sampling.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return invalid(
            Param::LogitBias,
            format!("`logit_bias` token id {t} is outside the vocabulary (size {vocab})"),
        );
    }
    if let Some(&t) = p.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        let msg = format!("`stop_token_ids` entry {t} is outside the vocabulary (size {vocab})");
        return invalid(Param::StopTokenIds, msg);
    }
    Ok(())
}

/// Everything [`validate_params`] checks, plus the prompt and `max_tokens`, and whether the
/// request fits this engine's context and pool at all.
pub fn validate(req: &Request, info: &ModelInfo, sched: &SchedulerConfig) -> Result<(), EngineError> {
    let p = &req.params;
    validate_params(p, info)?;
    if p.pooling.is_some() && (p.max_tokens != 0 || p.n != 1) {
        invalid(Param::MaxTokens, "an embedding request generates nothing: `max_tokens` 0 and `n` 1".to_string())?;
    }
    if p.max_tokens == 0 && p.prompt_logprobs.is_none() && p.pooling.is_none() {
        let msg = "`max_tokens` must be at least 1 (0 only scores the prompt, with `prompt_logprobs`)".to_string();
        invalid(Param::MaxTokens, msg)?;
    }
    if p.min_tokens > p.max_tokens {
        invalid(Param::MinTokens, format!("`min_tokens` ({}) must not exceed `max_tokens` (0)", p.min_tokens))?;
    }
    if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
        invalid(Param::Prompt, format!("prompt token id {t} is outside the vocabulary (size {})", info.vocab_size))?;
    }
    sched.check_admissible(req.prompt.len(), p.max_tokens)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ModelInfo {
        ModelInfo { vocab_size: 160, valid_vocab: 150, eos_token_ids: vec![1] }
    }

    fn param_of(p: RequestParams) -> Param {
        validate_params(&p, &info()).unwrap_err().param
    }

    #[test]
    fn each_rule_names_its_parameter() {
        let base = RequestParams { max_tokens: 8, ..RequestParams::default() };
        let with = |f: &dyn Fn(&mut RequestParams)| {
            let mut p = base.clone();
            f(&mut p);
            p
        };
        assert_eq!(validate_params(&base, &info()), Ok(()));
        assert_eq!(param_of(with(&|p| p.sampling.temperature = 2.5)), Param::Temperature);
        assert_eq!(param_of(with(&|p| p.sampling.temperature = f32::NAN)), Param::Temperature);
        assert_eq!(param_of(with(&|p| p.sampling.top_p = 0.0)), Param::TopP);
        assert_eq!(param_of(with(&|p| p.sampling.min_p = -0.1)), Param::MinP);
        assert_eq!(param_of(with(&|p| p.sampling.presence_penalty = 3.0)), Param::PresencePenalty);
        assert_eq!(param_of(with(&|p| p.sampling.frequency_penalty = -3.0)), Param::FrequencyPenalty);
        assert_eq!(param_of(with(&|p| p.sampling.repetition_penalty = 0.0)), Param::RepetitionPenalty);
        assert_eq!(param_of(with(&|p| p.sampling.logit_bias = vec![(3, 101.0)])), Param::LogitBias);
        assert_eq!(param_of(with(&|p| p.n = 0)), Param::N);
        assert_eq!(param_of(with(&|p| p.min_tokens = 9)), Param::MinTokens);
        assert_eq!(param_of(with(&|p| p.logprobs = Some(MAX_LOGPROBS + 1))), Param::Logprobs);
        assert_eq!(param_of(with(&|p| p.prompt_logprobs = Some(MAX_LOGPROBS + 1))), Param::PromptLogprobs);
    }

    #[test]
    fn sampling_messages_name_the_parameter_and_bounds_are_inclusive() {
        let cases = [
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: 1.5, ..Default::default() }, "min_p"),
            (SamplingParams { min_p: f32::NAN, ..Default::default() }, "min_p"),
            (SamplingParams { presence_penalty: 2.5, ..Default::default() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: -2.1, ..Default::default() }, "frequency_penalty"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { repetition_penalty: f32::INFINITY, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { logit_bias: vec![(3, 1.0), (4, 101.0)], ..Default::default() }, "logit_bias"),
            (SamplingParams { logit_bias: vec![(3, f32::NAN)], ..Default::default() }, "logit_bias"),
        ];
        for (p, name) in cases {
            let err = p.validate().unwrap_err().to_string();
            assert!(err.contains(name), "{name}: {err}");
        }
        let ok = SamplingParams {
            min_p: 1.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            repetition_penalty: 0.5,
            logit_bias: vec![(1, -100.0), (2, 100.0)],
            ..Default::default()
        };
        assert_eq!(ok.validate(), Ok(()));
    }

    #[test]
    fn token_ids_are_checked_against_the_real_vocabulary() {
        let p = |bias: u32, stop: u32| RequestParams {
            max_tokens: 8,
            stop_token_ids: vec![stop],
            sampling: SamplingParams { logit_bias: vec![(bias, 1.0)], ..SamplingParams::default() },
            ..RequestParams::default()
        };
        assert_eq!(validate_params(&p(149, 149), &info()), Ok(()));
        // 150..160 are padding rows: ids the model has weights for but no token.
        assert_eq!(param_of(p(150, 1)), Param::LogitBias);
        assert_eq!(param_of(p(1, 150)), Param::StopTokenIds);
        let e = validate_params(&p(1, 155), &info()).unwrap_err();
        assert!(e.message.contains("155") && e.message.contains("150"), "{e}");
    }

    #[test]
    fn prompt_and_max_tokens_are_checked_with_the_request() {
        let sched = SchedulerConfig {
            max_num_batched_tokens: 64,
            max_num_seqs: 4,
            max_model_len: 64,
            block_size: 16,
            num_blocks: 8,
            enable_prefix_caching: true,
            quantize_full_blocks: false,
        };
        let req = |prompt: Vec<u32>, max_tokens| Request {
            id: "r".into(),
            prompt,
            params: RequestParams { max_tokens, ..RequestParams::default() },
        };
        let param = |r: Request| match validate(&r, &info(), &sched) {
            Err(EngineError::InvalidParam(e)) => e.param,
            other => panic!("{other:?}"),
        };
        assert!(validate(&req(vec![1, 2], 4), &info(), &sched).is_ok());
        assert_eq!(param(req(vec![1, 200], 4)), Param::Prompt);
        assert_eq!(param(req(vec![1], 0)), Param::MaxTokens);
    }
}
