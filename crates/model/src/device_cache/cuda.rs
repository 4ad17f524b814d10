//! Launching the device pool's kernels (`paged_attention.cu`, compiled to PTX by `build.rs`) on a
//! candle CUDA device. The PTX is loaded once per device, as a custom module.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape};

use super::ops::{PagedAttention, WriteKv};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));
const MODULE: &str = "flint_paged_attention";
/// `THREADS` in the kernel source.
const THREADS: u32 = 128;
/// `MAX_HEAD_DIM` in the kernel source.
pub(crate) const MAX_HEAD_DIM: usize = 256;

fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => bail!("flint paged attention: {other:?} is not a KV pool dtype (f32, f16, bf16)"),
    })
}

fn u32_arg(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("flint paged attention: {what} {x} exceeds u32")))
}

pub(super) fn write_kv(
    op: &WriteKv,
    cache: &mut CudaStorage,
    cache_l: &Layout,
    src: &CudaStorage,
    src_l: &Layout,
    meta: &CudaStorage,
    meta_l: &Layout,
) -> Result<()> {
    if !cache_l.is_contiguous() || cache_l.start_offset() != 0 || !src_l.is_contiguous() || !meta_l.is_contiguous() {
        bail!("flint write_kv: the pool, the new rows and the metadata must be contiguous");
    }
    if cache.dtype() != src.dtype() {
        bail!("flint write_kv: pool {:?} and new rows {:?} must be one dtype", cache.dtype(), src.dtype());
    }
    fn go<T: CudaDType + DeviceRepr>(
        op: &WriteKv,
        cache: &mut CudaStorage,
        src: &CudaStorage,
        src_off: usize,
        meta: &CudaStorage,
        meta_off: usize,
        name: &str,
    ) -> Result<()> {
        let dev = cache.device.clone();
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let (n, row) = (u32_arg(op.n_tokens, "tokens")?, u32_arg(op.row, "row")?);
        let src = src.as_cuda_slice::<T>()?.slice(src_off..);
        let meta = meta.as_cuda_slice::<u32>()?.slice(meta_off..);
        let dst = cache.as_cuda_slice_mut::<T>()?;
        let cfg = LaunchConfig { grid_dim: (n, 1, 1), block_dim: (row.clamp(32, 256), 1, 1), shared_mem_bytes: 0 };
        let mut b = func.builder();
        b.arg(dst).arg(&src).arg(&meta).arg(&n).arg(&row);
        // SAFETY: the argument list matches write_kv_*'s signature; the host built every slot
        // inside the pool and the source holds n rows.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
    if op.n_tokens == 0 {
        return Ok(());
    }
    if src_l.shape().elem_count() < op.n_tokens * op.row
        || meta_l.shape().elem_count() < 3 * op.n_tokens
        || !cache_l.shape().elem_count().is_multiple_of(op.row.max(1))
    {
        bail!("flint write_kv: new rows or metadata are smaller than the call's shape");
    }
    let name = format!("write_kv_{}", suffix(cache.dtype())?);
    let (so, mo) = (src_l.start_offset(), meta_l.start_offset());
    match cache.dtype() {
        DType::F32 => go::<f32>(op, cache, src, so, meta, mo, &name),
        DType::F16 => go::<half::f16>(op, cache, src, so, meta, mo, &name),
        _ => go::<half::bf16>(op, cache, src, so, meta, mo, &name),
    }
}

pub(super) fn paged_attention(op: &PagedAttention, q: &CudaStorage, q_l: &Layout) -> Result<(CudaStorage, Shape)> {
    let s = op.shape;
    if s.head_dim > MAX_HEAD_DIM {
        bail!("flint paged attention: head size {} exceeds the CUDA kernel's {MAX_HEAD_DIM}", s.head_dim);
    }
    if !q_l.is_contiguous() {
        bail!("flint paged attention: the queries must be contiguous");
    }
    let (k, k_l) = op.k_cache.storage_and_layout();
    let (v, v_l) = op.v_cache.storage_and_layout();
    let (meta, meta_l) = op.meta.storage_and_layout();
    let (candle_core::Storage::Cuda(k), candle_core::Storage::Cuda(v), candle_core::Storage::Cuda(meta)) =
        (&*k, &*v, &*meta)
    else {
        bail!("flint paged attention: the pool and the queries are on different devices");
    };
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("flint paged attention: queries {:?}, pool {:?}", q.dtype(), k.dtype());
    }
    if !k_l.is_contiguous() || !v_l.is_contiguous() || !meta_l.is_contiguous() {
        bail!("flint paged attention: the pool and the metadata must be contiguous");
    }
    let row = s.num_kv_heads * s.head_dim;
    let meta_len = 3 * s.n_tokens + s.max_blocks;
    if q_l.shape().elem_count() < s.n_tokens * s.num_heads * s.head_dim
        || k_l.shape().elem_count() != v_l.shape().elem_count()
        || !k_l.shape().elem_count().is_multiple_of(row.max(1))
        || meta_l.shape().elem_count() < meta_len
    {
        bail!("flint paged attention: queries, pool or metadata are smaller than the call's shape");
    }
    let offs = [q_l.start_offset(), k_l.start_offset(), v_l.start_offset(), meta_l.start_offset()];

    fn go<T: CudaDType + DeviceRepr>(
        s: &super::ops::AttentionShape,
        [q, k, v, meta]: [&CudaStorage; 4],
        [qo, ko, vo, mo]: [usize; 4],
        name: &str,
    ) -> Result<CudaStorage> {
        let dev = q.device.clone();
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let n_out = s.n_tokens * s.num_heads * s.head_dim;
        // SAFETY: every element is written by the kernel (one block per token and head, each
        // thread its own dimensions) before anything reads it.
        let mut out = unsafe { dev.alloc::<T>(n_out.max(1)) }?;
        if s.n_tokens > 0 {
            let q = q.as_cuda_slice::<T>()?.slice(qo..);
            let k = k.as_cuda_slice::<T>()?.slice(ko..);
            let v = v.as_cuda_slice::<T>()?.slice(vo..);
            let meta = meta.as_cuda_slice::<u32>()?.slice(mo..);
            let args = [
                u32_arg(s.n_tokens, "tokens")?,
                u32_arg(s.max_blocks, "blocks per sequence")?,
                u32_arg(s.num_heads, "heads")?,
                u32_arg(s.num_kv_heads, "KV heads")?,
                u32_arg(s.head_dim, "head size")?,
                u32_arg(s.block_size, "block size")?,
                u32_arg(s.window, "window")?,
            ];
            let cfg = LaunchConfig { grid_dim: (args[0], args[2], 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut b = func.builder();
            b.arg(&mut out).arg(&q).arg(&k).arg(&v).arg(&meta);
            for a in &args {
                b.arg(a);
            }
            b.arg(&s.scale);
            // SAFETY: the argument list matches paged_attention_*'s signature; the host checked
            // every block id against the pool and head_dim against MAX_HEAD_DIM.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = format!("paged_attention_{}", suffix(q.dtype())?);
    let storages = [q, k, v, meta];
    let out = match q.dtype() {
        DType::F32 => go::<f32>(&s, storages, offs, &name)?,
        DType::F16 => go::<half::f16>(&s, storages, offs, &name)?,
        _ => go::<half::bf16>(&s, storages, offs, &name)?,
    };
    Ok((out, Shape::from((s.n_tokens, s.num_heads, s.head_dim))))
}
