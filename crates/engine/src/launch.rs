//! From a loaded model and the serving flags to a running engine: size the paged KV pool from the
//! memory budget, settle the maximum model length, and build the engine core.

use crate::engine_core::{EngineCore, ModelInfo};
use crate::loader::{available_memory, LoadedModel};
use crate::runner::{DraftModel, PagedModelRunner};
use crate::scheduler::SchedulerConfig;
use crate::speculative::SpeculativeConfig;
use crate::EngineError;
use candle_core::DType;
use flint_model::device::{memory_info, DeviceSpec};
use flint_model::{DeviceKvCache, KvCacheDtype, KvPool, PagedKvCache};

/// The serving knobs (`--block-size`, `--kv-cache-memory`, …), defaults chosen for a CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block; `None`: the cache dtype's default (16, or 128 for int8).
    pub block_size: Option<usize>,
    /// How the KV cache stores keys and values; `None` (`auto`): f32, what the CPU computes in.
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// Bytes for the KV pool; `None`: a quarter of the memory available after loading, capped at
    /// what `max_num_seqs` sequences of `max_model_len` tokens could ever use.
    pub kv_cache_memory: Option<usize>,
    /// Tokens per step. On a CPU a step of 512 prompt tokens already takes a few seconds on a
    /// 0.5B model; more would stall running streams for longer.
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// `None`: the model's own context length.
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// Speculative decoding (`--speculative-config`); `None`: off.
    pub speculative: Option<SpeculativeConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: None,
            kv_cache_dtype: None,
            kv_cache_memory: None,
            max_num_batched_tokens: 512,
            max_num_seqs: 64,
            max_model_len: None,
            enable_prefix_caching: true,
            speculative: None,
        }
    }
}

impl EngineConfig {
    /// One sequence of up to `tokens` tokens and a pool of exactly that size, its cache stored as
    /// `dtype` (`flint generate`, single-stream benchmarks).
    pub fn single_request(lm: &LoadedModel, tokens: usize, dtype: Option<KvCacheDtype>) -> Self {
        let ec = Self { kv_cache_dtype: dtype, max_num_seqs: 1, ..Self::default() };
        let bs = ec.block_size();
        let bytes = tokens.div_ceil(bs) * ec.dtype().bytes_per_block(lm.model.config(), bs);
        Self { kv_cache_memory: Some(bytes), ..ec }
    }

    /// The cache dtype `auto` stands for: f32.
    pub fn dtype(&self) -> KvCacheDtype {
        self.kv_cache_dtype.unwrap_or(KvCacheDtype::F32)
    }

    pub fn block_size(&self) -> usize {
        self.block_size.unwrap_or_else(|| self.dtype().default_block_size())
    }
}

/// What [`plan`] decided, for the start-up banner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPlan {
    pub sched: SchedulerConfig,
    pub kv_cache_dtype: KvCacheDtype,
    pub bytes_per_block: usize,
    pub pool_bytes: usize,
    /// Int8: f32 scratch for one block being filled; at most one per running sequence (plus the
    /// blocks one prefill chunk spans) exists at a time, outside `pool_bytes`.
    pub staging_bytes_per_block: usize,
    /// False for bf16/f16 compute: outputs may then vary with the batch (say so at start-up).
    pub batch_invariant: bool,
    pub speculative: Option<SpeculativeConfig>,
    /// With a draft model: its share of `bytes_per_block` (its own cache over the same blocks).
    pub draft_bytes_per_block: usize,
    /// The model's device and compute dtype when the pool lives in GPU memory (it then stores
    /// the compute dtype, and `kv_cache_dtype` is not used); `None` for the host pool.
    pub device_pool: Option<(DeviceSpec, DType)>,
}

impl PoolPlan {
    pub fn tokens(&self) -> usize {
        self.sched.num_blocks * self.sched.block_size
    }

    /// Bytes per token of full blocks.
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_per_block as f64 / self.sched.block_size.max(1) as f64
    }

    /// The cache's geometry for the start-up banner and `/metrics`.
    pub fn cache_info(&self) -> CacheInfo {
        CacheInfo {
            dtype: self.dtype_name(),
            block_size: self.sched.block_size,
            num_blocks: self.sched.num_blocks,
            bytes_per_token: self.bytes_per_token(),
            capacity_tokens: self.tokens(),
            prefix_caching: self.sched.enable_prefix_caching,
        }
    }

    /// What the pool stores: `f32`, `int8`, … for the host pool; `bf16 on cuda:0` for a device one.
    pub fn dtype_name(&self) -> String {
        match self.device_pool {
            Some((device, dtype)) => format!("{} on {device}", dtype.as_str()),
            None => self.kv_cache_dtype.to_string(),
        }
    }

    /// One line: dtype, bytes per token, capacity, staging.
    pub fn describe(&self) -> String {
        let staging = if self.staging_bytes_per_block > 0 {
            format!(
                " + f32 staging for blocks being filled, {:.1} MiB each (one per running sequence)",
                self.staging_bytes_per_block as f64 / (1 << 20) as f64
            )
        } else {
            String::new()
        };
        let draft = if self.draft_bytes_per_block > 0 {
            format!(
                " (the draft model's {} cache included: {:.1} bytes/token)",
                draft_kv_dtype(self.kv_cache_dtype),
                self.draft_bytes_per_block as f64 / self.sched.block_size.max(1) as f64
            )
        } else {
            String::new()
        };
        format!(
            "KV cache {} | {:.1} bytes/token{draft} | {} blocks x {} tokens = {} tokens ({:.1} MiB){staging}",
            self.dtype_name(),
            self.bytes_per_token(),
            self.sched.num_blocks,
            self.sched.block_size,
            self.tokens(),
            self.pool_bytes as f64 / (1 << 20) as f64,
        )
    }
}

/// The KV cache as the server reports it (no tensors).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheInfo {
    pub dtype: String,
    pub block_size: usize,
    pub num_blocks: usize,
    pub bytes_per_token: f64,
    pub capacity_tokens: usize,
    pub prefix_caching: bool,
}

/// The draft model's cache stores what the target's does, except that an int8 target gets a bf16
/// draft cache: proposing writes positions that the next step writes again, which a cache that
/// quantizes blocks as they fill cannot take.
pub fn draft_kv_dtype(target: KvCacheDtype) -> KvCacheDtype {
    match target {
        KvCacheDtype::Int8 => KvCacheDtype::Bf16,
        other => other,
    }
}

/// The draft model `ec`'s speculative config names, loaded and checked against `lm`: the same
/// vocabulary and tokenizer, or an error naming what differs.
pub fn load_draft(lm: &LoadedModel, ec: &EngineConfig) -> Result<Option<LoadedModel>, EngineError> {
    let Some(path) = ec.speculative.as_ref().and_then(|s| s.draft_model.as_deref()) else { return Ok(None) };
    let draft = LoadedModel::load(Some(path), &candle_core::Device::Cpu, None)?;
    same_vocabulary(lm, &draft)
        .map_err(|m| EngineError::InvalidRequest(format!("--speculative-config: the draft model {path} {m}")))?;
    Ok(Some(draft))
}

/// `Ok` when `other` has `lm`'s vocabulary and tokenizer (a draft model, or another worker's
/// weights); else what differs, as the end of a sentence about `other`.
pub fn same_vocabulary(lm: &LoadedModel, other: &LoadedModel) -> Result<(), String> {
    let (t, d) = (lm.model.config().vocab_size, other.model.config().vocab_size);
    if t != d {
        return Err(format!("has {d} vocabulary rows and the target {t}: it must share the target's vocabulary"));
    }
    let (t, d) = (lm.valid_vocab(), other.valid_vocab());
    if t != d {
        return Err(format!("has a tokenizer of {d} tokens and the target one of {t}: they must be the same"));
    }
    let probe = "Hello, world! 你好 — def f(x):\n    return x ** 2  # ünïcödé";
    let enc = |m: &LoadedModel| m.tokenizer.encode(probe, false).map_err(|e| e.to_string());
    if enc(lm)? != enc(other)? {
        return Err("tokenizes text differently from the target: they must share a tokenizer".into());
    }
    Ok(())
}

/// Size the pool and the limits for `lm` (and its draft model, if any) under `ec`.
pub fn plan(lm: &LoadedModel, draft: Option<&LoadedModel>, ec: &EngineConfig) -> Result<PoolPlan, EngineError> {
    let cfg = lm.model.config();
    let bad = |m: String| Err(EngineError::InvalidRequest(m));
    let (dtype, block_size) = (ec.dtype(), ec.block_size());
    if block_size == 0 || block_size > 1024 {
        return bad(format!("--block-size must be between 1 and 1024, got {block_size}"));
    }
    if ec.max_num_batched_tokens == 0 || ec.max_num_seqs == 0 {
        return bad("--max-num-batched-tokens and --max-num-seqs must be at least 1".into());
    }
    let model_len = cfg.max_context_len();
    let max_model_len = match ec.max_model_len {
        Some(0) => return bad("--max-model-len must be at least 1".into()),
        Some(l) if l > model_len => {
            return bad(format!("--max-model-len {l} exceeds the model's context length {model_len}"));
        }
        Some(l) => l,
        None => model_len,
    };
    let wants_draft = ec.speculative.as_ref().is_some_and(|s| s.draft_model.is_some());
    if wants_draft != draft.is_some() {
        return Err(EngineError::Internal("the draft model must be loaded exactly when the config names one".into()));
    }
    let device_pool = device_pool(lm, ec, draft.is_some())?;
    let draft_bytes_per_block =
        draft.map_or(0, |d| draft_kv_dtype(dtype).bytes_per_block(d.model.config(), block_size));
    let bytes_per_block = match device_pool {
        Some((_, dt)) => DeviceKvCache::bytes_per_block(cfg, dt, block_size),
        None => dtype.bytes_per_block(cfg, block_size) + draft_bytes_per_block,
    };
    let useful = ec.max_num_seqs.saturating_mul(max_model_len.div_ceil(block_size)).saturating_mul(bytes_per_block);
    let pool_bytes = match (ec.kv_cache_memory, memory_info(lm.model.device())) {
        (Some(b), _) => b,
        // On a GPU, as vLLM's default utilisation: 90% of what the weights left free.
        (None, Some((free, _))) => (free / 10 * 9).min(useful),
        (None, None) => (available_memory().unwrap_or(4 << 30) / 4).min(useful),
    };
    let num_blocks = pool_bytes / bytes_per_block;
    if num_blocks == 0 {
        return bad(format!(
            "--kv-cache-memory {pool_bytes} bytes holds no block; one {dtype} block of {block_size} tokens needs \
             {bytes_per_block} bytes"
        ));
    }
    // A sequence longer than the pool could never run: the pool bounds the context too.
    let max_model_len = max_model_len.min(num_blocks * block_size);
    Ok(PoolPlan {
        sched: SchedulerConfig {
            max_num_batched_tokens: ec.max_num_batched_tokens,
            max_num_seqs: ec.max_num_seqs,
            max_model_len,
            block_size,
            num_blocks,
            enable_prefix_caching: ec.enable_prefix_caching,
            quantize_full_blocks: device_pool.is_none() && dtype == KvCacheDtype::Int8,
        },
        kv_cache_dtype: dtype,
        bytes_per_block,
        pool_bytes: num_blocks * bytes_per_block,
        staging_bytes_per_block: dtype.staging_bytes_per_block(cfg, block_size),
        batch_invariant: lm.model.is_batch_invariant(),
        speculative: ec.speculative.clone(),
        draft_bytes_per_block,
        device_pool,
    })
}

/// For a model on a GPU, its device and compute dtype (what the device pool stores); `None` on the
/// CPU. See [`check_device_pool`] for what is refused.
fn device_pool(
    lm: &LoadedModel,
    ec: &EngineConfig,
    with_draft: bool,
) -> Result<Option<(DeviceSpec, DType)>, EngineError> {
    let (device, compute) = (lm.model.device(), lm.model.dtype());
    if device.is_cpu() {
        return Ok(None);
    }
    let spec = DeviceSpec::of(device);
    check_device_pool(spec, compute, ec.kv_cache_dtype, with_draft).map_err(EngineError::InvalidRequest)?;
    Ok(Some((spec, compute)))
}

/// Refuse, for a pool on `spec`, what only the host pool does: an int8 cache, a cache dtype other
/// than the compute dtype, and a draft model (it runs on the CPU, over a host pool).
pub fn check_device_pool(
    spec: DeviceSpec,
    compute: DType,
    kv: Option<KvCacheDtype>,
    with_draft: bool,
) -> Result<(), String> {
    let matches = match kv {
        None => true,
        Some(KvCacheDtype::F32) => compute == DType::F32,
        Some(KvCacheDtype::Bf16) => compute == DType::BF16,
        Some(KvCacheDtype::Int8) => false,
    };
    if let (false, Some(asked)) = (matches, kv) {
        return Err(format!(
            "--kv-cache-dtype {asked}: on {spec} the KV pool stores the compute dtype ({}); leave --kv-cache-dtype \
             unset (int8 KV is a CPU feature)",
            compute.as_str()
        ));
    }
    if with_draft {
        return Err(format!(
            "--speculative-config: a draft model runs on the CPU only, not with the target on {spec}; use \
             method ngram there"
        ));
    }
    Ok(())
}

/// An engine core over `lm`'s model (and `draft`'s, for speculative decoding) with fresh pools
/// as planned.
pub fn build_core(
    lm: &LoadedModel,
    draft: Option<&LoadedModel>,
    plan: &PoolPlan,
) -> Result<EngineCore<PagedModelRunner>, EngineError> {
    let cfg = lm.model.config();
    let (bs, nb) = (plan.sched.block_size, plan.sched.num_blocks);
    let cache = match plan.device_pool {
        Some((_, dtype)) => KvPool::Device(DeviceKvCache::new(cfg, dtype, bs, nb, lm.model.device())?),
        None => KvPool::Host(PagedKvCache::new(cfg, plan.kv_cache_dtype, bs, nb)?),
    };
    let draft = match draft {
        Some(d) => Some(DraftModel {
            model: d.model.clone(),
            cache: PagedKvCache::new(
                d.model.config(),
                draft_kv_dtype(plan.kv_cache_dtype),
                plan.sched.block_size,
                plan.sched.num_blocks,
            )?,
            valid_vocab: d.valid_vocab(),
        }),
        None => None,
    };
    let info = ModelInfo {
        vocab_size: cfg.vocab_size,
        valid_vocab: lm.valid_vocab(),
        eos_token_ids: lm.eos_token_ids.clone(),
    };
    let runner = PagedModelRunner { model: lm.model.clone(), cache, draft };
    let mut core = EngineCore::new(runner, plan.sched.clone(), lm.tokenizer.clone(), info);
    core.set_speculative(plan.speculative.clone());
    Ok(core)
}

#[cfg(test)]
mod device_pool_tests {
    use super::*;

    #[test]
    fn a_gpu_pool_refuses_what_only_the_host_pool_does() {
        let gpu = DeviceSpec::Cuda(0);
        assert!(check_device_pool(gpu, DType::BF16, None, false).is_ok());
        assert!(check_device_pool(gpu, DType::BF16, Some(KvCacheDtype::Bf16), false).is_ok());
        assert!(check_device_pool(gpu, DType::F32, Some(KvCacheDtype::F32), false).is_ok());
        let int8 = check_device_pool(gpu, DType::BF16, Some(KvCacheDtype::Int8), false).unwrap_err();
        assert!(int8.contains("--kv-cache-dtype int8") && int8.contains("cuda:0"), "{int8}");
        let f32_kv = check_device_pool(gpu, DType::F16, Some(KvCacheDtype::F32), false).unwrap_err();
        assert!(f32_kv.contains("compute dtype (f16)"), "{f32_kv}");
        let draft = check_device_pool(gpu, DType::BF16, None, true).unwrap_err();
        assert!(draft.contains("draft model") && draft.contains("ngram"), "{draft}");
    }
}
