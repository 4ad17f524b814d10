//! The model's view of a KV cache it does not own. The forward pass hands each layer's new keys
//! and values to the cache and gets back what the chunk attends to; where they live (contiguous
//! buffers here, paged blocks in the engine) is the cache's business.

use candle_core::{DType, Device, Tensor};

use crate::batch::SeqChunk;
use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};

pub trait KvCache {
    /// Store `k`/`v` (`[num_tokens, kv_heads, head_dim]`) of `chunk` for `layer` at positions
    /// `context_len..context_len + num_tokens`, and return the sequence's keys and values for
    /// positions `0..context_len + num_tokens`, each `[len, kv_heads, head_dim]`.
    fn append(&mut self, layer: usize, chunk: &SeqChunk, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)>;
}

/// One growable contiguous buffer per (slot, layer): the simple cache used by `flint generate`
/// and the golden tests until the engine's paged cache replaces it.
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
    pub fn for_config(cfg: &Qwen2Config, dtype: DType, device: &Device) -> Self {
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

impl KvCache for ContiguousKvCache {
    fn append(&mut self, layer: usize, chunk: &SeqChunk, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if layer >= self.num_layers {
            return Err(ModelError::Batch(format!("layer {layer} out of range")));
        }
        let end = chunk.context_len + chunk.num_tokens;
        let have = self.len(chunk.slot);
        // Every layer of a pass writes the same positions; the first layer checks continuity.
        if layer == 0 && chunk.context_len != have {
            return Err(ModelError::Batch(format!(
                "slot {} holds {have} tokens but the chunk starts at {}",
                chunk.slot, chunk.context_len
            )));
        }
        let (dtype, last_layer) = (self.dtype, layer + 1 == self.num_layers);
        let s = self.ensure(chunk.slot, end)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::LogitsRows;

    fn chunk(slot: usize, context_len: usize, n: usize) -> SeqChunk {
        SeqChunk { slot, context_len, num_tokens: n, logits: LogitsRows::None }
    }

    fn kv(n: usize, start: f32) -> Tensor {
        Tensor::arange(start, start + (n * 2 * 3) as f32, &Device::Cpu).unwrap().reshape((n, 2, 3)).unwrap()
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
