//! `y = x·Wᵀ` in f32 whose every output row is bit-identical however many rows share the call.
//!
//! candle's CPU matmul (the `gemm` crate) picks a different kernel for one row than for several,
//! and another when the output is narrow (a 128-wide k_proj), so a request's logits changed with
//! the batch around it. Here every output element is one accumulator fed `x[k]·w[k]` for
//! k = 0, 1, …, K−1 in order with a fused multiply-add, whatever the tiling, the thread split or
//! the instruction set: AVX-512, AVX2+FMA and the scalar `f32::mul_add` reference all round
//! exactly the same way. The weight is packed once at load into panels of 16 output columns,
//! `[out/16][in][16]`, so the inner loop streams it contiguously.

use super::by_panel_stripes;

/// Output columns per panel: one AVX-512 register, two AVX2 registers.
pub const PANEL: usize = 16;
/// Rows per micro-tile: eight rows share each loaded panel vector (16 AVX-512 accumulators).
const ROWS: usize = 8;

/// A `[out, in]` weight packed for [`matmul`].
#[derive(Clone)]
pub struct PackedF32 {
    out: usize,
    inp: usize,
    panels: Vec<f32>,
}

impl PackedF32 {
    /// Pack a row-major `[out, in]` matrix (a Linear weight as checkpoints store it).
    pub fn pack(w: &[f32], out: usize, inp: usize) -> Self {
        assert_eq!(w.len(), out * inp, "packed weight length");
        let num_panels = out.div_ceil(PANEL);
        let mut panels = vec![0f32; num_panels * inp * PANEL];
        for (o, row) in w.chunks_exact(inp).enumerate() {
            let base = (o / PANEL) * inp * PANEL + o % PANEL;
            for (k, &v) in row.iter().enumerate() {
                panels[base + k * PANEL] = v;
            }
        }
        Self { out, inp, panels }
    }

    pub fn out_features(&self) -> usize {
        self.out
    }

    pub fn in_features(&self) -> usize {
        self.inp
    }

    /// Row `o` of the original matrix (an embedding lookup from a tied lm_head).
    pub fn row(&self, o: usize, dst: &mut [f32]) {
        let base = (o / PANEL) * self.inp * PANEL + o % PANEL;
        for (k, d) in dst.iter_mut().enumerate().take(self.inp) {
            *d = self.panels[base + k * PANEL];
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2Fma,
    Avx512,
}

/// The best instruction set this CPU supports (checked at run time, so one binary runs anywhere).
pub fn detect_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Isa::Avx2Fma;
        }
    }
    Isa::Scalar
}

fn supported(isa: Isa) -> bool {
    match isa {
        Isa::Scalar => true,
        Isa::Avx2Fma => matches!(detect_isa(), Isa::Avx2Fma | Isa::Avx512),
        Isa::Avx512 => detect_isa() == Isa::Avx512,
    }
}

/// `y[m, out] = x[m, in] · Wᵀ`. Panels are split across rayon's threads; rows are tiled by eight.
pub fn matmul(x: &[f32], m: usize, w: &PackedF32, y: &mut [f32]) {
    matmul_with(detect_isa(), x, m, w, y)
}

/// [`matmul`] with an explicit instruction set (tests compare them bit for bit). One this CPU
/// lacks falls back to the scalar path, which gives the same bits.
pub fn matmul_with(isa: Isa, x: &[f32], m: usize, w: &PackedF32, y: &mut [f32]) {
    let isa = if supported(isa) { isa } else { Isa::Scalar };
    assert_eq!(x.len(), m * w.inp, "matmul input length");
    assert_eq!(y.len(), m * w.out, "matmul output length");
    let panel = |p: usize| &w.panels[p * w.inp * PANEL..(p + 1) * w.inp * PANEL];
    by_panel_stripes(m, w.out, PANEL, 2, y, |p0, p1, stripe| {
        // Two panels at a time: eight independent accumulators hide the FMA latency.
        for p in (p0..p1).step_by(2) {
            let pair = p + 1 < p1;
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(ROWS);
                let xs = &x[r * w.inp..(r + rows) * w.inp];
                let mut acc = [[[0f32; PANEL]; ROWS]; 2];
                let [a0, a1] = &mut acc;
                if pair {
                    tile_pair(isa, xs, rows, w.inp, panel(p), panel(p + 1), a0, a1);
                } else {
                    tile(isa, xs, rows, w.inp, panel(p), a0);
                }
                for (j, a) in acc.iter().enumerate().take(1 + usize::from(pair)) {
                    for (i, row) in a.iter().enumerate().take(rows) {
                        stripe.put(r + i, p + j - p0, row);
                    }
                }
                r += rows;
            }
        }
    });
}

/// `acc[i][c] = Σ_k x[i][k] · panel[k][c]` for `rows ≤ 4` rows, k ascending, one FMA per term.
fn tile(isa: Isa, x: &[f32], rows: usize, k: usize, panel: &[f32], acc: &mut [[f32; PANEL]; ROWS]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect_isa` (or the caller, in tests, after checking) confirmed the features.
        Isa::Avx512 => unsafe { x86::tile_avx512(x, rows, k, panel, acc) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { x86::tile_avx2(x, rows, k, panel, acc) },
        _ => tile_scalar(x, rows, k, panel, acc),
    }
}

/// [`tile`] on two panels; the same sums, computed side by side where the ISA allows.
#[allow(clippy::too_many_arguments)]
fn tile_pair(
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    p0: &[f32],
    p1: &[f32],
    acc0: &mut [[f32; PANEL]; ROWS],
    acc1: &mut [[f32; PANEL]; ROWS],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        use x86::tile_rx2_avx512 as t;
        // SAFETY: AVX-512F confirmed by the caller's `isa`; `x` holds `rows` rows of `k`.
        unsafe {
            match rows {
                1 => t::<1>(x, k, p0, p1, acc0, acc1),
                2 => t::<2>(x, k, p0, p1, acc0, acc1),
                3 => t::<3>(x, k, p0, p1, acc0, acc1),
                4 => t::<4>(x, k, p0, p1, acc0, acc1),
                5 => t::<5>(x, k, p0, p1, acc0, acc1),
                6 => t::<6>(x, k, p0, p1, acc0, acc1),
                7 => t::<7>(x, k, p0, p1, acc0, acc1),
                _ => t::<8>(x, k, p0, p1, acc0, acc1),
            }
        }
        return;
    }
    tile(isa, x, rows, k, p0, acc0);
    tile(isa, x, rows, k, p1, acc1);
}

/// The portable reference; `mul_add` is a correctly rounded FMA, exactly what the SIMD paths do.
fn tile_scalar(x: &[f32], rows: usize, k: usize, panel: &[f32], acc: &mut [[f32; PANEL]; ROWS]) {
    for (i, a) in acc.iter_mut().enumerate().take(rows) {
        let xr = &x[i * k..(i + 1) * k];
        for (kk, &xv) in xr.iter().enumerate() {
            let wv = &panel[kk * PANEL..(kk + 1) * PANEL];
            for c in 0..PANEL {
                a[c] = xv.mul_add(wv[c], a[c]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{PANEL, ROWS};
    use std::arch::x86_64::*;

    const PREFETCH_STEPS: usize = 32;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_avx512(x: &[f32], rows: usize, k: usize, panel: &[f32], acc: &mut [[f32; PANEL]; ROWS]) {
        let mut a = [_mm512_setzero_ps(); ROWS];
        let (xp, wp) = (x.as_ptr(), panel.as_ptr());
        // Separate loops per row count keep the accumulators in registers.
        match rows {
            4 => {
                for kk in 0..k {
                    let w = _mm512_loadu_ps(wp.add(kk * PANEL));
                    a[0] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(kk)), w, a[0]);
                    a[1] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(k + kk)), w, a[1]);
                    a[2] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(2 * k + kk)), w, a[2]);
                    a[3] = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(3 * k + kk)), w, a[3]);
                }
            }
            _ => {
                for (i, ai) in a.iter_mut().enumerate().take(rows) {
                    for kk in 0..k {
                        let w = _mm512_loadu_ps(wp.add(kk * PANEL));
                        *ai = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(i * k + kk)), w, *ai);
                    }
                }
            }
        }
        for (dst, src) in acc.iter_mut().zip(a).take(rows) {
            _mm512_storeu_ps(dst.as_mut_ptr(), src);
        }
    }

    /// `R` rows against two panels: 2·R accumulators, each still one in-order FMA chain.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_rx2_avx512<const R: usize>(
        x: &[f32],
        k: usize,
        p0: &[f32],
        p1: &[f32],
        acc0: &mut [[f32; PANEL]; ROWS],
        acc1: &mut [[f32; PANEL]; ROWS],
    ) {
        let (mut a, mut b) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        let (xp, w0p, w1p) = (x.as_ptr(), p0.as_ptr(), p1.as_ptr());
        for kk in 0..k {
            // One cache line of each panel per step; prefetched well ahead, because a single
            // row's FMA chain alone does not keep enough misses in flight to stream memory.
            _mm_prefetch(w0p.wrapping_add((kk + PREFETCH_STEPS) * PANEL) as *const i8, _MM_HINT_T0);
            _mm_prefetch(w1p.wrapping_add((kk + PREFETCH_STEPS) * PANEL) as *const i8, _MM_HINT_T0);
            let w0 = _mm512_loadu_ps(w0p.add(kk * PANEL));
            let w1 = _mm512_loadu_ps(w1p.add(kk * PANEL));
            for i in 0..R {
                let xv = _mm512_set1_ps(*xp.add(i * k + kk));
                a[i] = _mm512_fmadd_ps(xv, w0, a[i]);
                b[i] = _mm512_fmadd_ps(xv, w1, b[i]);
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(acc0[i].as_mut_ptr(), a[i]);
            _mm512_storeu_ps(acc1[i].as_mut_ptr(), b[i]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_avx2(x: &[f32], rows: usize, k: usize, panel: &[f32], acc: &mut [[f32; PANEL]; ROWS]) {
        for (i, dst) in acc.iter_mut().enumerate().take(rows) {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for kk in 0..k {
                let xv = _mm256_set1_ps(*x.as_ptr().add(i * k + kk));
                lo = _mm256_fmadd_ps(xv, _mm256_loadu_ps(panel.as_ptr().add(kk * PANEL)), lo);
                hi = _mm256_fmadd_ps(xv, _mm256_loadu_ps(panel.as_ptr().add(kk * PANEL + 8)), hi);
            }
            _mm256_storeu_ps(dst.as_mut_ptr(), lo);
            _mm256_storeu_ps(dst.as_mut_ptr().add(8), hi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 20_000) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2Fma);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    #[test]
    fn matches_f64_reference_and_is_identical_across_isas() {
        for m in 1..=17 {
            check_isas(m);
        }
    }

    fn check_isas(m: usize) {
        let (out, inp) = (37, 29); // ragged panels and row tiles
        let w = data(out * inp, 1);
        let x = data(m * inp, 2);
        let packed = PackedF32::pack(&w, out, inp);
        let mut first: Option<Vec<f32>> = None;
        for isa in isas() {
            let mut y = vec![0f32; m * out];
            matmul_with(isa, &x, m, &packed, &mut y);
            for i in 0..m {
                for o in 0..out {
                    let r: f64 = (0..inp).map(|k| x[i * inp + k] as f64 * w[o * inp + k] as f64).sum();
                    assert!((y[i * out + o] as f64 - r).abs() < 1e-4, "{isa:?} ({i},{o})");
                }
            }
            match &first {
                None => first = Some(y),
                Some(f) => assert_eq!(f, &y, "{isa:?} differs from the scalar reference"),
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (out, inp) = (128, 96);
        let packed = PackedF32::pack(&data(out * inp, 3), out, inp);
        let target = data(inp, 4);
        let mut alone = vec![0f32; out];
        matmul(&target, 1, &packed, &mut alone);
        for m in [2, 3, 4, 5, 9, 33] {
            for pos in [0, m / 2, m - 1] {
                let mut x = data(m * inp, 5 + m as u32);
                x[pos * inp..(pos + 1) * inp].copy_from_slice(&target);
                let mut y = vec![0f32; m * out];
                matmul(&x, m, &packed, &mut y);
                assert_eq!(&y[pos * out..(pos + 1) * out], &alone[..], "m={m} pos={pos}");
            }
        }
    }

    #[test]
    fn row_reads_back_the_packed_matrix() {
        let w = data(20 * 3, 9);
        let p = PackedF32::pack(&w, 20, 3);
        let mut r = [0f32; 3];
        p.row(17, &mut r);
        assert_eq!(&r, &w[17 * 3..18 * 3]);
    }
}
