//! The per-row operations between the matrix products, for f32 on the CPU: RMSNorm, SiLU·mul,
//! the residual add and RoPE, read from and written to the tensors' own buffers.
//!
//! candle would do each as several ops, each a new buffer, on its own spinning thread pool, which
//! then competes for the cores with the matrix kernels' threads. Each output element here depends
//! only on its own row, in a fixed order, so batching cannot change it.

use candle_core::{DType, Storage, Tensor};

use super::attention::exp;
use super::pool;
use crate::error::{ModelError, Result};

/// Below this many elements in all, one thread does the work.
const PARALLEL_MIN: usize = 16_384;

/// Run `f` on `t`'s values as one f32 slice: the tensor's own buffer when it is a contiguous f32
/// CPU tensor, else a converted copy.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if t.dtype() == DType::F32 {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&cpu.as_slice::<f32>()?[start..end]));
        }
    }
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// `out[r] = op(row r of each input)` for `[n, width]` inputs, split across threads by rows.
fn map_rows(n: usize, width: usize, out: &mut [f32], op: impl Fn(usize, &mut [f32]) + Sync) {
    if n > 1 && n * width >= PARALLEL_MIN {
        let per = n.div_ceil(2 * pool::threads());
        pool::run_chunks(out, width * per, |c, chunk| {
            for (i, row) in chunk.chunks_exact_mut(width).enumerate() {
                op(c * per + i, row);
            }
        });
    } else {
        for (r, row) in out.chunks_exact_mut(width).enumerate() {
            op(r, row);
        }
    }
}

/// Sum of squares in eight interleaved partial sums (vectorisable, and a fixed order).
#[inline(always)]
fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i] * c[i];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for v in tail {
        s += v * v;
    }
    s
}

/// `out[r] = op(row r of a, row r of b — or all of b when it is one row shared by every row)`
/// for `a` `[n, w]`, as a new `[n, w]` tensor.
fn zip_rows(a: &Tensor, b: &Tensor, per_row: bool, op: impl Fn(&[f32], &[f32], &mut [f32]) + Sync) -> Result<Tensor> {
    let (n, w) = a.dims2()?;
    let need = if per_row { n * w } else { w };
    if b.elem_count() != need {
        return Err(ModelError::Batch(format!("row-wise operand of shape {:?} does not fit [{n}, {w}]", b.dims())));
    }
    let mut out = vec![0f32; n * w];
    with_f32(a, |xs| {
        with_f32(b, |ys| {
            map_rows(n, w, &mut out, |r, o| {
                let yr = if per_row { &ys[r * w..(r + 1) * w] } else { ys };
                op(&xs[r * w..(r + 1) * w], yr, o)
            })
        })
    })??;
    Ok(Tensor::from_vec(out, (n, w), a.device())?)
}

/// `x / sqrt(mean(x²) + eps) · w` per row of `x` `[n, h]`, as transformers' Qwen2RMSNorm in f32.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dims2()?.1;
    zip_rows(x, w, false, |row, ws, o| {
        let inv = 1.0 / (sum_sq(row) / h as f32 + eps as f32).sqrt();
        for ((o, &v), &wv) in o.iter_mut().zip(row).zip(ws) {
            *o = (v * inv) * wv;
        }
    })
}

/// [`rms_norm`] in place over each `d`-wide head of `x` (Qwen3's q/k norm, `w` of size `d`), with
/// the same arithmetic per row.
pub fn rms_norm_heads(x: &mut [f32], d: usize, w: &[f32], eps: f64) {
    for row in x.chunks_exact_mut(d) {
        let inv = 1.0 / (sum_sq(row) / d as f32 + eps as f32).sqrt();
        for (v, &wv) in row.iter_mut().zip(w) {
            *v = (*v * inv) * wv;
        }
    }
}

/// `silu(gate) · up`, elementwise over `[n, i]`; the sigmoid from a bounded-argument `e^x`
/// (`e^-|g|`, so it never overflows) that vectorises.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    zip_rows(gate, up, true, silu_mul_row)
}

/// One row of [`silu_mul`] (also the gated matmul's epilogue, so the two give the same bits).
pub(crate) fn silu_mul_row(g: &[f32], u: &[f32], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::Isa::Avx512.available() {
        // SAFETY: AVX-512F was just detected. The same IEEE operations, wider vectors.
        return unsafe { silu_mul_row_avx512(g, u, o) };
    }
    silu_mul_row_body(g, u, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_row_avx512(g: &[f32], u: &[f32], o: &mut [f32]) {
    silu_mul_row_body(g, u, o)
}

#[inline(always)]
fn silu_mul_row_body(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &gv), &uv) in o.iter_mut().zip(g).zip(u) {
        let e = exp(-gv.abs());
        let sig = if gv >= 0.0 { 1.0 / (1.0 + e) } else { e / (1.0 + e) };
        *o = gv * sig * uv;
    }
}

/// `a + b` for two `[n, h]` tensors.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    zip_rows(a, b, true, |x, y, o| {
        for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
            *o = x + y;
        }
    })
}

/// Rotate `x` `[n, heads, d]` in place (the half-split rotation of Qwen2/Llama):
/// `(x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin)` with `cos`/`sin` `[n, d/2]`.
pub fn rope(x: &mut [f32], n: usize, heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    for t in 0..n {
        let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
        for hd in x[t * heads * d..(t + 1) * heads * d].chunks_exact_mut(d) {
            let (x1, x2) = hd.split_at_mut(half);
            for j in 0..half {
                let (a, b) = (x1[j], x2[j]);
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    fn t(v: Vec<f32>, n: usize, h: usize) -> Tensor {
        Tensor::from_vec(v, (n, h), &Device::Cpu).unwrap()
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        crate::kernels::xorshift(seed.wrapping_mul(747_796_405).wrapping_add(3))
            .take(n)
            .map(|s| (s % 20_000) as f32 / 1_000.0 - 10.0)
            .collect()
    }

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let (a, b) =
            (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "[{i}] {x} vs {y}");
        }
    }

    /// Each op against the same thing built from candle's ops; the large case takes the
    /// threaded path, and a row's result must not depend on how many rows came with it.
    #[test]
    fn ops_match_candle_and_rows_are_independent() {
        for n in [1, 3, 300] {
            let h = 72;
            let (x, y, w) = (
                t(data(n * h, 1), n, h),
                t(data(n * h, 2), n, h),
                Tensor::from_vec(data(h, 3), h, &Device::Cpu).unwrap(),
            );
            let var = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let want = x.broadcast_div(&(var + 1e-6).unwrap().sqrt().unwrap()).unwrap().broadcast_mul(&w).unwrap();
            close(&rms_norm(&x, &w, 1e-6).unwrap(), &want, 1e-5);
            close(&silu_mul(&x, &y).unwrap(), &(x.silu().unwrap() * &y).unwrap(), 1e-5);
            close(&add(&x, &y).unwrap(), &(&x + &y).unwrap(), 0.0);
            let first = |z: Tensor| z.narrow(0, 0, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let alone = |f: &dyn Fn(&Tensor) -> Tensor| first(f(&x.narrow(0, 0, 1).unwrap().contiguous().unwrap()));
            let norm = |z: &Tensor| rms_norm(z, &w, 1e-6).unwrap();
            assert_eq!(first(norm(&x)), alone(&norm), "rms_norm n={n}");
            let sm = |z: &Tensor| silu_mul(z, z).unwrap();
            assert_eq!(first(sm(&x)), alone(&sm), "silu_mul n={n}");
        }
    }

    #[test]
    fn rope_rotates_each_half_pair() {
        let (n, heads, d) = (2, 3, 4);
        let mut x = data(n * heads * d, 5);
        let orig = x.clone();
        let (cos, sin) = (data(n * d / 2, 6), data(n * d / 2, 7));
        rope(&mut x, n, heads, d, &cos, &sin);
        for t in 0..n {
            for h in 0..heads {
                for j in 0..d / 2 {
                    let at = (t * heads + h) * d;
                    let (a, b, c, s) = (orig[at + j], orig[at + j + d / 2], cos[t * 2 + j], sin[t * 2 + j]);
                    assert_eq!(x[at + j], a * c - b * s);
                    assert_eq!(x[at + j + d / 2], b * c + a * s);
                }
            }
        }
    }
}
