//! One request, start to finish: prefill the prompt, then decode token by token through the KV
//! cache, streaming text as it becomes valid UTF-8, until a stop id or `max_tokens`. This is the
//! single-sequence loop `flint generate` uses; the batching scheduler replaces it for serving.

use std::time::Instant;

use flint_model::{ContiguousKvCache, ForwardBatch, LogitsRows};

use crate::detokenizer::IncrementalDecoder;
use crate::loader::LoadedModel;
use crate::sampler::{Sampler, SamplingParams};
use crate::EngineError;

/// Prompts longer than this are prefilled in chunks, bounding the attention scores' memory.
const PREFILL_CHUNK: usize = 512;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra ids that end generation, beside the model's EOS ids.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was sampled.
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
}

#[derive(Debug, Clone)]
pub struct GenerateOutcome {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    /// Forward passes after the prefill (the first token comes out of the prefill itself).
    pub decode_steps: usize,
    pub decode_secs: f64,
}

impl GenerateOutcome {
    pub fn prefill_tok_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    /// Decode forward passes (one token each) per second.
    pub fn decode_tok_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_secs.max(1e-9)
    }
}

/// Run `req` on `lm`, calling `on_text` with each newly finalised piece of text.
pub fn generate(
    lm: &LoadedModel,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutcome, EngineError> {
    req.sampling.validate()?;
    let cfg = lm.model.config();
    if req.prompt_ids.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    let max_len = cfg.max_context_len();
    if req.prompt_ids.len() >= max_len {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {} tokens but the model's maximum context length is {max_len}",
            req.prompt_ids.len()
        )));
    }
    let mut cache = ContiguousKvCache::for_config(cfg, lm.model.dtype(), lm.model.device());
    let mut sampler = Sampler::new(req.sampling.clone(), lm.valid_vocab());
    let mut decoder = IncrementalDecoder::new(true);
    let stops: Vec<u32> = if req.ignore_eos { Vec::new() } else { lm.eos_token_ids.clone() }
        .into_iter()
        .chain(req.stop_token_ids.iter().copied())
        .collect();

    let t0 = Instant::now();
    let mut logits = None;
    for (i, chunk) in req.prompt_ids.chunks(PREFILL_CHUNK).enumerate() {
        let last = (i + 1) * PREFILL_CHUNK >= req.prompt_ids.len();
        let mut batch = ForwardBatch::new();
        batch.push(0, i * PREFILL_CHUNK, chunk, if last { LogitsRows::Last } else { LogitsRows::None });
        logits = lm.model.forward(&batch, &mut cache)?;
    }
    let mut row = first_row(logits)?;
    let prefill_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut out = Vec::new();
    let mut text = String::new();
    let mut finish = FinishReason::Length;
    let mut pos = req.prompt_ids.len();
    let mut decode_steps = 0;
    while out.len() < req.max_tokens {
        let tok = sampler.sample(&row, &[]);
        if stops.contains(&tok) {
            finish = FinishReason::Stop;
            break;
        }
        out.push(tok);
        let piece = decoder.push(&lm.tokenizer, tok)?;
        if !piece.is_empty() {
            on_text(&piece);
            text.push_str(&piece);
        }
        if out.len() == req.max_tokens || pos + 1 >= max_len {
            break;
        }
        let mut batch = ForwardBatch::new();
        batch.push(0, pos, &[tok], LogitsRows::Last);
        row = first_row(lm.model.forward(&batch, &mut cache)?)?;
        pos += 1;
        decode_steps += 1;
    }
    let rest = decoder.flush(&lm.tokenizer)?;
    if !rest.is_empty() {
        on_text(&rest);
        text.push_str(&rest);
    }
    Ok(GenerateOutcome {
        token_ids: out,
        text,
        finish_reason: finish,
        prompt_tokens: req.prompt_ids.len(),
        prefill_secs,
        decode_steps,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}

fn first_row(logits: Option<candle_core::Tensor>) -> Result<Vec<f32>, EngineError> {
    let t = logits.ok_or_else(|| EngineError::Internal("the model returned no logits".into()))?;
    Ok(t.get(0).and_then(|r| r.to_vec1::<f32>()).map_err(flint_model::ModelError::from)?)
}
