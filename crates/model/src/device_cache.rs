//! The paged KV pool in the model device's own memory (a CUDA GPU; the CPU in the tests): per
//! layer one key and one value tensor of `[num_blocks · block_size, kv_heads, head_dim]` in the
//! compute dtype, addressed through the same block tables as the host pool
//! ([`crate::paged_cache`]), so the engine's block manager, prefix cache and preemption work
//! unchanged.
//!
//! A pass uploads one small u32 array (each new token's sequence, position and pool slot, and the
//! block tables: [`PassMeta`]) when its first layer runs; every layer then writes its new keys and
//! values into their slots in place ([`ops::WriteKv`]) and attends through the tables in place
//! ([`ops::PagedAttention`]): a decode step copies no key or value to the host or anywhere else.
//! Only the logits leave the device, in the model.
//!
//! Unlike the host pool, nothing is quantized and nothing is kept per block: the pool stores
//! exactly what the layer computed, in the compute dtype (bf16 or f16 on a GPU), so freeing a
//! block needs no work here.

mod ops;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(test)]
mod tests;

use candle_core::{DType, Device, Tensor};

use crate::batch::ForwardBatch;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use ops::{AttentionShape, PagedAttention, WriteKv};

/// The largest head size the CUDA kernel takes (its shared query row).
pub const MAX_HEAD_DIM: usize = 256;

pub struct DeviceKvCache {
    device: Device,
    dtype: DType,
    block_size: usize,
    num_blocks: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Per layer: (K, V), each `[num_blocks · block_size, kv_heads, head_dim]`.
    layers: Vec<(Tensor, Tensor)>,
    /// The current pass's metadata, built when its first layer runs.
    pass: Option<PassMeta>,
}

/// One pass's metadata on the device: `[token_seq: N][token_pos: N][slot: N][tables: S × max_blocks]`
/// (u32), where `token_seq` indexes the batch's sequences.
struct PassMeta {
    meta: Tensor,
    n_tokens: usize,
    max_blocks: usize,
}

impl DeviceKvCache {
    /// A zeroed pool of `num_blocks` blocks of `block_size` tokens for `cfg`'s layers on `device`,
    /// stored in `dtype` (f32, f16 or bf16: the model's compute dtype).
    pub fn new(cfg: &ModelConfig, dtype: DType, block_size: usize, num_blocks: usize, device: &Device) -> Result<Self> {
        if block_size == 0 || num_blocks == 0 {
            return Err(ModelError::Batch(format!(
                "a paged cache needs at least one block of at least one token (got {num_blocks} × {block_size})"
            )));
        }
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(ModelError::Batch(format!("the device KV pool stores f32, f16 or bf16, not {dtype:?}")));
        }
        let (hkv, d) = (cfg.num_key_value_heads, cfg.head_dim);
        if d > MAX_HEAD_DIM {
            return Err(ModelError::Batch(format!(
                "head size {d} exceeds the device attention kernel's {MAX_HEAD_DIM}"
            )));
        }
        if d == 0 || hkv == 0 || !cfg.num_attention_heads.is_multiple_of(hkv) {
            return Err(ModelError::Batch(format!(
                "{} query heads cannot be grouped over {hkv} KV heads of size {d}",
                cfg.num_attention_heads
            )));
        }
        let slots = num_blocks * block_size;
        if u32::try_from(slots).is_err() {
            return Err(ModelError::Batch(format!(
                "{num_blocks} blocks of {block_size} tokens exceed the device pool's 2^32 slots"
            )));
        }
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| {
                let k = Tensor::zeros((slots, hkv, d), dtype, device)?;
                let v = Tensor::zeros((slots, hkv, d), dtype, device)?;
                Ok((k, v))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            device: device.clone(),
            dtype,
            block_size,
            num_blocks,
            kv_heads: hkv,
            head_dim: d,
            layers,
            pass: None,
        })
    }

    /// Bytes one block takes over every layer (keys and values) for `cfg` in `dtype`.
    pub fn bytes_per_block(cfg: &ModelConfig, dtype: DType, block_size: usize) -> usize {
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * block_size * dtype.size_in_bytes()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// `batch`'s metadata, checked against the pool: every new token's position has a block, and
    /// every block of every table is in the pool (the kernel reads them unchecked).
    fn pass_meta(&self, batch: &ForwardBatch) -> Result<PassMeta> {
        let bs = self.block_size;
        let n = batch.num_tokens();
        let max_blocks = batch.seqs.iter().map(|c| c.blocks.len()).max().unwrap_or(0).max(1);
        let mut meta = vec![0u32; 3 * n + batch.seqs.len() * max_blocks];
        let mut t = 0;
        for (s, c) in batch.seqs.iter().enumerate() {
            let end = c.context_len + c.num_tokens;
            if c.blocks.len() * bs < end {
                return Err(ModelError::Batch(format!(
                    "sequence {} reaches position {end} but its {} blocks of {bs} hold {}",
                    c.seq,
                    c.blocks.len(),
                    c.blocks.len() * bs
                )));
            }
            if let Some(&b) = c.blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
                return Err(ModelError::Batch(format!(
                    "sequence {} names block {b} of a pool of {}",
                    c.seq, self.num_blocks
                )));
            }
            let table = 3 * n + s * max_blocks;
            meta[table..table + c.blocks.len()].copy_from_slice(&c.blocks);
            for pos in c.context_len..end {
                meta[t] = s as u32;
                meta[n + t] = pos as u32;
                meta[2 * n + t] = c.blocks[pos / bs] * bs as u32 + (pos % bs) as u32;
                t += 1;
            }
        }
        let len = meta.len();
        Ok(PassMeta { meta: Tensor::from_vec(meta, len, &self.device)?, n_tokens: n, max_blocks })
    }
}

impl KvCache for DeviceKvCache {
    fn attention(
        &mut self,
        layer: usize,
        batch: &ForwardBatch,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let (n, hq, d) = q.dims3()?;
        // The kernels read unchecked: everything they index is checked here, once per layer.
        if self.kv_heads == 0 || hq < self.kv_heads || !hq.is_multiple_of(self.kv_heads) {
            return Err(ModelError::Batch(format!(
                "{hq} query heads cannot be grouped over {} KV heads",
                self.kv_heads
            )));
        }
        if self.pass.as_ref().is_none_or(|p| layer == 0 || p.n_tokens != n) {
            self.pass = Some(self.pass_meta(batch)?);
        }
        let Some(pass) = self.pass.as_ref() else { return Err(ModelError::Batch("no pass metadata".into())) };
        if pass.n_tokens != n {
            return Err(ModelError::Batch(format!("{n} queries for a batch of {} tokens", pass.n_tokens)));
        }
        let Some((kc, vc)) = self.layers.get(layer) else {
            return Err(ModelError::Batch(format!("layer {layer} out of range ({} layers)", self.layers.len())));
        };
        if (k.dims3()?, v.dims3()?) != ((n, self.kv_heads, self.head_dim), (n, self.kv_heads, self.head_dim))
            || d != self.head_dim
        {
            return Err(ModelError::Batch(format!(
                "layer {layer}: q {:?}, k {:?}, v {:?} do not fit a pool of {} KV heads of {}",
                q.dims(),
                k.dims(),
                v.dims(),
                self.kv_heads,
                self.head_dim
            )));
        }
        let write = WriteKv { n_tokens: n, row: self.kv_heads * self.head_dim };
        kc.inplace_op3(&k.to_dtype(self.dtype)?.contiguous()?, &pass.meta, &write)?;
        vc.inplace_op3(&v.to_dtype(self.dtype)?.contiguous()?, &pass.meta, &write)?;
        let op = PagedAttention {
            k_cache: kc,
            v_cache: vc,
            meta: &pass.meta,
            shape: AttentionShape {
                n_tokens: n,
                max_blocks: pass.max_blocks,
                num_heads: hq,
                num_kv_heads: self.kv_heads,
                head_dim: d,
                block_size: self.block_size,
                window: window.unwrap_or(0),
                scale: 1.0 / (d as f32).sqrt(),
            },
        };
        let out = q.to_dtype(self.dtype)?.contiguous()?.apply_op1_no_bwd(&op)?;
        Ok(out.reshape((n, hq * d))?.to_dtype(q.dtype())?)
    }
}
