//! The engine's KV pool, wherever the model runs: the host pool ([`PagedKvCache`]: f32, bf16 or
//! int8 in RAM, read by flint's CPU attention kernels) for a model on the CPU, the device pool
//! ([`DeviceKvCache`]: the compute dtype in GPU memory, read by the CUDA paged-attention kernel)
//! for a model on a GPU. Both take the engine's block tables as they are.

use candle_core::Tensor;

use crate::batch::ForwardBatch;
use crate::device_cache::DeviceKvCache;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::paged_cache::PagedKvCache;

pub enum KvPool {
    Host(PagedKvCache),
    Device(DeviceKvCache),
}

impl KvPool {
    /// Forget whatever is kept for `blocks`, which no sequence holds any more (the host pool's
    /// int8 staging; the device pool keeps nothing per block).
    pub fn release(&mut self, blocks: &[u32]) {
        if let KvPool::Host(c) = self {
            c.release(blocks);
        }
    }
}

impl KvCache for KvPool {
    fn attention(
        &mut self,
        layer: usize,
        batch: &ForwardBatch,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> Result<Tensor> {
        match self {
            KvPool::Host(c) => c.attention(layer, batch, q, k, v, window),
            KvPool::Device(c) => c.attention(layer, batch, q, k, v, window),
        }
    }
}
