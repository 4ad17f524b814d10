//! The Llama-like decoder of every family flint runs (Qwen2, Qwen3, Llama, Mistral), read top to
//! bottom as candle's `qwen2.rs` (fields named as the checkpoint names the weights): embed → N ×
//! decoder layer (RMSNorm → attention with RoPE → residual → RMSNorm → SiLU-gated MLP →
//! residual) → RMSNorm → lm_head. The families differ only in switches of [`ModelConfig`]: q/k/v
//! (and o) biases, Qwen3's RMSNorm over each q and k head before RoPE, the RoPE scaling kind, the
//! sliding window, and in a mixture of experts the sparse feed-forward of the layers it names
//! (`moe`).
//!
//! One forward pass runs a [`ForwardBatch`]: the projections and the MLP see every new token of
//! every sequence at once; attention runs per sequence against the keys and values the caller's
//! [`KvCache`] returns. Grouped-query attention folds the query heads that share a KV head into
//! the rows of one matrix product, so K/V heads are never repeated in memory.
//!
//! The forward pass marks its scopes (layer → attention → q/k/v projections, paged attention,
//! o_proj; MLP → gate/up, down; lm_head) as `tracing` spans at trace level, for `--trace-dir`.
//!
//! Each projection picks its own kernel ([`Linear`]). What runs between them is [`Ops`]: flint's
//! row-wise kernels for f32 on the CPU, candle's ops for any other device or dtype. It is chosen
//! once per pass and is the one place the two differ.

use std::sync::Arc;
use tracing::trace_span;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Tensor, D};

use crate::batch::ForwardBatch;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kernels::matmul_f32::{Bf16Compute, PackedF32};
use crate::kernels::rowwise;
use crate::kv_cache::KvCache;
use crate::linear::{self, Linear};
use crate::rope::{apply_rope, Rope};
use crate::weights::{Weight, WeightSource};

mod moe;
#[cfg(test)]
pub(crate) use moe::with_separate_experts;
use moe::SparseMoe;

/// Reads the checkpoint's tensors by name, checking each one's shape; dense ones arrive in the
/// compute dtype.
struct Loader<'a> {
    weights: &'a WeightSource,
    dtype: DType,
    device: &'a Device,
}

impl Loader<'_> {
    fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.weights.get_dense(name, shape, self.dtype, self.device)
    }

    /// `{name}.weight` (`[out, in]`), and `{name}.bias` (`[out]`) when `bias`.
    fn linear(&self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let w = self.weights.get_matrix(&format!("{name}.weight"), &[out, inp], self.dtype, self.device)?;
        let b = if bias { Some(self.dense(&format!("{name}.bias"), &[out])?) } else { None };
        Linear::new(w, b)
    }

    fn rms_norm(&self, name: &str, size: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: self.dense(&format!("{name}.weight"), &[size])?, eps })
    }
}

struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// As transformers: statistics in f32, scale applied after casting back to the input dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let var = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x32.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(normed.to_dtype(dtype)?.broadcast_mul(&self.weight)?)
    }
}

/// `down_proj(silu(gate_proj(x)) · up_proj(x))`.
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    /// `h`: hidden size; `i`: intermediate size.
    fn load(ld: &Loader, p: &str, h: usize, i: usize) -> Result<Self> {
        Ok(Self {
            gate_proj: ld.linear(&format!("{p}.gate_proj"), i, h, false)?,
            up_proj: ld.linear(&format!("{p}.up_proj"), i, h, false)?,
            down_proj: ld.linear(&format!("{p}.down_proj"), h, i, false)?,
        })
    }

    fn forward(&self, x: &Tensor, ops: &Ops) -> Result<Tensor> {
        let _scope = trace_span!("mlp").entered();
        let gated = trace_span!("gate_up_proj").in_scope(|| ops.silu_gate(&self.gate_proj, &self.up_proj, x))?;
        trace_span!("down_proj").in_scope(|| self.down_proj.forward(&gated))
    }

    fn projections(&self) -> [&Linear; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

/// A layer's feed-forward: the dense MLP, or a mixture of experts' sparse one.
enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    fn load(ld: &Loader, p: &str, cfg: &ModelConfig, l: usize) -> Result<Self> {
        Ok(match &cfg.moe {
            Some(moe) if moe.is_sparse(l) => FeedForward::Sparse(SparseMoe::load(ld, p, cfg, moe)?),
            _ => FeedForward::Dense(Mlp::load(ld, p, cfg.hidden_size, cfg.intermediate_size)?),
        })
    }

    fn forward(&self, x: &Tensor, ops: &Ops) -> Result<Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x, ops),
            FeedForward::Sparse(moe) => moe.forward(x, ops),
        }
    }

    fn projections(&self) -> Vec<&Linear> {
        match self {
            FeedForward::Dense(mlp) => mlp.projections().to_vec(),
            FeedForward::Sparse(moe) => moe.projections().collect(),
        }
    }
}

/// Grouped-query self-attention: q/k/v projections (biased in Qwen2), Qwen3's per-head q/k norm,
/// RoPE on q and k, attention against the cache (causal, within the layer's sliding window if it
/// has one), o_proj.
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
}

impl Attention {
    fn load(ld: &Loader, p: &str, cfg: &ModelConfig, sliding_window: Option<usize>) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nq, nkv) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        let (bias, eps) = (cfg.qkv_bias, cfg.rms_norm_eps);
        let head_norm = |name: &str| -> Result<Option<RmsNorm>> {
            cfg.qk_norm.then(|| ld.rms_norm(&format!("{p}.{name}"), d, eps)).transpose()
        };
        Ok(Self {
            q_proj: ld.linear(&format!("{p}.q_proj"), nq, h, bias)?,
            k_proj: ld.linear(&format!("{p}.k_proj"), nkv, h, bias)?,
            v_proj: ld.linear(&format!("{p}.v_proj"), nkv, h, bias)?,
            o_proj: ld.linear(&format!("{p}.o_proj"), h, nq, cfg.o_bias)?,
            q_norm: head_norm("q_norm")?,
            k_norm: head_norm("k_norm")?,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: d,
            sliding_window,
        })
    }

    /// `layer`: this attention's layer in the cache.
    fn forward(
        &self,
        layer: usize,
        x: &Tensor,
        ops: &Ops,
        batch: &ForwardBatch,
        cache: &mut dyn KvCache,
    ) -> Result<Tensor> {
        let _scope = trace_span!("attention").entered();
        let [q, k, v] = trace_span!("qkv_proj").in_scope(|| ops.qkv_rope(self, x))?;
        let y = trace_span!("paged_attention")
            .in_scope(|| cache.attention(layer, batch, &q, &k, &v, self.sliding_window))?;
        trace_span!("o_proj").in_scope(|| self.o_proj.forward(&y))
    }
}

struct DecoderLayer {
    self_attn: Attention,
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn load(ld: &Loader, cfg: &ModelConfig, l: usize) -> Result<Self> {
        let p = format!("model.layers.{l}");
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let window = cfg.sliding_window_layers.get(l).copied().flatten();
        // Read in the checkpoint's order.
        Ok(Self {
            input_layernorm: ld.rms_norm(&format!("{p}.input_layernorm"), h, eps)?,
            self_attn: Attention::load(ld, &format!("{p}.self_attn"), cfg, window)?,
            post_attention_layernorm: ld.rms_norm(&format!("{p}.post_attention_layernorm"), h, eps)?,
            mlp: FeedForward::load(ld, &format!("{p}.mlp"), cfg, l)?,
        })
    }

    fn forward(
        &self,
        layer: usize,
        x: &Tensor,
        ops: &Ops,
        batch: &ForwardBatch,
        cache: &mut dyn KvCache,
    ) -> Result<Tensor> {
        let h = ops.rms_norm(&self.input_layernorm, x)?;
        let x = ops.add(x, &self.self_attn.forward(layer, &h, ops, batch, cache)?)?;
        let h = ops.rms_norm(&self.post_attention_layernorm, &x)?;
        ops.add(&x, &self.mlp.forward(&h, ops)?)
    }

    fn projections(&self) -> Vec<&Linear> {
        let a = &self.self_attn;
        let mut all = vec![&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj];
        all.extend(self.mlp.projections());
        all
    }
}

enum Embedding {
    Dense(Tensor),
    /// A tied f32/bf16/f16 embedding read back from the lm_head's packed panels (one copy in
    /// memory).
    Packed(Arc<PackedF32>),
    Quantized(Arc<QTensor>),
}

impl Embedding {
    /// The rows of `tokens`, `[n, hidden]` in `dtype`.
    fn forward(&self, tokens: &[u32], dtype: DType, device: &Device) -> Result<Tensor> {
        let n = tokens.len();
        let ids = || Tensor::from_slice(tokens, n, device);
        Ok(match self {
            Embedding::Dense(w) => w.index_select(&ids()?, 0)?.to_dtype(dtype)?,
            Embedding::Quantized(q) => q.embedding(&ids()?)?.to_dtype(dtype)?,
            Embedding::Packed(w) => {
                let h = w.in_features();
                let mut rows = vec![0f32; n * h];
                for (dst, &t) in rows.chunks_exact_mut(h).zip(tokens) {
                    w.row(t as usize, dst);
                }
                Tensor::from_vec(rows, (n, h), device)?.to_dtype(dtype)?
            }
        })
    }
}

/// What one forward pass returns (see [`DecoderModel::forward_step`]).
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// `[logit rows · vocab_size]`, or `None` when no sequence asked for logits.
    pub logits: Option<Vec<f32>>,
    /// `[hidden rows · hidden_size]`.
    pub hidden: Vec<f32>,
}

pub struct DecoderModel {
    cfg: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    dtype: DType,
    device: Device,
}

impl DecoderModel {
    /// Build the model from `weights`, checking every tensor's shape against `cfg`.
    /// Dense weights are converted to `dtype` (the compute dtype; f32 on CPU).
    pub fn load(cfg: &ModelConfig, weights: &WeightSource, dtype: DType, device: &Device) -> Result<Self> {
        crate::device::check_dtype(device, dtype)?;
        let ld = Loader { weights, dtype, device };
        let h = cfg.hidden_size;
        // A tied embedding is also the lm_head matrix; either way it may stay bf16 (an untied
        // one is widened a row at a time as tokens are looked up: in f32 it would be twice the
        // bytes, 2.2 GB for a 7B vocabulary).
        let embed_w = weights.get_matrix("model.embed_tokens.weight", &[cfg.vocab_size, h], dtype, device)?;
        // As transformers: a tied model uses the embedding as lm_head even if the file also
        // ships an `lm_head.weight`; an untied one must ship it. A tied one is packed before the
        // layers load, so its unpacked copy is gone before the rest arrives.
        let (embed_tokens, tied_head) = if cfg.tie_word_embeddings {
            let (embedding, head) = tied_embedding(embed_w)?;
            (embedding, Some(head))
        } else {
            let embedding = match embed_w {
                Weight::Dense(t) => Embedding::Dense(t),
                Weight::Quantized(q) => Embedding::Quantized(Arc::new(q)),
            };
            (embedding, None)
        };
        // Loading includes packing each projection for its kernel: most of the start-up time.
        let progress = crate::progress::task("loading weights", "layers", cfg.num_hidden_layers as u64);
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| {
                let layer = DecoderLayer::load(&ld, cfg, l);
                progress.inc(1);
                layer
            })
            .collect::<Result<Vec<_>>>()?;
        drop(progress);
        let norm = ld.rms_norm("model.norm", h, cfg.rms_norm_eps)?;
        let lm_head = match tied_head {
            Some(head) => head,
            None => ld.linear("lm_head", cfg.vocab_size, h, false)?,
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope: Rope::new(&cfg.rope, cfg.head_dim),
            dtype,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How the bf16 weights are computed, `None` when none is bf16 on the CPU.
    pub fn bf16_compute(&self) -> Option<Bf16Compute> {
        self.layers
            .iter()
            .flat_map(|l| [&l.self_attn.q_proj, &l.self_attn.o_proj])
            .chain([&self.lm_head])
            .find_map(|p| p.bf16_compute())
    }

    /// How many layers hold their experts merged for the grouped int8 kernels.
    #[cfg(test)]
    pub(crate) fn merged_expert_layers(&self) -> usize {
        self.layers.iter().filter(|l| matches!(&l.mlp, FeedForward::Sparse(m) if m.is_merged())).count()
    }

    /// True when a sequence's logits cannot depend on the rest of its batch: every projection
    /// runs a row-independent kernel (f32, bf16 or f16 weights on the CPU, or GGUF-quantized).
    /// Dense weights on other devices go through candle's dense matmul, which is not.
    pub fn is_batch_invariant(&self) -> bool {
        self.lm_head.is_row_independent()
            && self.layers.iter().all(|l| l.projections().iter().all(|p| p.is_row_independent()))
    }

    /// Run one batch. Returns f32 logits `[rows · vocab_size]` for `batch.logit_rows()`, in
    /// order, as one flat `Vec` (on the CPU the lm_head kernel's own output, with no copy out of
    /// a tensor: megabytes per step for a batch of decodes); `None` when no sequence asked for
    /// any.
    pub fn forward_logits(&self, batch: &ForwardBatch, cache: &mut dyn KvCache) -> Result<Option<Vec<f32>>> {
        Ok(self.forward_step(batch, cache)?.logits)
    }

    /// Run one batch: the logits of `batch.logit_rows()` and the final hidden states (after the
    /// last norm, as transformers' `last_hidden_state`) of `batch.hidden_rows()`, each flat in f32.
    pub fn forward_step(&self, batch: &ForwardBatch, cache: &mut dyn KvCache) -> Result<StepOutput> {
        batch.validate()?;
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Batch(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.cfg.vocab_size
            )));
        }
        let mut x = self.embed_tokens.forward(&batch.tokens, self.dtype, &self.device)?;
        let ops = Ops::new(&self.rope, &batch.positions, &self.device, self.dtype)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let _scope = trace_span!("layer", layer = l).entered();
            x = layer.forward(l, &x, &ops, batch, cache)?;
        }
        let select = |rows: &[usize]| -> Result<Tensor> {
            let rows = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), &self.device)?;
            ops.rms_norm(&self.norm, &x.index_select(&rows, 0)?)
        };
        let hidden_rows = batch.hidden_rows();
        let hidden = if hidden_rows.is_empty() {
            Vec::new()
        } else {
            select(&hidden_rows)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
        };
        let rows = batch.logit_rows();
        if rows.is_empty() {
            return Ok(StepOutput { logits: None, hidden });
        }
        let last = select(&rows)?;
        let logits = trace_span!("lm_head").in_scope(|| ops.logits(&self.lm_head, &last))?;
        self.check_finite(&logits)?;
        Ok(StepOutput { logits: Some(logits), hidden })
    }

    /// Refuse non-finite logits where 16-bit activations can overflow (f16 compute, or any GPU
    /// pass), so an overflow is an error naming its cause rather than text sampled from NaNs.
    /// flint's CPU kernels accumulate in f32 and skip the scan.
    fn check_finite(&self, logits: &[f32]) -> Result<()> {
        if self.device.is_cpu() && self.dtype != DType::F16 {
            return Ok(());
        }
        if logits.iter().all(|x| x.is_finite()) {
            return Ok(());
        }
        let hint = if self.dtype == DType::F16 { ": f16 activations overflowed; run with --dtype bf16" } else { "" };
        Err(ModelError::Device(format!(
            "the forward pass on {} in {:?} produced non-finite logits{hint}",
            crate::device::DeviceSpec::of(&self.device),
            self.dtype
        )))
    }

    /// [`forward_logits`](Self::forward_logits) as a tensor `[rows, vocab_size]` on the model's
    /// device.
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut dyn KvCache) -> Result<Option<Tensor>> {
        let Some(logits) = self.forward_logits(batch, cache)? else { return Ok(None) };
        let shape = (logits.len() / self.cfg.vocab_size.max(1), self.cfg.vocab_size);
        Ok(Some(Tensor::from_vec(logits, shape, &self.device)?))
    }
}

/// A tied embedding and the lm_head that shares its weight. Dense CPU weights are packed once for
/// the lm_head's kernel and read back from the panels for lookups; GGUF ones are repacked for the
/// int8 kernel where it takes them.
fn tied_embedding(w: Weight) -> Result<(Embedding, Linear)> {
    Ok(match w {
        Weight::Dense(t) if matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) && t.device().is_cpu() => {
            let packed = Arc::new(linear::pack(&t)?);
            (Embedding::Packed(packed.clone()), Linear::Packed { w: packed, b: None })
        }
        Weight::Dense(t) => (Embedding::Dense(t.clone()), Linear::Dense { w: t, b: None }),
        Weight::Quantized(q) => {
            let q = Arc::new(q);
            let head = match linear::pack_q8(&q)? {
                Some(p) => Linear::PackedQ8 { w: Arc::new(p), b: None },
                None => Linear::Quantized { w: QMatMul::from_arc(q.clone())?, b: None },
            };
            (Embedding::Quantized(q), head)
        }
    })
}

/// What runs between the matrix products of one forward pass, with RoPE's tables for its
/// positions: the one place f32 on the CPU and every other device or dtype differ.
enum Ops {
    /// f32 on the CPU: flint's row-wise kernels ([`rowwise`]) on the hidden state, RoPE applied
    /// in place on the projections' own buffers, q/k/v and gate/up in one kernel call where the
    /// weights allow, and the logits straight from the lm_head kernel. Every step is
    /// row-independent.
    Rowwise { cos: Vec<f32>, sin: Vec<f32> },
    /// Any other device or dtype: candle's ops.
    Candle { cos: Tensor, sin: Tensor },
}

impl Ops {
    fn new(rope: &Rope, positions: &[u32], device: &Device, dtype: DType) -> Result<Self> {
        let (cos, sin) = rope.cos_sin(positions, device)?;
        Ok(if device.is_cpu() && dtype == DType::F32 {
            Ops::Rowwise { cos: cos.flatten_all()?.to_vec1::<f32>()?, sin: sin.flatten_all()?.to_vec1::<f32>()? }
        } else {
            Ops::Candle { cos, sin }
        })
    }

    fn rms_norm(&self, norm: &RmsNorm, x: &Tensor) -> Result<Tensor> {
        match self {
            Ops::Rowwise { .. } => rowwise::rms_norm(x, &norm.weight, norm.eps),
            Ops::Candle { .. } => norm.forward(x),
        }
    }

    /// The residual connection, `a + b`.
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        match self {
            Ops::Rowwise { .. } => rowwise::add(a, b),
            Ops::Candle { .. } => Ok((a + b)?),
        }
    }

    /// `attn`'s queries, keys and values for `x` (`[n, heads, head_dim]` each), RoPE applied to
    /// the queries and keys.
    fn qkv_rope(&self, attn: &Attention, x: &Tensor) -> Result<[Tensor; 3]> {
        let n = x.dim(0)?;
        let (hq, hkv, d) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
        match self {
            Ops::Rowwise { cos, sin } => {
                // Straight from flint's kernels, one call for the three when they are int8.
                let projections = [&attn.q_proj, &attn.k_proj, &attn.v_proj];
                let fused = Linear::forward_vec_many(x, &projections)?.and_then(|v| <[Vec<f32>; 3]>::try_from(v).ok());
                let [mut q, mut k, v] = match fused {
                    Some(qkv) => qkv,
                    None => {
                        let vec =
                            |p: &Linear| -> Result<Vec<f32>> { Ok(p.forward(x)?.flatten_all()?.to_vec1::<f32>()?) };
                        [vec(&attn.q_proj)?, vec(&attn.k_proj)?, vec(&attn.v_proj)?]
                    }
                };
                for (x, norm) in [(&mut q, &attn.q_norm), (&mut k, &attn.k_norm)] {
                    if let Some(norm) = norm {
                        rowwise::with_f32(&norm.weight, |w| rowwise::rms_norm_heads(x, d, w, norm.eps))?;
                    }
                }
                rowwise::rope(&mut q, n, hq, d, cos, sin);
                rowwise::rope(&mut k, n, hkv, d, cos, sin);
                let dev = x.device();
                let (q, k) = (Tensor::from_vec(q, (n, hq, d), dev)?, Tensor::from_vec(k, (n, hkv, d), dev)?);
                Ok([q, k, Tensor::from_vec(v, (n, hkv, d), dev)?])
            }
            Ops::Candle { cos, sin } => {
                let head_norm = |t: Tensor, norm: &Option<RmsNorm>| match norm {
                    Some(norm) => norm.forward(&t),
                    None => Ok(t),
                };
                let q = head_norm(attn.q_proj.forward(x)?.reshape((n, hq, d))?, &attn.q_norm)?;
                let k = head_norm(attn.k_proj.forward(x)?.reshape((n, hkv, d))?, &attn.k_norm)?;
                let q = apply_rope(&q, cos, sin)?;
                let k = apply_rope(&k, cos, sin)?;
                let v = attn.v_proj.forward(x)?.reshape((n, hkv, d))?;
                Ok([q, k, v])
            }
        }
    }

    /// `silu(gate(x)) · up(x)`. On the CPU from the int8 kernel's fused epilogue when it can,
    /// else the two projections (in one kernel call where possible) and flint's `silu_mul`.
    fn silu_gate(&self, gate: &Linear, up: &Linear, x: &Tensor) -> Result<Tensor> {
        if let Ops::Candle { .. } = self {
            return Ok((gate.forward(x)?.silu()? * up.forward(x)?)?);
        }
        let (n, dev) = (x.dim(0)?, x.device());
        if let Some(v) = Linear::forward_gated(x, gate, up)? {
            let shape = (n, v.len() / n.max(1));
            return Ok(Tensor::from_vec(v, shape, dev)?);
        }
        let fused = Linear::forward_vec_many(x, &[gate, up])?.and_then(|v| <[Vec<f32>; 2]>::try_from(v).ok());
        match fused {
            Some([g, u]) => {
                let shape = (n, g.len() / n.max(1));
                rowwise::silu_mul(&Tensor::from_vec(g, shape, dev)?, &Tensor::from_vec(u, shape, dev)?)
            }
            None => rowwise::silu_mul(&gate.forward(x)?, &up.forward(x)?),
        }
    }

    /// `lm_head(x)` as f32 `[rows · vocab]`.
    fn logits(&self, lm_head: &Linear, x: &Tensor) -> Result<Vec<f32>> {
        if let Ops::Rowwise { .. } = self {
            if let Some(v) = lm_head.forward_vec(x)? {
                return Ok(v);
            }
        }
        Ok(lm_head.forward(x)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }
}
