//! The Qwen2 decoder, read top to bottom: embed → N × (RMSNorm → attention with biased q/k/v and
//! RoPE → residual → RMSNorm → SiLU-gated MLP → residual) → RMSNorm → lm_head.
//!
//! One forward pass runs a [`ForwardBatch`]: the projections and the MLP see every new token of
//! every sequence at once; attention runs per sequence against the keys and values the caller's
//! [`KvCache`] returns. Grouped-query attention folds the query heads that share a KV head into
//! the rows of one matrix product, so K/V heads are never repeated in memory.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor, D};

use crate::batch::ForwardBatch;
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::kernels::matmul_f32::PackedF32;
use crate::kernels::rowwise;
use crate::kv_cache::KvCache;
use crate::linear::Linear;
use crate::rope::{apply_rope, Rope};
use crate::weights::{Weight, WeightSource};

enum Embedding {
    Dense(Tensor),
    /// A tied f32/bf16/f16 embedding read back from the lm_head's packed panels (one copy in
    /// memory).
    Packed(Arc<PackedF32>),
    Quantized(Arc<QTensor>),
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

struct Layer {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    sliding_window: Option<usize>,
}

pub struct Qwen2Model {
    cfg: Qwen2Config,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    dtype: DType,
    device: Device,
}

impl Qwen2Model {
    /// Build the model from `weights`, checking every tensor's shape against `cfg`.
    /// Dense weights are converted to `dtype` (the compute dtype; f32 on CPU).
    pub fn load(cfg: &Qwen2Config, weights: &WeightSource, dtype: DType, device: &Device) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (nq, nkv) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim);
        let dense = |name: &str, shape: &[usize]| weights.get_dense(name, shape, dtype, device);
        let linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let w = weights.get_matrix(&format!("{name}.weight"), &[out, inp], dtype, device)?;
            let b = if bias { Some(dense(&format!("{name}.bias"), &[out])?) } else { None };
            Linear::new(w, b)
        };
        let norm =
            |name: &str| -> Result<RmsNorm> { Ok(RmsNorm { weight: dense(name, &[h])?, eps: cfg.rms_norm_eps }) };

        // A tied embedding is also the lm_head matrix; either way it may stay bf16 (an untied
        // one is widened a row at a time as tokens are looked up: in f32 it would be twice the
        // bytes, 2.2 GB for a 7B vocabulary).
        let embed_w = weights.get_matrix("model.embed_tokens.weight", &[cfg.vocab_size, h], dtype, device)?;
        // As transformers: a tied model uses the embedding as lm_head even if the file also
        // ships an `lm_head.weight`; an untied one must ship it. A tied one is packed before the
        // layers load, so its unpacked copy is gone before the rest arrives.
        let (embed_tokens, tied_head) = if !cfg.tie_word_embeddings {
            (embedding(embed_w), None)
        } else {
            match embed_w {
                Weight::Dense(t)
                    if matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) && t.device().is_cpu() =>
                {
                    let packed = Arc::new(crate::linear::pack(&t)?);
                    (Embedding::Packed(packed.clone()), Some(Linear::Packed { w: packed, b: None }))
                }
                Weight::Dense(t) => (Embedding::Dense(t.clone()), Some(Linear::Dense { w: t, b: None })),
                Weight::Quantized(q) => {
                    let q = Arc::new(q);
                    let head = match crate::linear::pack_q8(&q)? {
                        Some(p) => Linear::PackedQ8 { w: Arc::new(p), b: None },
                        None => Linear::Quantized { w: candle_core::quantized::QMatMul::from_arc(q.clone())?, b: None },
                    };
                    (Embedding::Quantized(q), Some(head))
                }
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"))?,
                q_proj: linear(&format!("{p}.self_attn.q_proj"), nq, h, true)?,
                k_proj: linear(&format!("{p}.self_attn.k_proj"), nkv, h, true)?,
                v_proj: linear(&format!("{p}.self_attn.v_proj"), nkv, h, true)?,
                o_proj: linear(&format!("{p}.self_attn.o_proj"), h, nq, false)?,
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                gate_proj: linear(&format!("{p}.mlp.gate_proj"), i, h, false)?,
                up_proj: linear(&format!("{p}.mlp.up_proj"), i, h, false)?,
                down_proj: linear(&format!("{p}.mlp.down_proj"), h, i, false)?,
                sliding_window: cfg.sliding_window_layers.get(l).copied().flatten(),
            });
        }
        let norm_f = norm("model.norm.weight")?;
        let lm_head = match tied_head {
            Some(head) => head,
            None => linear("lm_head", cfg.vocab_size, h, false)?,
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm: norm_f,
            lm_head,
            rope: Rope::new(&cfg.rope, cfg.head_dim),
            dtype,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &Qwen2Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How the bf16 weights are computed, `None` when none is bf16 on the CPU.
    pub fn bf16_compute(&self) -> Option<crate::kernels::matmul_f32::Bf16Compute> {
        self.layers.iter().flat_map(|l| [&l.q_proj, &l.down_proj]).chain([&self.lm_head]).find_map(|p| p.bf16_compute())
    }

    /// True when a sequence's logits cannot depend on the rest of its batch: every projection
    /// runs a row-independent kernel (f32, bf16 or f16 weights on the CPU, or GGUF-quantized).
    /// Dense weights on other devices go through candle's dense matmul, which is not.
    pub fn is_batch_invariant(&self) -> bool {
        self.lm_head.is_row_independent()
            && self.layers.iter().all(|l| {
                [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj]
                    .iter()
                    .all(|p| p.is_row_independent())
            })
    }

    /// Run one batch. Returns f32 logits `[rows, vocab_size]` for `batch.logit_rows()`, in order
    /// (`None` when no sequence asked for any).
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut dyn KvCache) -> Result<Option<Tensor>> {
        match self.last_hidden(batch, cache)? {
            None => Ok(None),
            Some(last) => Ok(Some(self.lm_head.forward(&last)?.to_dtype(DType::F32)?)),
        }
    }

    /// [`forward`](Self::forward) with the logits as one flat `Vec` `[rows · vocab_size]`: on the
    /// CPU the lm_head kernel's own output, with no copy out of a tensor (megabytes per step
    /// for a batch of decodes).
    pub fn forward_logits(&self, batch: &ForwardBatch, cache: &mut dyn KvCache) -> Result<Option<Vec<f32>>> {
        let Some(last) = self.last_hidden(batch, cache)? else { return Ok(None) };
        if self.cpu_f32() {
            if let Some(v) = self.lm_head.forward_vec(&last)? {
                return Ok(Some(v));
            }
        }
        Ok(Some(self.lm_head.forward(&last)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?))
    }

    /// The final-normed hidden states of `batch.logit_rows()` (`None` if there are none).
    fn last_hidden(&self, batch: &ForwardBatch, cache: &mut dyn KvCache) -> Result<Option<Tensor>> {
        batch.validate()?;
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Batch(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.cfg.vocab_size
            )));
        }
        let n = batch.num_tokens();
        let ids = Tensor::from_slice(&batch.tokens, n, &self.device)?;
        let mut x = match &self.embed_tokens {
            Embedding::Dense(w) => w.index_select(&ids, 0)?.to_dtype(self.dtype)?,
            Embedding::Quantized(q) => q.embedding(&ids)?.to_dtype(self.dtype)?,
            Embedding::Packed(w) => {
                let h = w.in_features();
                let mut rows = vec![0f32; n * h];
                for (dst, &t) in rows.chunks_exact_mut(h).zip(&batch.tokens) {
                    w.row(t as usize, dst);
                }
                Tensor::from_vec(rows, (n, h), &self.device)?.to_dtype(self.dtype)?
            }
        };
        let (cos, sin) = self.rope.cos_sin(&batch.positions, &self.device)?;
        if self.cpu_f32() {
            // The same layer with flint's own row-wise ops (see `kernels::rowwise`).
            let (cos_v, sin_v) = (cos.flatten_all()?.to_vec1::<f32>()?, sin.flatten_all()?.to_vec1::<f32>()?);
            for (l, layer) in self.layers.iter().enumerate() {
                let h = rowwise::rms_norm(&x, &layer.input_layernorm.weight, layer.input_layernorm.eps)?;
                let attn = self.attention_cpu(l, layer, &h, &cos_v, &sin_v, batch, cache)?;
                x = rowwise::add(&x, &layer.o_proj.forward(&attn)?)?;
                let eps = layer.post_attention_layernorm.eps;
                let h = rowwise::rms_norm(&x, &layer.post_attention_layernorm.weight, eps)?;
                let gated = self.gated_mlp_input(layer, &h)?;
                x = rowwise::add(&x, &layer.down_proj.forward(&gated)?)?;
            }
        } else {
            for (l, layer) in self.layers.iter().enumerate() {
                let h = layer.input_layernorm.forward(&x)?;
                let attn = self.attention(l, layer, &h, &cos, &sin, batch, cache)?;
                x = (x + layer.o_proj.forward(&attn)?)?;
                let h = layer.post_attention_layernorm.forward(&x)?;
                let gate = layer.gate_proj.forward(&h)?.silu()?;
                let up = layer.up_proj.forward(&h)?;
                x = (x + layer.down_proj.forward(&(gate * up)?)?)?;
            }
        }
        let rows = batch.logit_rows();
        if rows.is_empty() {
            return Ok(None);
        }
        let rows_t = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), &self.device)?;
        let last = x.index_select(&rows_t, 0)?;
        let last = if self.cpu_f32() {
            rowwise::rms_norm(&last, &self.norm.weight, self.norm.eps)?
        } else {
            self.norm.forward(&last)?
        };
        Ok(Some(last))
    }

    /// f32 on the CPU: the hidden state stays f32 and the row-wise ops are flint's own.
    fn cpu_f32(&self) -> bool {
        self.device.is_cpu() && self.dtype == DType::F32
    }

    /// `silu(gate_proj(h)) · up_proj(h)`: from the int8 kernel's fused epilogue when it can,
    /// else the two projections (in one kernel call where possible) and flint's `silu_mul`.
    fn gated_mlp_input(&self, layer: &Layer, h: &Tensor) -> Result<Tensor> {
        let (n, dev) = (h.dim(0)?, h.device());
        if let Some(v) = Linear::forward_gated(h, &layer.gate_proj, &layer.up_proj)? {
            let shape = (n, v.len() / n.max(1));
            return Ok(Tensor::from_vec(v, shape, dev)?);
        }
        let fused = Linear::forward_vec_many(h, &[&layer.gate_proj, &layer.up_proj])?
            .and_then(|v| <[Vec<f32>; 2]>::try_from(v).ok());
        match fused {
            Some([gate, up]) => {
                let shape = (n, gate.len() / n.max(1));
                rowwise::silu_mul(&Tensor::from_vec(gate, shape, dev)?, &Tensor::from_vec(up, shape, dev)?)
            }
            None => rowwise::silu_mul(&layer.gate_proj.forward(h)?, &layer.up_proj.forward(h)?),
        }
    }

    /// [`attention`](Self::attention) with RoPE applied in place on the projections' buffers.
    #[allow(clippy::too_many_arguments)]
    fn attention_cpu(
        &self,
        l: usize,
        layer: &Layer,
        h: &Tensor,
        cos: &[f32],
        sin: &[f32],
        batch: &ForwardBatch,
        cache: &mut dyn KvCache,
    ) -> Result<Tensor> {
        let n = h.dim(0)?;
        let (hq, hkv, d) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim);
        let projections = [&layer.q_proj, &layer.k_proj, &layer.v_proj];
        // Straight from flint's kernels, one call for the three when they are int8.
        let fused = Linear::forward_vec_many(h, &projections)?.and_then(|v| <[Vec<f32>; 3]>::try_from(v).ok());
        let [mut q, mut k, v] = match fused {
            Some(qkv) => qkv,
            None => {
                let vec = |p: &Linear| -> Result<Vec<f32>> { Ok(p.forward(h)?.flatten_all()?.to_vec1::<f32>()?) };
                [vec(&layer.q_proj)?, vec(&layer.k_proj)?, vec(&layer.v_proj)?]
            }
        };
        rowwise::rope(&mut q, n, hq, d, cos, sin);
        rowwise::rope(&mut k, n, hkv, d, cos, sin);
        let dev = h.device();
        let (q, k) = (Tensor::from_vec(q, (n, hq, d), dev)?, Tensor::from_vec(k, (n, hkv, d), dev)?);
        let v = Tensor::from_vec(v, (n, hkv, d), dev)?;
        cache.attention(l, batch, &q, &k, &v, layer.sliding_window)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        l: usize,
        layer: &Layer,
        h: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        batch: &ForwardBatch,
        cache: &mut dyn KvCache,
    ) -> Result<Tensor> {
        let n = h.dim(0)?;
        let (hq, hkv, d) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim);
        let q = apply_rope(&layer.q_proj.forward(h)?.reshape((n, hq, d))?, cos, sin)?;
        let k = apply_rope(&layer.k_proj.forward(h)?.reshape((n, hkv, d))?, cos, sin)?;
        let v = layer.v_proj.forward(h)?.reshape((n, hkv, d))?;
        cache.attention(l, batch, &q, &k, &v, layer.sliding_window)
    }
}

fn embedding(w: Weight) -> Embedding {
    match w {
        Weight::Dense(t) => Embedding::Dense(t),
        Weight::Quantized(q) => Embedding::Quantized(Arc::new(q)),
    }
}
