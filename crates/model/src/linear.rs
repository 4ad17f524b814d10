//! A projection `y = x·Wᵀ (+ b)` whose weight is dense or GGUF-quantized. On the CPU, f32, bf16
//! and f16 weights go through flint's batch-invariant kernel ([`crate::kernels::matmul_f32`];
//! bf16 possibly in [`crate::kernels::matmul_bf16`]'s dot products),
//! Q8_0/Q4_0/Q4_K/Q6_K through its int8 kernel ([`crate::kernels::matmul_q8`]); other types and
//! devices through candle (whose quantized CPU kernels are row-independent too).

use std::mem::MaybeUninit;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::error::Result;
use crate::kernels::matmul_f32::{self, Bf16Compute, PackedF32};
use crate::kernels::matmul_q8::{self, Format, PackedQ8};
use crate::kernels::rowwise::with_f32;
use crate::weights::Weight;

pub enum Linear {
    /// f32, bf16 or f16 on the CPU, packed for [`matmul_f32`] (bf16 may be computed in
    /// [`crate::kernels::matmul_bf16`]'s dot products; the rest in f32 arithmetic).
    Packed {
        w: Arc<PackedF32>,
        b: Option<Tensor>,
    },
    /// GGUF Q8_0/Q4_0/Q4_K/Q6_K on the CPU, repacked for [`matmul_q8`] (int8 dot products).
    PackedQ8 {
        w: Arc<PackedQ8>,
        b: Option<Tensor>,
    },
    /// `w` is `[out, in]` in the compute dtype.
    Dense {
        w: Tensor,
        b: Option<Tensor>,
    },
    Quantized {
        w: QMatMul,
        b: Option<Tensor>,
    },
}

impl Linear {
    pub fn new(w: Weight, b: Option<Tensor>) -> Result<Self> {
        Ok(match w {
            Weight::Dense(w) if matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16) && w.device().is_cpu() => {
                Linear::Packed { w: Arc::new(pack(&w)?), b }
            }
            Weight::Dense(w) => Linear::Dense { w, b },
            Weight::Quantized(q) => match pack_q8(&q)? {
                Some(p) => Linear::PackedQ8 { w: Arc::new(p), b },
                None => Linear::Quantized { w: QMatMul::from_qtensor(q)?, b },
            },
        })
    }

    /// How a packed bf16 weight is computed (`None` for every other kind).
    pub fn bf16_compute(&self) -> Option<Bf16Compute> {
        match self {
            Linear::Packed { w, .. } => w.bf16_compute(),
            _ => None,
        }
    }

    /// Whether each output row is computed independently of the other rows in the call, in a
    /// fixed order (flint's f32 kernel, candle's quantized kernels), rather than by candle's dense
    /// matmul, which picks kernels by row count.
    pub fn is_row_independent(&self) -> bool {
        !matches!(self, Linear::Dense { .. })
    }

    /// [`forward`](Self::forward) as a flat f32 `Vec` `[n · out]` when one of flint's CPU
    /// kernels computes it (no copy out of a tensor); `None` for the candle paths.
    pub fn forward_vec(&self, x: &Tensor) -> Result<Option<Vec<f32>>> {
        Ok(match self {
            Linear::Packed { w, b } => {
                Some(on_cpu_vec(x, w.out_features(), b.as_ref(), |xs, m, y| matmul_f32::matmul_uninit(xs, m, w, y))?)
            }
            Linear::PackedQ8 { w, b } => {
                Some(on_cpu_vec(x, w.out_features(), b.as_ref(), |xs, m, y| matmul_q8::matmul_uninit(xs, m, w, y))?)
            }
            Linear::Dense { .. } | Linear::Quantized { .. } => None,
        })
    }

    /// [`forward_vec`](Self::forward_vec) of several projections of the same `x`. When every
    /// one is a CPU int8 weight, or every one a packed dense weight, they go through one kernel
    /// call (int8 and bf16 dot products prepare the rows once, and the matrices share one
    /// parallel region); a mix runs each on its own `forward_vec`.
    /// `None` when one of them has no flint kernel. Each result has the bits its own
    /// `forward_vec` gives.
    pub fn forward_vec_many(x: &Tensor, linears: &[&Linear]) -> Result<Option<Vec<Vec<f32>>>> {
        if !linears.iter().all(|l| matches!(l, Linear::Packed { .. } | Linear::PackedQ8 { .. })) {
            return Ok(None);
        }
        let int8: Option<Vec<_>> = linears
            .iter()
            .map(|l| match l {
                Linear::PackedQ8 { w, b } => Some((w.as_ref(), b.as_ref())),
                _ => None,
            })
            .collect();
        let Some(parts) = int8 else {
            return Self::forward_vec_many_dense(x, linears);
        };
        let ws: Vec<&PackedQ8> = parts.iter().map(|(w, _)| *w).collect();
        let outs: Vec<(usize, Option<&Tensor>)> = parts.iter().map(|(w, b)| (w.out_features(), *b)).collect();
        let kernel =
            |xs: &[f32], m, views: &mut [&mut [MaybeUninit<f32>]]| matmul_q8::matmul_many_uninit(xs, m, &ws, views);
        Ok(Some(on_cpu_many(x, &outs, kernel)?))
    }

    /// [`forward_vec_many`](Self::forward_vec_many) when every weight is a packed dense one
    /// (f32, bf16, f16): one [`matmul_f32::matmul_many_uninit`] call, which rounds the rows once
    /// for bf16 dot products; a mix with int8 weights runs each on its own.
    fn forward_vec_many_dense(x: &Tensor, linears: &[&Linear]) -> Result<Option<Vec<Vec<f32>>>> {
        let dense: Option<Vec<_>> = linears
            .iter()
            .map(|l| match l {
                Linear::Packed { w, b } => Some((w, b.as_ref())),
                _ => None,
            })
            .collect();
        let Some(parts) = dense.filter(|p| p.iter().all(|(w, _)| w.in_features() == p[0].0.in_features())) else {
            return linears.iter().map(|l| l.forward_vec(x)).collect();
        };
        let ws: Vec<&PackedF32> = parts.iter().map(|(w, _)| w.as_ref()).collect();
        let outs: Vec<(usize, Option<&Tensor>)> = parts.iter().map(|(w, b)| (w.out_features(), *b)).collect();
        let kernel =
            |xs: &[f32], m, views: &mut [&mut [MaybeUninit<f32>]]| matmul_f32::matmul_many_uninit(xs, m, &ws, views);
        Ok(Some(on_cpu_many(x, &outs, kernel)?))
    }

    /// `silu(gate(x)) · up(x)` as a flat `Vec` `[n · out]` straight from a kernel's fused
    /// epilogue ([`matmul_q8::matmul_gated_uninit`], [`matmul_f32::matmul_gated_uninit`]), when
    /// both are bias-free CPU weights of one shape, int8 or bf16 in dot products; `None`
    /// otherwise. The bits are those of the two projections followed by
    /// [`rowwise::silu_mul`](crate::kernels::rowwise::silu_mul).
    pub fn forward_gated(x: &Tensor, gate: &Linear, up: &Linear) -> Result<Option<Vec<f32>>> {
        if let (Linear::Packed { w: g, b: None }, Linear::Packed { w: u, b: None }) = (gate, up) {
            let same = (g.in_features(), g.out_features()) == (u.in_features(), u.out_features());
            let paired = matches!(g.bf16_compute(), Some(Bf16Compute::Dot | Bf16Compute::Tiles));
            if !(same && paired && g.bf16_compute() == u.bf16_compute()) {
                return Ok(None);
            }
            // Both bf16 pair panels of one shape, as checked just above, so the kernel takes them
            // and writes every output; were it to decline, NaNs (not uninitialised memory).
            let kernel = |xs: &[f32], m, y: &mut [MaybeUninit<f32>]| {
                if !matmul_f32::matmul_gated_uninit(xs, m, g, u, y) {
                    y.fill(MaybeUninit::new(f32::NAN));
                }
            };
            return Ok(Some(on_cpu_vec(x, g.out_features(), None, kernel)?));
        }
        let (Linear::PackedQ8 { w: g, b: None }, Linear::PackedQ8 { w: u, b: None }) = (gate, up) else {
            return Ok(None);
        };
        if (g.in_features(), g.out_features()) != (u.in_features(), u.out_features()) {
            return Ok(None);
        }
        let kernel = |xs: &[f32], m, y: &mut [MaybeUninit<f32>]| matmul_q8::matmul_gated_uninit(xs, m, g, u, y);
        Ok(Some(on_cpu_vec(x, g.out_features(), None, kernel)?))
    }

    /// `x`: `[n, in]` → `[n, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, b) = match self {
            Linear::Packed { w, b } => {
                return on_cpu(x, w.out_features(), b.as_ref(), |xs, m, y| matmul_f32::matmul_uninit(xs, m, w, y))
            }
            Linear::PackedQ8 { w, b } => {
                return on_cpu(x, w.out_features(), b.as_ref(), |xs, m, y| matmul_q8::matmul_uninit(xs, m, w, y))
            }
            Linear::Dense { w, b } => (x.matmul(&w.t()?)?, b),
            Linear::Quantized { w, b } => {
                // candle's quantized kernels take f32 activations.
                let x32 = if x.dtype() == DType::F32 { x.clone() } else { x.to_dtype(DType::F32)? };
                let y = w.forward(&x32.contiguous()?)?;
                (if x.dtype() == DType::F32 { y } else { y.to_dtype(x.dtype())? }, b)
            }
        };
        Ok(match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Run one of flint's CPU kernels (`kernel(x, rows, y)`, which writes all of `y`) on `x`
/// `[n, in]`, reading `x` in place when it is f32, and add the bias.
fn on_cpu(
    x: &Tensor,
    out: usize,
    bias: Option<&Tensor>,
    kernel: impl Fn(&[f32], usize, &mut [MaybeUninit<f32>]),
) -> Result<Tensor> {
    let y = Tensor::from_vec(on_cpu_vec(x, out, bias, kernel)?, (x.dim(0)?, out), x.device())?;
    Ok(if x.dtype() == DType::F32 { y } else { y.to_dtype(x.dtype())? })
}

/// [`on_cpu`]'s result as the plain `[n · out]` vector.
fn on_cpu_vec(
    x: &Tensor,
    out: usize,
    bias: Option<&Tensor>,
    kernel: impl Fn(&[f32], usize, &mut [MaybeUninit<f32>]),
) -> Result<Vec<f32>> {
    let (m, _) = x.dims2()?;
    // Not zero-filled first: for the lm_head of a batch that alone is megabytes per step.
    let mut y: Vec<f32> = Vec::with_capacity(m * out);
    with_f32(x, |xs| kernel(xs, m, &mut y.spare_capacity_mut()[..m * out]))?;
    // SAFETY: the kernels write every one of the `m · out` outputs (each panel stripe puts every
    // row of every panel in its range, and the stripes cover all panels); `with_f32` only
    // returns Ok after running the kernel.
    unsafe { y.set_len(m * out) };
    add_bias(&mut y, out, bias)?;
    Ok(y)
}

/// [`on_cpu_vec`] for a kernel that writes several outputs of the same rows in one call:
/// output `j` is `[n · outs[j].0]`, its bias `outs[j].1` added.
fn on_cpu_many(
    x: &Tensor,
    outs: &[(usize, Option<&Tensor>)],
    kernel: impl Fn(&[f32], usize, &mut [&mut [MaybeUninit<f32>]]),
) -> Result<Vec<Vec<f32>>> {
    let (m, _) = x.dims2()?;
    // Not zero-filled first: the kernel writes every output (as in `on_cpu_vec`).
    let mut ys: Vec<Vec<f32>> = outs.iter().map(|&(out, _)| Vec::with_capacity(m * out)).collect();
    with_f32(x, |xs| {
        let mut views: Vec<&mut [MaybeUninit<f32>]> =
            ys.iter_mut().zip(outs).map(|(y, &(out, _))| &mut y.spare_capacity_mut()[..m * out]).collect();
        kernel(xs, m, &mut views)
    })?;
    for (y, &(out, bias)) in ys.iter_mut().zip(outs) {
        // SAFETY: the kernel wrote all `m · out` values of each output (it is only skipped when
        // `with_f32` fails, which returned early above).
        unsafe { y.set_len(m * out) };
        add_bias(y, out, bias)?;
    }
    Ok(ys)
}

/// Add `bias` (`[out]`) to every `out`-wide row of `y`.
fn add_bias(y: &mut [f32], out: usize, bias: Option<&Tensor>) -> Result<()> {
    if let Some(b) = bias {
        with_f32(b, |bs| y.chunks_exact_mut(out).for_each(|row| row.iter_mut().zip(bs).for_each(|(v, b)| *v += b)))?;
    }
    Ok(())
}

/// Repack a CPU Q8_0, Q4_0, Q4_K or Q6_K `[out, in]` weight for flint's int8 kernel; `None`
/// for other types.
pub fn pack_q8(q: &QTensor) -> Result<Option<PackedQ8>> {
    if !q.device().is_cpu() {
        return Ok(None);
    }
    let (out, inp) = q.shape().dims2()?;
    pack_q8_rows(q, out, inp)
}

/// [`pack_q8`] of a CPU tensor read as `out` rows of `inp` (a mixture's merged experts,
/// `[experts, out, in]`, as one `[experts · out, in]` matrix); `None` for other types.
pub fn pack_q8_rows(q: &QTensor, out: usize, inp: usize) -> Result<Option<PackedQ8>> {
    let format = match q.dtype() {
        GgmlDType::Q8_0 => Format::Q8_0,
        GgmlDType::Q4_0 => Format::Q4_0,
        GgmlDType::Q4K => Format::Q4_K,
        GgmlDType::Q6K => Format::Q6_K,
        _ => return Ok(None),
    };
    if !q.device().is_cpu() || q.shape().elem_count() != out * inp {
        return Ok(None);
    }
    Ok(PackedQ8::from_ggml(format, &q.data()?, out, inp))
}

thread_local! {
    static BF16_COMPUTE: std::cell::Cell<Option<Bf16Compute>> = const { std::cell::Cell::new(None) };
}

/// Run `f` (a model load on this thread) with bf16 weights packed for `compute` rather than
/// [`Bf16Compute::native`]: the golden tests pin the exact f32 path, and test the bf16 dot path
/// through its emulation on CPUs without the instruction.
pub fn with_bf16_compute<R>(compute: Bf16Compute, f: impl FnOnce() -> R) -> R {
    /// Restores the previous setting however `f` ends (a panicking test included).
    struct Restore(Option<Bf16Compute>);
    impl Drop for Restore {
        fn drop(&mut self) {
            BF16_COMPUTE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(BF16_COMPUTE.with(|c| c.replace(Some(compute))));
    f()
}

/// Pack a dense `[out, in]` weight for the CPU kernel: bf16 stays bf16 (computed as
/// [`Bf16Compute::native`] picks, or as [`with_bf16_compute`] says), f16 stays f16 (widened
/// exactly as it is read), anything else as f32.
pub fn pack(w: &Tensor) -> Result<PackedF32> {
    use candle_core::{CpuStorage, Storage};
    use half::slice::HalfFloatSliceExt;
    let (out, inp) = w.dims2()?;
    let compute = || BF16_COMPUTE.with(|c| c.get()).unwrap_or_else(Bf16Compute::native);
    // Packed straight from the tensor's own storage: a copy of a 1 GB lm_head on the way would
    // be a gigabyte more at the peak of a load.
    {
        let (storage, layout) = w.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            match cpu {
                CpuStorage::BF16(v) => {
                    return Ok(PackedF32::pack_bf16(v[a..b].reinterpret_cast(), out, inp, compute()))
                }
                CpuStorage::F32(v) => return Ok(PackedF32::pack(&v[a..b], out, inp)),
                CpuStorage::F16(v) => return Ok(PackedF32::pack_f16(v[a..b].reinterpret_cast(), out, inp)),
                _ => {}
            }
        }
    }
    if w.dtype() == DType::BF16 {
        let bits: Vec<u16> = w.flatten_all()?.to_vec1::<half::bf16>()?.into_iter().map(|v| v.to_bits()).collect();
        return Ok(PackedF32::pack_bf16(&bits, out, inp, compute()));
    }
    if w.dtype() == DType::F16 {
        let bits: Vec<u16> = w.flatten_all()?.to_vec1::<half::f16>()?.into_iter().map(|v| v.to_bits()).collect();
        return Ok(PackedF32::pack_f16(&bits, out, inp));
    }
    Ok(PackedF32::pack(&w.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?, out, inp))
}
