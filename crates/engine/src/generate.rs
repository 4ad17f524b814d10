//! One request, start to finish, on the calling thread: what `flint generate` runs. It drives the
//! same engine core as serving (paged cache, chunked prefill, sampler, stop handling) with a pool
//! sized for this one request, so the CLI exercises exactly the serving path.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::launch::{build_core, draft_kv_dtype, load_draft, plan, EngineConfig};
use crate::loader::LoadedModel;
use crate::request::{EngineEvent, FinishReason, Finished, Request, RequestParams};
use crate::speculative::{SpecCounters, SpeculativeConfig};
use crate::EngineError;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    /// `n` is ignored (one sample). `max_tokens` is clamped to what the context has left.
    pub params: RequestParams,
    /// How the KV cache stores keys and values (`None`: auto, f32).
    pub kv_cache_dtype: Option<flint_model::KvCacheDtype>,
    /// Speculative decoding (`None`: off).
    pub speculative: Option<SpeculativeConfig>,
}

#[derive(Debug, Clone)]
pub struct GenerateOutcome {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finished: Finished,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    /// Tokens after the prefill's (the first token comes out of the prefill itself).
    pub decode_steps: usize,
    pub decode_secs: f64,
    /// Speculative decoding's acceptance, when it was on.
    pub speculative: Option<SpecCounters>,
}

impl GenerateOutcome {
    pub fn prefill_tok_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    /// Tokens after the first per second of decoding (more than one per step with speculation).
    pub fn decode_tok_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_secs.max(1e-9)
    }
}

/// Run `req` on `lm`, calling `on_text` with each newly released piece of text.
pub fn generate(
    lm: &LoadedModel,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutcome, EngineError> {
    let prompt_len = req.prompt_ids.len();
    let model_len = lm.model.config().max_context_len();
    if prompt_len >= model_len {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {prompt_len} tokens but the model's maximum context length is {model_len}"
        )));
    }
    let mut params = req.params.clone();
    params.n = 1;
    params.max_tokens = params.max_tokens.min(model_len - prompt_len);
    let mut ec = EngineConfig::single_request(lm, prompt_len + params.max_tokens, req.kv_cache_dtype);
    // Drafts stay within max_tokens (the scheduler caps them), so the pool needs no more blocks;
    // a draft model's cache shares them and takes its own bytes per block.
    ec.speculative = req.speculative.clone();
    let draft = load_draft(lm, &ec)?;
    if let Some(d) = &draft {
        let bs = ec.block_size();
        let blocks = (prompt_len + params.max_tokens).div_ceil(bs);
        let extra = blocks * draft_kv_dtype(ec.dtype()).bytes_per_block(d.model.config(), bs);
        ec.kv_cache_memory = ec.kv_cache_memory.map(|b| b + extra);
    }
    let mut core = build_core(lm, draft.as_ref(), &plan(lm, draft.as_ref(), &ec)?)?;

    let events: Arc<Mutex<Vec<EngineEvent>>> = Arc::default();
    let sink_events = events.clone();
    let request = Request { id: "generate".into(), prompt: req.prompt_ids.clone(), params };
    core.add(request, Box::new(move |ev| sink_events.lock().map(|mut v| v.push(ev)).is_ok()))?;

    let t0 = Instant::now();
    let mut first_token_at = None;
    let (mut token_ids, mut text, mut finished) = (Vec::new(), String::new(), None);
    while core.has_work() {
        core.step();
        let batch =
            std::mem::take(&mut *events.lock().map_err(|_| EngineError::Internal("event log poisoned".into()))?);
        for ev in batch {
            match ev {
                EngineEvent::Output(o) => {
                    first_token_at.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                    token_ids.extend(o.token_ids);
                    if !o.text.is_empty() {
                        on_text(&o.text);
                        text.push_str(&o.text);
                    }
                    finished = o.finished.or(finished);
                }
                EngineEvent::Error(e) => return Err(EngineError::Internal(e)),
                EngineEvent::Rejected(e) => return Err(EngineError::InvalidRequest(e)),
                EngineEvent::Stopped(e) => return Err(EngineError::Unavailable(e)),
            }
        }
    }
    let prefill_secs = first_token_at.unwrap_or_else(|| t0.elapsed().as_secs_f64());
    Ok(GenerateOutcome {
        decode_steps: token_ids.len().saturating_sub(1),
        token_ids,
        text,
        finished: finished.unwrap_or(Finished { reason: FinishReason::Error, stop: None }),
        prompt_tokens: prompt_len,
        prefill_secs,
        decode_secs: t0.elapsed().as_secs_f64() - prefill_secs,
        speculative: core.speculative().map(|_| core.spec_counters.clone()),
    })
}
