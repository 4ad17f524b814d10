//! The device pool's two operations as candle custom ops: [`WriteKv`] stores a pass's new keys
//! (or values) at their pool slots, in place; [`PagedAttention`] attends each query token over its
//! sequence's context through the block table. Each has a CUDA implementation
//! (`paged_attention.cu`, launched from [`super::cuda`]) and a CPU one written as the plain
//! definition, which is what the tests run here and what the CUDA kernels are checked against on
//! a GPU (the same golden fixtures, through the same pool).
//!
//! Both read the pass's metadata, one u32 tensor (see [`PassMeta`](super::PassMeta)):
//! `[token_seq: N][token_pos: N][slot: N][block_tables: S × max_blocks]`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Shape, Storage, Tensor, WithDType};

/// The shape of one paged-attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub n_tokens: usize,
    pub max_blocks: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Sliding-window size; 0 for none.
    pub window: usize,
    pub scale: f32,
}

/// `cache[slot[t]] = src[t]` for every token `t` of the pass (rows of `kv_heads · head_dim`).
pub(crate) struct WriteKv {
    pub n_tokens: usize,
    pub row: usize,
}

/// `[N, num_heads, head_dim]` attention output for the queries it is applied to.
pub(crate) struct PagedAttention<'a> {
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub meta: &'a Tensor,
    pub shape: AttentionShape,
}

/// A contiguous storage's elements from its layout's offset on.
fn contiguous<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    if !l.is_contiguous() {
        bail!("flint paged attention: {what} must be contiguous");
    }
    Ok(&s.as_slice::<T>()?[l.start_offset()..])
}

fn copy_rows<T: Copy>(cache: &mut [T], src: &[T], slots: &[u32], row: usize) -> candle_core::Result<()> {
    for (t, &slot) in slots.iter().enumerate() {
        let at = slot as usize * row;
        let (Some(dst), Some(from)) = (cache.get_mut(at..at + row), src.get(t * row..(t + 1) * row)) else {
            bail!("flint write_kv: slot {slot} or token {t} is outside the pool or the batch");
        };
        dst.copy_from_slice(from);
    }
    Ok(())
}

impl candle_core::InplaceOp3 for WriteKv {
    fn name(&self) -> &'static str {
        "flint-write-kv"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cache_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
        meta: &CpuStorage,
        meta_l: &Layout,
    ) -> candle_core::Result<()> {
        if !cache_l.is_contiguous() || cache_l.start_offset() != 0 {
            bail!("flint write_kv: the pool must be a whole contiguous tensor");
        }
        let n = self.n_tokens;
        let meta = contiguous::<u32>(meta, meta_l, "the pass metadata")?;
        let Some(slots) = meta.get(2 * n..3 * n) else { bail!("flint write_kv: metadata shorter than 3·N") };
        match (cache, src) {
            (CpuStorage::F32(c), s @ CpuStorage::F32(_)) => {
                copy_rows(c, contiguous(s, src_l, "keys")?, slots, self.row)
            }
            (CpuStorage::BF16(c), s @ CpuStorage::BF16(_)) => {
                copy_rows(c, contiguous(s, src_l, "keys")?, slots, self.row)
            }
            (CpuStorage::F16(c), s @ CpuStorage::F16(_)) => {
                copy_rows(c, contiguous(s, src_l, "keys")?, slots, self.row)
            }
            (c, s) => {
                bail!("flint write_kv: pool {:?} and new rows {:?} must be one float dtype", c.dtype(), s.dtype())
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cache_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
        meta: &candle_core::CudaStorage,
        meta_l: &Layout,
    ) -> candle_core::Result<()> {
        super::cuda::write_kv(self, cache, cache_l, src, src_l, meta, meta_l)
    }
}

/// The definition: for each query token and head, softmax over the scaled dot products with the
/// keys it may see (causal, within the window), then the weighted sum of their values; f32
/// throughout, rounded to `T` once.
fn attend<T: WithDType>(q: &[T], k: &[T], v: &[T], meta: &[u32], s: &AttentionShape) -> candle_core::Result<Vec<T>> {
    let (n, hq, hkv, d, bs) = (s.n_tokens, s.num_heads, s.num_kv_heads, s.head_dim, s.block_size);
    if hkv == 0 || !hq.is_multiple_of(hkv) || q.len() < n * hq * d {
        bail!("flint paged attention: {hq} query heads over {hkv} KV heads, {} query values", q.len());
    }
    let group = hq / hkv;
    let mut out = vec![T::zero(); n * hq * d];
    let (mut scores, mut acc) = (Vec::new(), vec![0f32; d]);
    for t in 0..n {
        let (seq, pos) = (meta[t] as usize, meta[n + t] as usize);
        let table = meta.get(3 * n + seq * s.max_blocks..3 * n + (seq + 1) * s.max_blocks);
        let Some(table) = table else { bail!("flint paged attention: sequence {seq} has no block table") };
        let end = pos + 1;
        let start = if s.window > 0 { end.saturating_sub(s.window) } else { 0 };
        let mut slots = Vec::with_capacity(end - start);
        for j in start..end {
            let Some(&block) = table.get(j / bs) else { bail!("flint paged attention: position {j} has no block") };
            slots.push(block as usize * bs + j % bs);
        }
        for h in 0..hq {
            let kvh = h / group;
            let qr = &q[(t * hq + h) * d..][..d];
            let row = |cache: &[T], slot: usize| -> candle_core::Result<Vec<f32>> {
                let at = (slot * hkv + kvh) * d;
                let Some(r) = cache.get(at..at + d) else {
                    bail!("flint paged attention: slot {slot} outside the pool")
                };
                Ok(r.iter().map(|x| x.to_f64() as f32).collect())
            };
            scores.clear();
            for &slot in &slots {
                let kr = row(k, slot)?;
                scores.push(qr.iter().zip(&kr).map(|(a, b)| a.to_f64() as f32 * s.scale * b).sum::<f32>());
            }
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            acc.fill(0.0);
            for (&slot, &sc) in slots.iter().zip(&scores) {
                let p = (sc - max).exp();
                sum += p;
                for (a, x) in acc.iter_mut().zip(row(v, slot)?) {
                    *a += p * x;
                }
            }
            for (o, a) in out[(t * hq + h) * d..][..d].iter_mut().zip(&acc) {
                *o = T::from_f64((a / sum) as f64);
            }
        }
    }
    Ok(out)
}

impl candle_core::CustomOp1 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "flint-paged-attention"
    }

    fn cpu_fwd(&self, q: &CpuStorage, q_l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let s = &self.shape;
        let (k, k_l) = self.k_cache.storage_and_layout();
        let (v, v_l) = self.v_cache.storage_and_layout();
        let (meta, meta_l) = self.meta.storage_and_layout();
        let (Storage::Cpu(k), Storage::Cpu(v), Storage::Cpu(meta)) = (&*k, &*v, &*meta) else {
            bail!("flint paged attention: the pool and the queries are on different devices");
        };
        let meta = contiguous::<u32>(meta, meta_l, "the pass metadata")?;
        // The reference for one storage type: every input read in place.
        fn run<T: WithDType>(
            [(q, q_l), (k, k_l), (v, v_l)]: [(&CpuStorage, &Layout); 3],
            meta: &[u32],
            s: &AttentionShape,
        ) -> candle_core::Result<Vec<T>> {
            let (q, k, v) =
                (contiguous(q, q_l, "queries")?, contiguous(k, k_l, "keys")?, contiguous(v, v_l, "values")?);
            attend::<T>(q, k, v, meta, s)
        }
        let inputs = [(q, q_l), (k, k_l), (v, v_l)];
        let out = match q {
            CpuStorage::F32(_) => CpuStorage::F32(run(inputs, meta, s)?),
            CpuStorage::BF16(_) => CpuStorage::BF16(run(inputs, meta, s)?),
            CpuStorage::F16(_) => CpuStorage::F16(run(inputs, meta, s)?),
            other => bail!("flint paged attention: queries in {:?} (f32, f16 or bf16)", other.dtype()),
        };
        Ok((out, Shape::from((s.n_tokens, s.num_heads, s.head_dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::paged_attention(self, q, q_l)
    }
}
