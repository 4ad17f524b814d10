//! The paged KV pool: per layer, `num_blocks` blocks of `block_size` token slots. The engine's
//! block manager decides which blocks a sequence owns and passes them in each [`SeqChunk`]'s
//! block table; this type only stores and reads.
//!
//! Layout of one block in one layer: values `[kv_heads][block_size][head_dim]` and keys transposed,
//! `[kv_heads][head_dim][block_size]`, so one head's keys or values in a block are contiguous and
//! the attention kernel streams them (keys as 16-wide columns of scores, without a transpose per
//! step). Two planned features fit as is:
//! - **int8 KV** (KIVI-style): a block gains a code array of the same shape plus, per block, one
//!   K scale per (head, channel) and one V scale per (head, token); scales live with the block,
//!   so sharing, eviction and copy-on-write move them along with the codes.
//! - **Rollback by k tokens** (speculative decoding): positions are addressed through the block
//!   table, so discarding drafted tokens is the engine shortening the sequence's length (and
//!   freeing tail blocks); stale slots are overwritten by the next write, never read before it.

use candle_core::{Device, Tensor};

use crate::batch::ForwardBatch;
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::kernels::attention::{paged_attention, PagedLayer, SeqView};
use crate::kernels::huge_buf::HugeBuf;
use crate::kernels::rowwise::with_f32;
use crate::kv_cache::KvCache;

pub struct PagedKvCache {
    block_size: usize,
    num_blocks: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Per layer, K and V pools of `num_blocks · kv_heads · block_size · head_dim` f32.
    layers: Vec<(HugeBuf<f32>, HugeBuf<f32>)>,
}

impl PagedKvCache {
    /// Bytes one block takes across all layers (K and V, f32).
    pub fn bytes_per_block(cfg: &Qwen2Config, block_size: usize) -> usize {
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * block_size * 4
    }

    /// A zeroed pool. Zero pages are mapped lazily by the OS, so a large pool costs memory only
    /// as blocks are first written (in 2 MiB steps where it gets huge pages).
    pub fn new(cfg: &Qwen2Config, block_size: usize, num_blocks: usize) -> Result<Self> {
        if block_size == 0 || num_blocks == 0 {
            return Err(ModelError::Batch(format!(
                "a paged cache needs at least one block of at least one token (got {num_blocks} × {block_size})"
            )));
        }
        let per_layer = num_blocks * cfg.num_key_value_heads * block_size * cfg.head_dim;
        let layers =
            (0..cfg.num_hidden_layers).map(|_| (HugeBuf::zeroed(per_layer), HugeBuf::zeroed(per_layer))).collect();
        Ok(Self { block_size, num_blocks, kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim, layers })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Copy block `src` into `dst` in every layer (copy-on-write of a shared partial block).
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<()> {
        let n = self.kv_heads * self.block_size * self.head_dim;
        let (s, d) = (src as usize, dst as usize);
        if s >= self.num_blocks || d >= self.num_blocks {
            return Err(ModelError::Batch(format!("copy of block {src} to {dst} outside the pool")));
        }
        for (k, v) in &mut self.layers {
            k.copy_within(s * n..(s + 1) * n, d * n);
            v.copy_within(s * n..(s + 1) * n, d * n);
        }
        Ok(())
    }

    /// Every chunk's block table must cover its context and name blocks of the pool.
    fn check_tables(&self, batch: &ForwardBatch) -> Result<()> {
        for s in &batch.seqs {
            let needed = (s.context_len + s.num_tokens).div_ceil(self.block_size);
            if s.blocks.len() < needed {
                return Err(ModelError::Batch(format!(
                    "sequence {} needs {needed} blocks for {} tokens but its table has {}",
                    s.slot,
                    s.context_len + s.num_tokens,
                    s.blocks.len()
                )));
            }
            if let Some(b) = s.blocks[..needed].iter().find(|&&b| b as usize >= self.num_blocks) {
                return Err(ModelError::Batch(format!("block {b} is outside the pool of {}", self.num_blocks)));
            }
        }
        Ok(())
    }
}

impl KvCache for PagedKvCache {
    fn attention(
        &mut self,
        layer: usize,
        batch: &ForwardBatch,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> Result<Tensor> {
        if layer >= self.layers.len() {
            return Err(ModelError::Batch(format!("layer {layer} out of range")));
        }
        if layer == 0 {
            self.check_tables(batch)?;
        }
        let (n, q_heads, d) = q.dims3()?;
        let (bs, hkv) = (self.block_size, self.kv_heads);
        if k.dims3()? != (n, hkv, d) || d != self.head_dim {
            return Err(ModelError::Batch(format!("k of shape {:?} does not fit the cache", k.dims())));
        }
        let (kp, vp) = &mut self.layers[layer];
        with_f32(k, |kv_new| {
            with_f32(v, |vv_new| {
                let mut row = 0;
                for s in &batch.seqs {
                    for t in 0..s.num_tokens {
                        let pos = s.context_len + t;
                        let (block, off) = (s.blocks[pos / bs] as usize, pos % bs);
                        for h in 0..hkv {
                            let src = ((row + t) * hkv + h) * d;
                            let head = (block * hkv + h) * bs * d;
                            vp[head + off * d..head + (off + 1) * d].copy_from_slice(&vv_new[src..src + d]);
                            for (dd, &x) in kv_new[src..src + d].iter().enumerate() {
                                kp[head + dd * bs + off] = x;
                            }
                        }
                    }
                    row += s.num_tokens;
                }
            })
        })??;
        let mut views = Vec::with_capacity(batch.seqs.len());
        let mut row = 0;
        for s in &batch.seqs {
            views.push(SeqView { row, context_len: s.context_len, num_tokens: s.num_tokens, blocks: &s.blocks });
            row += s.num_tokens;
        }
        let pool = PagedLayer { k: kp, v: vp, block_size: bs, kv_heads: hkv, head_dim: d };
        let mut out = vec![0f32; n * q_heads * d];
        with_f32(q, |qv| paged_attention(qv, q_heads, &views, &pool, window, &mut out))?;
        let device: &Device = q.device();
        Ok(Tensor::from_vec(out, (n, q_heads * d), device)?.to_dtype(q.dtype())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::LogitsRows;
    use crate::kv_cache::ContiguousKvCache;
    use candle_core::DType;

    fn cfg() -> Qwen2Config {
        Qwen2Config::from_json_str(
            r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":192,"intermediate_size":128,"num_hidden_layers":1,
                "num_attention_heads":6,"num_key_value_heads":2,"vocab_size":10,"max_position_embeddings":512,
                "rms_norm_eps":1e-6,"rope_theta":10000.0}"#,
        )
        .unwrap()
    }

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Runs the same chunks through the paged and the contiguous cache and compares outputs.
    fn compare(window: Option<usize>) {
        let c = cfg();
        let (hq, hkv, d, bs) = (6, 2, 32, 4);
        let mut paged = PagedKvCache::new(&c, bs, 64).unwrap();
        let mut reference = ContiguousKvCache::for_config(&c, DType::F32, &Device::Cpu);
        // Deliberately scattered, non-adjacent, descending block tables.
        let tables: [Vec<u32>; 3] =
            [vec![63, 7, 31, 2, 50, 11, 40], vec![5, 60, 0, 33, 21, 9, 48, 17], vec![44, 13, 3, 58, 26, 37]];
        // Step plans: (seq, context_len, new tokens).
        let steps: [&[(usize, usize, usize)]; 4] = [
            &[(0, 0, 9), (1, 0, 3)],
            &[(1, 3, 14), (0, 9, 1), (2, 0, 1)],
            &[(2, 1, 20), (0, 10, 1)],
            &[(0, 11, 1), (1, 17, 1), (2, 21, 2)],
        ];
        for (si, plan) in steps.iter().enumerate() {
            let mut batch = ForwardBatch::new();
            for &(seq, ctx, n) in plan.iter() {
                batch.push_paged(seq, ctx, &vec![1; n], LogitsRows::All, tables[seq].clone());
            }
            let n = batch.num_tokens();
            let t = |shape: (usize, usize, usize), seed| {
                Tensor::from_vec(rand(shape.0 * shape.1 * shape.2, seed), shape, &Device::Cpu).unwrap()
            };
            let q = t((n, hq, d), 10 + si as u64);
            let k = t((n, hkv, d), 20 + si as u64);
            let v = t((n, hkv, d), 30 + si as u64);
            let a = paged.attention(0, &batch, &q, &k, &v, window).unwrap().to_vec2::<f32>().unwrap();
            let b = reference.attention(0, &batch, &q, &k, &v, window).unwrap().to_vec2::<f32>().unwrap();
            let max = a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(max <= 1e-6, "step {si}: max |Δ| = {max}");
        }
    }

    #[test]
    fn paged_matches_contiguous_reference() {
        compare(None);
    }

    #[test]
    fn paged_matches_contiguous_reference_with_sliding_window() {
        compare(Some(5));
    }

    #[test]
    fn short_block_table_is_an_error_not_a_panic() {
        let c = cfg();
        let mut paged = PagedKvCache::new(&c, 4, 8).unwrap();
        let mut batch = ForwardBatch::new();
        batch.push_paged(0, 0, &[1; 9], LogitsRows::Last, vec![0, 1]);
        let z = |h| Tensor::zeros((9, h, 32), DType::F32, &Device::Cpu).unwrap();
        let err = paged.attention(0, &batch, &z(6), &z(2), &z(2), None).unwrap_err().to_string();
        assert!(err.contains("needs 3 blocks"), "{err}");
        let mut batch = ForwardBatch::new();
        batch.push_paged(0, 0, &[1; 2], LogitsRows::Last, vec![8]);
        let z = |h| Tensor::zeros((2, h, 32), DType::F32, &Device::Cpu).unwrap();
        assert!(paged.attention(0, &batch, &z(6), &z(2), &z(2), None).is_err());
    }

    #[test]
    fn copy_block_copies_every_layer() {
        let c = cfg();
        let mut paged = PagedKvCache::new(&c, 2, 4).unwrap();
        paged.layers[0].0[0] = 7.0;
        paged.copy_block(0, 3).unwrap();
        assert_eq!(paged.layers[0].0[3 * 2 * 2 * 32], 7.0);
        assert!(paged.copy_block(0, 4).is_err());
    }
}
