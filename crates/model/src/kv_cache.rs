//! The model's view of a KV cache it does not own. Each layer hands the cache the batch's new
//! queries, keys and values; the cache stores the keys and values and returns the attention
//! output, because only the cache knows where the context lives (contiguous buffers here, paged
//! blocks in [`crate::paged_cache`]) and so how to read it without copying.

use candle_core::{DType, Device, Tensor, D};

use crate::batch::{ForwardBatch, SeqChunk};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

pub trait KvCache {
    /// Store `k`/`v` (`[N, kv_heads, head_dim]`, the batch's new tokens) for `layer` and return
    /// causal attention of `q` (`[N, q_heads, head_dim]`, RoPE applied) over each sequence's
    /// context, `[N, q_heads·head_dim]` in `q`'s dtype. `window`: sliding-window size, if any.
    fn attention(
        &mut self,
        layer: usize,
        batch: &ForwardBatch,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> Result<Tensor>;
}

/// One growable contiguous buffer per (slot, layer), attended with candle's matmul: the simple
/// cache of `flint generate` and the straightforward reference the paged cache is tested against.
pub struct ContiguousKvCache {
    num_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    slots: Vec<Option<SlotBuffers>>,
}

struct SlotBuffers {
    len: usize,
    capacity: usize,
    /// Per layer: (K, V), each `[capacity, kv_heads, head_dim]`.
    layers: Vec<(Tensor, Tensor)>,
}

impl ContiguousKvCache {
    pub fn new(num_layers: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Self {
        Self { num_layers, kv_heads, head_dim, dtype, device: device.clone(), slots: Vec::new() }
    }

    /// A cache shaped for `cfg`'s layers and KV heads.
    pub fn for_config(cfg: &ModelConfig, dtype: DType, device: &Device) -> Self {
        Self::new(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
    }

    /// Tokens cached for `slot` (0 if the slot is unused).
    pub fn len(&self, slot: usize) -> usize {
        self.slots.get(slot).and_then(Option::as_ref).map_or(0, |s| s.len)
    }

    pub fn is_empty(&self, slot: usize) -> bool {
        self.len(slot) == 0
    }

    /// Forget everything cached for `slot`.
    pub fn free(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    /// Keep only the first `len` tokens of `slot` (rolling back rejected tokens).
    pub fn truncate(&mut self, slot: usize, len: usize) {
        if let Some(Some(s)) = self.slots.get_mut(slot) {
            s.len = s.len.min(len);
        }
    }

    fn ensure(&mut self, slot: usize, needed: usize) -> Result<&mut SlotBuffers> {
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, || None);
        }
        let (layers, kvh, hd, dtype, dev) =
            (self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device.clone());
        let entry = &mut self.slots[slot];
        let old_cap = entry.as_ref().map_or(0, |s| s.capacity);
        if needed > old_cap {
            // Grow geometrically so a long generation copies O(n) in total.
            let capacity = needed.max(old_cap * 2).max(64);
            let mut fresh = Vec::with_capacity(layers);
            for l in 0..layers {
                let k = Tensor::zeros((capacity, kvh, hd), dtype, &dev)?;
                let v = Tensor::zeros((capacity, kvh, hd), dtype, &dev)?;
                if let Some(old) = entry.as_ref().filter(|s| s.len > 0) {
                    k.slice_set(&old.layers[l].0.narrow(0, 0, old.len)?, 0, 0)?;
                    v.slice_set(&old.layers[l].1.narrow(0, 0, old.len)?, 0, 0)?;
                }
                fresh.push((k, v));
            }
            let len = entry.as_ref().map_or(0, |s| s.len);
            *entry = Some(SlotBuffers { len, capacity, layers: fresh });
        }
        entry.as_mut().ok_or_else(|| ModelError::Batch("cache slot vanished".into()))
    }
}

impl ContiguousKvCache {
    /// Store `chunk`'s keys and values and return its whole context, `[len, kv_heads, head_dim]`.
    fn append(&mut self, layer: usize, chunk: &SeqChunk, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if layer >= self.num_layers {
            return Err(ModelError::Batch(format!("layer {layer} out of range")));
        }
        let end = chunk.context_len + chunk.num_tokens;
        let have = self.len(chunk.seq);
        // Every layer of a pass writes the same positions; the first layer checks continuity.
        if layer == 0 && chunk.context_len != have {
            return Err(ModelError::Batch(format!(
                "sequence {} holds {have} tokens but the chunk starts at {}",
                chunk.seq, chunk.context_len
            )));
        }
        let (dtype, last_layer) = (self.dtype, layer + 1 == self.num_layers);
        let s = self.ensure(chunk.seq, end)?;
        let (kb, vb) = &s.layers[layer];
        kb.slice_set(&k.to_dtype(dtype)?.contiguous()?, 0, chunk.context_len)?;
        vb.slice_set(&v.to_dtype(dtype)?.contiguous()?, 0, chunk.context_len)?;
        let out = (kb.narrow(0, 0, end)?, vb.narrow(0, 0, end)?);
        if last_layer {
            s.len = end;
        }
        Ok(out)
    }
}

impl KvCache for ContiguousKvCache {
    fn attention(
        &mut self,
        layer: usize,
        batch: &ForwardBatch,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let mut outs = Vec::with_capacity(batch.seqs.len());
        let mut offset = 0;
        for chunk in &batch.seqs {
            let len = chunk.num_tokens;
            let (kc, vc) = self.append(layer, chunk, &k.narrow(0, offset, len)?, &v.narrow(0, offset, len)?)?;
            outs.push(attend(&q.narrow(0, offset, len)?, &kc, &vc, chunk.context_len, window)?);
            offset += len;
        }
        Ok(if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(&outs, 0)? })
    }
}

/// Causal attention of one sequence's new queries `[n, hq, d]` over its keys and values
/// `[T, hkv, d]` (T = ctx + n). Returns `[n, hq·d]`. Grouped-query attention folds the query
/// heads sharing a KV head into the rows of one matrix product instead of repeating K/V.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, ctx: usize, window: Option<usize>) -> Result<Tensor> {
    let (n, hq, d) = q.dims3()?;
    let (t, hkv, _) = k.dims3()?;
    let g = hq / hkv;
    let dtype = q.dtype();
    // Rows of each KV head's score matrix: token i, group member j → row i·g + j.
    let q = q.reshape((n, hkv, g, d))?.permute((1, 0, 2, 3))?.contiguous()?.reshape((hkv, n * g, d))?;
    let k = k.to_dtype(dtype)?.transpose(0, 1)?.contiguous()?; // [hkv, T, d]
    let v = v.to_dtype(dtype)?.transpose(0, 1)?.contiguous()?;
    let scale = 1.0 / (d as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?; // [hkv, n·g, T]
    let scores = match causal_mask(n, g, t, ctx, window) {
        Some(mask) => scores.broadcast_add(&Tensor::from_vec(mask, (n * g, t), q.device())?)?,
        None => scores,
    };
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)?;
    let out = p.matmul(&v)?; // [hkv, n·g, d]
    Ok(out.reshape((hkv, n, g, d))?.permute((1, 0, 2, 3))?.contiguous()?.reshape((n, hq * d))?)
}

/// Additive mask `[n·g, T]`: token i (at position ctx + i) sees keys j ≤ ctx + i, and with a
/// sliding window only the last `window` of them. `None` when nothing is masked.
fn causal_mask(n: usize, g: usize, t: usize, ctx: usize, window: Option<usize>) -> Option<Vec<f32>> {
    let windowed = window.is_some_and(|w| t > w);
    if n == 1 && !windowed {
        return None;
    }
    let mut mask = vec![0f32; n * g * t];
    for i in 0..n {
        let pos = ctx + i;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for j in 0..g {
            let row = &mut mask[(i * g + j) * t..(i * g + j + 1) * t];
            for (key, m) in row.iter_mut().enumerate() {
                if key > pos || key < lo {
                    *m = f32::NEG_INFINITY;
                }
            }
        }
    }
    Some(mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::LogitsRows;

    fn chunk(seq: usize, context_len: usize, n: usize) -> SeqChunk {
        SeqChunk {
            seq,
            context_len,
            num_tokens: n,
            logits: LogitsRows::None,
            hidden: LogitsRows::None,
            blocks: Vec::new(),
        }
    }

    fn kv(n: usize, start: f32) -> Tensor {
        Tensor::arange(start, start + (n * 2 * 3) as f32, &Device::Cpu).unwrap().reshape((n, 2, 3)).unwrap()
    }

    #[test]
    fn mask_shapes() {
        assert!(causal_mask(1, 4, 10, 9, None).is_none());
        let m = causal_mask(2, 1, 5, 3, None).unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(m, vec![0., 0., 0., 0., inf, 0., 0., 0., 0., 0.]);
        let w = causal_mask(1, 1, 5, 4, Some(2)).unwrap();
        assert_eq!(w, vec![inf, inf, inf, 0., 0.]);
    }

    #[test]
    fn grows_keeps_data_truncates_and_refuses_gaps() {
        let mut c = ContiguousKvCache::new(2, 2, 3, DType::F32, &Device::Cpu);
        let a = kv(50, 0.0);
        for layer in 0..2 {
            c.append(layer, &chunk(1, 0, 50), &a, &a).unwrap();
        }
        assert_eq!(c.len(1), 50);
        // Past the first capacity (64): earlier entries survive the regrowth.
        let b = kv(30, 1000.0);
        let mut got = None;
        for layer in 0..2 {
            got = Some(c.append(layer, &chunk(1, 50, 30), &b, &b).unwrap());
        }
        let (k, _) = got.unwrap();
        assert_eq!(k.dims(), &[80, 2, 3]);
        assert_eq!(k.narrow(0, 0, 50).unwrap().to_vec3::<f32>().unwrap(), a.to_vec3::<f32>().unwrap());
        assert_eq!(k.narrow(0, 50, 30).unwrap().to_vec3::<f32>().unwrap(), b.to_vec3::<f32>().unwrap());
        // Roll back 10 tokens, then continue from 70.
        c.truncate(1, 70);
        assert_eq!(c.len(1), 70);
        assert!(c.append(0, &chunk(1, 80, 1), &kv(1, 0.0), &kv(1, 0.0)).is_err(), "a gap must be refused");
        c.append(0, &chunk(1, 70, 1), &kv(1, 0.0), &kv(1, 0.0)).unwrap();
        c.free(1);
        assert!(c.is_empty(1));
        assert!(c.is_empty(7));
    }
}
