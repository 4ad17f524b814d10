//! `y = x·Wᵀ` for bf16 weights in bf16 arithmetic: AVX-512 BF16's `vdpbf16ps`, two bf16
//! products per f32 lane per instruction, where the CPU has it.
//!
//! Widening bf16 weights to f32 (what [`super::matmul_f32`] does) costs a load, a widen, a
//! shift and an FMA per 16 products; `vdpbf16ps` does 32 products in one instruction straight
//! from the stored bits. Where it issues as often as an FMA (AMD Zen 4, by its instruction
//! tables) that doubles the arithmetic rate of prefill; where it issues half as often (this
//! project's Xeon) it does not, so [`dot_speedup`] measures which. The price is the activations: each row of `x` is rounded to bf16 (to nearest,
//! ties to even) before the products, as llama.cpp does and as transformers does when it runs a
//! bf16 checkpoint in bf16.
//!
//! Each output is one f32 accumulator fed the products of k-pairs `(2j, 2j+1)` for j = 0, 1, …
//! in order, whatever the tiling, thread split or batch, so a row's bits do not depend on its
//! batch. [`dpbf16`] emulates the instruction bit for bit (the odd product first, each added
//! with one rounding, subnormal inputs read as zero and subnormal results flushed to zero); it is
//! the reference the SIMD path is tested against, and the path CPUs without the instruction take
//! when a weight was packed this way.
//!
//! Weights are packed as `[out/16][in/2][16][2]`: one 64-byte line per k-pair of a 16-column
//! panel, the operand layout the instruction wants. An odd `in` is padded with a zero column.

use std::mem::MaybeUninit;

use super::huge_buf::HugeBuf;
// Rounding to the nearest bf16, ties to even (NaN stays NaN): the KV cache's own conversion.
use super::kv_quant::to_bf16 as round_to_bf16;
use super::matmul_f32::PANEL;
use super::{by_panel_stripes_many, Isa, Stripe};

/// Rows per micro-tile: each loaded pair of panel vectors feeds this many rows.
const ROWS: usize = 8;
/// bf16 values per panel per k-pair.
const STEP: usize = 2 * PANEL;

/// k-pairs of an `inp`-wide row.
pub(crate) fn pairs(inp: usize) -> usize {
    inp.div_ceil(2)
}

/// Lay a row-major `[out, in]` bf16 matrix out as pair panels.
pub(crate) fn to_pair_panels(w: &[u16], out: usize, inp: usize) -> HugeBuf<u16> {
    assert_eq!(w.len(), out * inp, "packed weight length");
    let kp = pairs(inp);
    let mut panels = HugeBuf::<u16>::zeroed(out.div_ceil(PANEL) * kp * STEP);
    for (o, row) in w.chunks_exact(inp).enumerate() {
        let base = (o / PANEL) * kp * STEP;
        for (k, &v) in row.iter().enumerate() {
            panels[base + index_in_panel(k, o % PANEL)] = v;
        }
    }
    panels
}

/// Where weight `(k, c)` of a panel lies in its `[in/2][16][2]` block.
#[inline(always)]
pub(crate) fn index_in_panel(k: usize, c: usize) -> usize {
    (k / 2) * STEP + c * 2 + k % 2
}

/// `x` (`[m, inp]`) rounded to bf16, each k-pair packed in one `u32` (even k in the low half),
/// `[m][in/2]`; an odd `inp` gets a zero partner. AVX-512 rounds 16 values per step, with the
/// same bits as [`round_to_bf16`].
fn round_rows(isa: Isa, x: &[f32], m: usize, inp: usize) -> Vec<u32> {
    let kp = pairs(inp);
    // Not zero-filled first (megabytes per call in a prefill): every half is written below.
    let mut out: Vec<u32> = Vec::with_capacity(m * kp);
    for (row, dst) in x.chunks_exact(inp).zip(out.spare_capacity_mut().chunks_exact_mut(kp)) {
        // SAFETY: `u16` has a smaller alignment than `u32` and two of them fill one exactly;
        // little-endian, the first (even k) is the low half, as the pair layout wants.
        let halves = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<MaybeUninit<u16>>(), 2 * kp) };
        round_row(isa, row, &mut halves[..inp]);
        // An odd width's zero partner.
        halves[inp..].fill(MaybeUninit::new(0));
    }
    // SAFETY: each of the `m` rows wrote all `2 · kp` halves of its `kp` values just above.
    unsafe { out.set_len(m * kp) };
    out
}

/// `dst[k] = round_to_bf16(src[k])`, every value of `dst` written (it is as long as `src`).
fn round_row(isa: Isa, src: &[f32], dst: &mut [MaybeUninit<u16>]) {
    assert_eq!(src.len(), dst.len(), "rounded row length");
    #[cfg(target_arch = "x86_64")]
    if isa.or_scalar() >= Isa::Avx512 {
        // SAFETY: AVX-512 F and BW confirmed by `isa`; `round_row_avx512` stays within both
        // slices, which are equally long.
        return unsafe { x86::round_row_avx512(src, dst) };
    }
    let _ = isa;
    dst.iter_mut().zip(src).for_each(|(d, &v)| *d = MaybeUninit::new(round_to_bf16(v)));
}

/// bf16 bits as f32, a subnormal read as a zero of its sign (the instruction's DAZ).
#[inline(always)]
fn widen_daz(bits: u16) -> f32 {
    let v = f32::from_bits((bits as u32) << 16);
    if v.is_subnormal() {
        f32::from_bits((bits as u32 & 0x8000) << 16)
    } else {
        v
    }
}

/// A subnormal f32 replaced by a zero of its sign (the instruction's FTZ, and DAZ on `acc`).
#[inline(always)]
fn flush(v: f32) -> f32 {
    if v.is_subnormal() {
        f32::from_bits(v.to_bits() & 0x8000_0000)
    } else {
        v
    }
}

/// `w·x + acc` with one rounding, as `vdpbf16ps` adds each product: a result that is tiny after
/// rounding to 24 bits with an unbounded exponent is flushed to a zero of its sign.
#[inline(always)]
fn fma_ftz(w: f32, x: f32, acc: f32) -> f32 {
    let r = w.mul_add(x, acc);
    if r.abs() != f32::MIN_POSITIVE {
        // Normal and above the smallest normal: IEEE rounding is the unbounded one. Subnormal
        // or zero: the exact value lies below the smallest normal by more than half a step.
        return flush(r);
    }
    // IEEE rounded up to the smallest normal, from as far as 2^-150 below it; at 24 bits the
    // grid below it is 2^-150, so the unbounded rounding reaches it only from 2^-151 below or
    // closer (ties to even). Measured on the instruction: 2^-126 − 2^-151 stays 2^-126,
    // 2^-126 − 2^-150 becomes 0. In f64 both terms and the difference are exact here (a result
    // this small leaves no room for large cancelling operands), and the sign of the sum is.
    let threshold = f32::MIN_POSITIVE as f64 - 2f64.powi(-151);
    let s = if r > 0.0 { 1.0 } else { -1.0 };
    if s * ((acc as f64 - s * threshold) + w as f64 * x as f64) < 0.0 {
        f32::from_bits(r.to_bits() & 0x8000_0000)
    } else {
        r
    }
}

/// One lane of `vdpbf16ps`: `acc + w₁·x₁ + w₀·x₀` for the bf16 pairs `w` and `x` (element 0
/// in the low half), as the instruction computes it: the odd product first, each product exact
/// and added with one rounding to nearest even, subnormal inputs read as zero and results tiny
/// after rounding flushed to zero ([`fma_ftz`]).
#[inline(always)]
pub fn dpbf16(acc: f32, w: u32, x: u32) -> f32 {
    let (w0, w1) = (widen_daz(w as u16), widen_daz((w >> 16) as u16));
    let (x0, x1) = (widen_daz(x as u16), widen_daz((x >> 16) as u16));
    let t = fma_ftz(w1, x1, flush(acc));
    fma_ftz(w0, x0, t)
}

/// Whether this CPU runs `vdpbf16ps` (and the ISA cap allows it).
pub fn simd_available() -> bool {
    Isa::Avx512Bf16.available()
}

/// Products per second of `vdpbf16ps` over those of f32 FMAs on this core (`None` without the
/// instruction), measured once: 16 independent accumulators of each for a few hundred
/// microseconds, best of three interleaved rounds.
///
/// The instruction's speed is the microarchitecture's: on a Sapphire Rapids-class Xeon it
/// retires one every two cycles (measured here 39.5 against 80.9 GMAC/s for FMAs, 0.49×); AMD
/// Zen 4 is expected to issue one per cycle against one 512-bit FMA (2×; not measured here). The
/// choice between the two
/// products needs the ratio, and a measured one covers CPUs no table lists; the margin between
/// 0.5 and 2 is far wider than the noise of a shared machine.
pub fn dot_speedup() -> Option<f64> {
    static SPEEDUP: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    *SPEEDUP.get_or_init(|| {
        if !simd_available() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let (mut dot, mut fma) = (f64::MAX, f64::MAX);
            for _ in 0..3 {
                // SAFETY: `simd_available` confirmed AVX-512F and BF16.
                dot = dot.min(unsafe { x86::time_dot(20_000) });
                fma = fma.min(unsafe { x86::time_fma(20_000) });
            }
            // Each `vdpbf16ps` is 32 products, each FMA 16.
            Some((32.0 / dot) / (16.0 / fma))
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    })
}

/// `y[m, out] = round_bf16(x)[m, in] · Wᵀ` for pair panels `w` (see [`to_pair_panels`]); the
/// SIMD kernel on [`Isa::Avx512Bf16`] (where available), else the emulation, with the same bits.
pub(crate) fn run(isa: Isa, x: &[f32], m: usize, w: &[u16], out: usize, inp: usize, y: &mut [MaybeUninit<f32>]) {
    run_many(isa, x, m, &[(w, out)], inp, &mut [y])
}

/// [`run`] for several matrices `(pair panels, out)` of one input width applied to the same `x`
/// (a layer's q/k/v, or its gate/up): the rows are rounded once and the matrices share one
/// parallel region. Each output has exactly the bits [`run`] gives it alone.
///
/// Each row tile runs the whole width of `x` against a pair of panels. Blocking the k-pairs so
/// that a block of the panels stays in L1 across row tiles was measured slower on AMD Zen 4
/// (the `matmul_cost` example: 250–285 GFLOP/s per layer with 64–256-pair blocks against
/// 360–390 unblocked, where the two cores' `vdpbf16ps` peak is about 450).
pub(crate) fn run_many(
    isa: Isa,
    x: &[f32],
    m: usize,
    ws: &[(&[u16], usize)],
    inp: usize,
    ys: &mut [&mut [MaybeUninit<f32>]],
) {
    let simd = isa.or_scalar() >= Isa::Avx512Bf16;
    assert_eq!(x.len(), m * inp, "matmul input length");
    assert_eq!(ws.len(), ys.len(), "bf16 matmul: one output per matrix");
    let kp = pairs(inp);
    for (&(w, out), y) in ws.iter().zip(ys.iter()) {
        assert_eq!(y.len(), m * out, "matmul output length");
        assert_eq!(w.len(), out.div_ceil(PANEL) * kp * STEP, "packed weight length");
    }
    let xs = round_rows(isa, x, m, inp);
    let n = kp * STEP;
    let cols: Vec<usize> = ws.iter().map(|&(_, out)| out).collect();
    by_panel_stripes_many(m, &cols, PANEL, 2, ys, |j, p0, p1, stripe: &mut Stripe| {
        let w = ws[j].0;
        for p in (p0..p1).step_by(2) {
            let pair = p + 1 < p1;
            let pa = &w[p * n..(p + 1) * n];
            let pb = &w[(p + usize::from(pair)) * n..(p + 1 + usize::from(pair)) * n];
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(ROWS);
                let x_tile = &xs[r * kp..(r + rows) * kp];
                let mut acc = [[[0f32; PANEL]; ROWS]; 2];
                let [a0, a1] = &mut acc;
                if simd {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `simd_available` confirmed AVX-512F and BF16; `x_tile` holds
                    // `rows` rows of `kp` pairs and each panel `kp · 32` values.
                    unsafe {
                        x86::tile_pair(x_tile, rows, kp, pa.as_ptr(), pb.as_ptr(), a0, a1)
                    };
                } else {
                    tile_scalar(x_tile, rows, kp, pa, a0);
                    if pair {
                        tile_scalar(x_tile, rows, kp, pb, a1);
                    }
                }
                for (jj, a) in acc.iter().enumerate().take(1 + usize::from(pair)) {
                    for (i, row) in a.iter().enumerate().take(rows) {
                        stripe.put(r + i, p + jj - p0, row);
                    }
                }
                r += rows;
            }
        }
    });
}

/// `silu(x·gateᵀ) · (x·upᵀ)`, elementwise, into uninitialised `y` `[m][out]` (every value
/// written), for pair panels `gate` and `up` of one shape: the micro-kernel's two panels are a
/// gate panel and the up panel of the same columns, combined while in registers, so neither
/// product is written out and no elementwise pass follows. The bits are those of [`run`] for
/// each weight followed by [`rowwise::silu_mul`](super::rowwise::silu_mul).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_gated(
    isa: Isa,
    x: &[f32],
    m: usize,
    gate: &[u16],
    up: &[u16],
    out: usize,
    inp: usize,
    y: &mut [MaybeUninit<f32>],
) {
    let simd = isa.or_scalar() >= Isa::Avx512Bf16;
    assert_eq!(x.len(), m * inp, "matmul input length");
    assert_eq!(y.len(), m * out, "matmul output length");
    let kp = pairs(inp);
    let n = kp * STEP;
    assert!(gate.len() == out.div_ceil(PANEL) * n && up.len() == gate.len(), "packed weight length");
    let xs = round_rows(isa, x, m, inp);
    by_panel_stripes_many(m, &[out], PANEL, 1, &mut [y], |_, p0, p1, stripe: &mut Stripe| {
        for p in p0..p1 {
            let (pg, pu) = (&gate[p * n..(p + 1) * n], &up[p * n..(p + 1) * n]);
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(ROWS);
                let x_tile = &xs[r * kp..(r + rows) * kp];
                let mut acc = [[[0f32; PANEL]; ROWS]; 2];
                let [g, u] = &mut acc;
                if simd {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as in `run_many`.
                    unsafe {
                        x86::tile_pair(x_tile, rows, kp, pg.as_ptr(), pu.as_ptr(), g, u)
                    };
                } else {
                    tile_scalar(x_tile, rows, kp, pg, g);
                    tile_scalar(x_tile, rows, kp, pu, u);
                }
                // The tile's rows are contiguous: one call over all of them vectorizes best.
                let mut o = [[0f32; PANEL]; ROWS];
                let n = rows * PANEL;
                super::rowwise::silu_mul_row(
                    &g.as_flattened()[..n],
                    &u.as_flattened()[..n],
                    &mut o.as_flattened_mut()[..n],
                );
                for (i, row) in o.iter().enumerate().take(rows) {
                    stripe.put(r + i, p - p0, row);
                }
                r += rows;
            }
        }
    });
}

/// The reference: [`dpbf16`] per lane, k-pairs ascending.
fn tile_scalar(x: &[u32], rows: usize, kp: usize, panel: &[u16], acc: &mut [[f32; PANEL]; ROWS]) {
    for (i, a) in acc.iter_mut().enumerate().take(rows) {
        for (j, &xv) in x[i * kp..(i + 1) * kp].iter().enumerate() {
            let step = &panel[j * STEP..(j + 1) * STEP];
            for (c, ac) in a.iter_mut().enumerate() {
                let wv = step[2 * c] as u32 | (step[2 * c + 1] as u32) << 16;
                *ac = dpbf16(*ac, wv, xv);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{PANEL, ROWS, STEP};
    use std::arch::x86_64::*;

    /// k-pairs to prefetch ahead: one 64-byte line of each panel per step.
    const PREFETCH_STEPS: usize = 16;

    /// Seconds for `n` rounds of 16 independent `vdpbf16ps`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn time_dot(n: usize) -> f64 {
        let mut a = [_mm512_setzero_ps(); 16];
        // Opaque operands, or the compiler may simplify the arithmetic it is timing.
        let one_pair = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3f80_3f80));
        let (w, x) = std::hint::black_box((one_pair, one_pair));
        let t = std::time::Instant::now();
        for _ in 0..n {
            for acc in a.iter_mut() {
                *acc = _mm512_dpbf16_ps(*acc, w, x);
            }
        }
        std::hint::black_box(a);
        t.elapsed().as_secs_f64()
    }

    /// Seconds for `n` rounds of 16 independent 512-bit FMAs.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn time_fma(n: usize) -> f64 {
        let mut a = [_mm512_setzero_ps(); 16];
        // Opaque operands: a constant 1.0 factor would let the compiler time additions instead.
        let (w, x) = std::hint::black_box((_mm512_set1_ps(1.0), _mm512_set1_ps(1e-9)));
        let t = std::time::Instant::now();
        for _ in 0..n {
            for acc in a.iter_mut() {
                *acc = _mm512_fmadd_ps(*acc, w, x);
            }
        }
        std::hint::black_box(a);
        t.elapsed().as_secs_f64()
    }

    /// `rows` rows against two panels (`w1` may equal `w0`, for a lone last panel).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn tile_pair(
        x: &[u32],
        rows: usize,
        kp: usize,
        w0: *const u16,
        w1: *const u16,
        acc0: &mut [[f32; PANEL]; ROWS],
        acc1: &mut [[f32; PANEL]; ROWS],
    ) {
        let x = x.as_ptr();
        match rows {
            1 => tile_rx2::<1>(x, kp, w0, w1, acc0, acc1),
            2 => tile_rx2::<2>(x, kp, w0, w1, acc0, acc1),
            3 => tile_rx2::<3>(x, kp, w0, w1, acc0, acc1),
            4 => tile_rx2::<4>(x, kp, w0, w1, acc0, acc1),
            5 => tile_rx2::<5>(x, kp, w0, w1, acc0, acc1),
            6 => tile_rx2::<6>(x, kp, w0, w1, acc0, acc1),
            7 => tile_rx2::<7>(x, kp, w0, w1, acc0, acc1),
            _ => tile_rx2::<8>(x, kp, w0, w1, acc0, acc1),
        }
    }

    /// `R` rows against two panels: 2·R accumulators, each one in-order chain of k-pairs.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile_rx2<const R: usize>(
        xp: *const u32,
        kp: usize,
        w0: *const u16,
        w1: *const u16,
        acc0: &mut [[f32; PANEL]; ROWS],
        acc1: &mut [[f32; PANEL]; ROWS],
    ) {
        let (mut a, mut b) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        for j in 0..kp {
            _mm_prefetch(w0.wrapping_add((j + PREFETCH_STEPS) * STEP) as *const i8, _MM_HINT_T0);
            _mm_prefetch(w1.wrapping_add((j + PREFETCH_STEPS) * STEP) as *const i8, _MM_HINT_T0);
            let v0: __m512bh = std::mem::transmute(_mm512_loadu_si512(w0.add(j * STEP) as *const _));
            let v1: __m512bh = std::mem::transmute(_mm512_loadu_si512(w1.add(j * STEP) as *const _));
            for i in 0..R {
                let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*xp.add(i * kp + j) as i32));
                a[i] = _mm512_dpbf16_ps(a[i], v0, xv);
                b[i] = _mm512_dpbf16_ps(b[i], v1, xv);
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(acc0[i].as_mut_ptr(), a[i]);
            _mm512_storeu_ps(acc1[i].as_mut_ptr(), b[i]);
        }
    }

    /// `dst[k] = round_to_bf16(src[k])`, 16 at a time: add `0x7fff` plus the kept part's lowest
    /// bit and keep the top half (to nearest, ties to even; an overflow carries into the exponent
    /// and gives infinity), a NaN kept with its quiet bit set, as `half`'s conversion does.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn round_row_avx512(src: &[f32], dst: &mut [std::mem::MaybeUninit<u16>]) {
        let n = src.len().min(dst.len());
        let (one, bias, abs_mask, inf, quiet) = (
            _mm512_set1_epi32(1),
            _mm512_set1_epi32(0x7fff),
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(0x7f80_0000),
            _mm512_set1_epi32(0x40),
        );
        let mut k = 0;
        while k + 16 <= n {
            let v = _mm512_loadu_si512(src.as_ptr().add(k) as *const _);
            let high = _mm512_srli_epi32::<16>(v);
            let rounded =
                _mm512_srli_epi32::<16>(_mm512_add_epi32(v, _mm512_add_epi32(bias, _mm512_and_si512(high, one))));
            let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs_mask), inf);
            let r = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, quiet));
            _mm256_storeu_si256(dst.as_mut_ptr().add(k) as *mut __m256i, _mm512_cvtepi32_epi16(r));
            k += 16;
        }
        for (d, &v) in dst[k..n].iter_mut().zip(&src[k..n]) {
            *d = std::mem::MaybeUninit::new(super::round_to_bf16(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_data as data;

    fn bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| round_to_bf16(x)).collect()
    }

    fn f(bits: u16) -> f32 {
        f32::from_bits((bits as u32) << 16)
    }

    /// The SIMD kernel (where the CPU has it) or the emulation.
    fn matmul(simd: bool, x: &[f32], m: usize, w: &HugeBuf<u16>, out: usize, inp: usize) -> Vec<f32> {
        let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
        run(if simd { Isa::Avx512Bf16 } else { Isa::Scalar }, x, m, w, out, inp, &mut y);
        crate::kernels::written(&y)
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(round_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even (1.0).
        assert_eq!(round_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(round_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(round_to_bf16(-2.5e-3), round_to_bf16(2.5e-3) | 0x8000);
        assert!(f(round_to_bf16(f32::NAN)).is_nan());
        assert_eq!(round_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(round_to_bf16(f32::MAX), 0x7f80, "rounds up to infinity");
    }

    /// The emulation's reading of the instruction, on cases where a wrong reading shows.
    #[test]
    fn emulation_follows_the_instruction() {
        let pair = |e: f32, o: f32| round_to_bf16(e) as u32 | (round_to_bf16(o) as u32) << 16;
        let ones = pair(1.0, 1.0);
        // Odd product first: 1 + 2^-24 rounds to 1, then −1 gives 0 (even first would give 2^-24).
        assert_eq!(dpbf16(1.0, pair(-1.0, 2f32.powi(-24)), ones), 0.0);
        // Products are exact (fused): the smallest normal plus 2^-140 keeps the 2^-140.
        assert!(dpbf16(2f32.powi(-126), pair(0.0, 2f32.powi(-70)), pair(0.0, 2f32.powi(-70))) > 2f32.powi(-126));
        // Subnormal results are flushed, subnormal accumulators read as zero.
        assert_eq!(dpbf16(0.0, pair(0.0, 2f32.powi(-70)), pair(0.0, 2f32.powi(-70))), 0.0);
        assert_eq!(dpbf16(1e-39, 0, 0), 0.0);
        // Subnormal bf16 inputs read as zero.
        assert_eq!(dpbf16(1.0, 0x0001 << 16, ones), 1.0);
        // Tininess after rounding at 24 bits (read off the instruction on a Xeon): the smallest
        // normal minus 2^-151 rounds back up to it and stays; minus 2^-150 (where IEEE's
        // subnormal rounding ties up to the smallest normal) or 0.75·2^-150 is flushed.
        let min = f32::MIN_POSITIVE;
        let p = |a: f32| round_to_bf16(a) as u32;
        assert_eq!(dpbf16(min, p(-(2f32.powi(-75))) << 16, p(2f32.powi(-76)) << 16), min);
        assert_eq!(dpbf16(min, p(-(2f32.powi(-75))) << 16, p(2f32.powi(-75)) << 16), 0.0);
        assert_eq!(dpbf16(min, p(-1.5 * 2f32.powi(-75)) << 16, p(2f32.powi(-76)) << 16), 0.0);
        assert_eq!(dpbf16(-min, p(2f32.powi(-75)) << 16, p(2f32.powi(-76)) << 16), -min);
        // Flushed to −0, then the even product +0 is added: +0, as on the instruction.
        assert_eq!(dpbf16(-min, p(2f32.powi(-75)) << 16, p(2f32.powi(-75)) << 16).to_bits(), 0);
        assert_eq!(dpbf16(0.5, pair(2.0, 3.0), pair(4.0, 5.0)), 0.5 + 15.0 + 8.0);
    }

    #[test]
    fn simd_matches_the_emulation_bit_for_bit() {
        if !simd_available() {
            eprintln!("AVX-512 BF16 not available: only the emulation ran");
            return;
        }
        eprintln!("AVX-512 BF16 SIMD path checked against the emulation");
        // Ordinary values, then values that reach the instruction's corners (subnormal products
        // and inputs, cancellation, overflow).
        let mut corner = data(64 * 45, 7);
        for (i, v) in corner.iter_mut().enumerate() {
            *v *= match i % 7 {
                0 => 2f32.powi(-66),
                1 => 2f32.powi(-128),
                2 => 2f32.powi(60),
                3 => 1e30,
                _ => 1.0,
            };
        }
        // The flush boundary below the smallest normal: per column, pair 0 makes the
        // accumulator ±2^-126 (2^-63·2^-63) and pair 1's odd product takes it just below the
        // boundary, onto it, or past it.
        let e = |k: i32| 2f32.powi(k);
        let odd = [-e(-75), -1.5 * e(-75), -e(-74), -e(-76), e(-80), -e(-63)];
        let mut wb = vec![0f32; 16 * 4];
        for c in 0..16 {
            let s = if c % 2 == 0 { 1.0 } else { -1.0 };
            wb[c * 4] = s * e(-63);
            wb[c * 4 + 3] = s * odd[c % odd.len()];
        }
        for x3 in [e(-76), e(-75), e(-74)] {
            let x = [e(-63), 0.0, 0.0, x3];
            let packed = to_pair_panels(&bits(&wb), 16, 4);
            let (simd, emul) = (matmul(true, &x, 1, &packed, 16, 4), matmul(false, &x, 1, &packed, 16, 4));
            let same = simd.iter().zip(&emul).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "flush boundary x3={x3:e}: SIMD {simd:?} vs emulation {emul:?}");
        }
        for (out, inp, w) in [(37, 45, data(37 * 45, 1)), (64, 45, corner.clone())] {
            let packed = to_pair_panels(&bits(&w), out, inp);
            for m in [1, 2, 3, 7, 8, 9, 17] {
                let mut x = data(m * inp, 2 + m as u32);
                if out == 64 {
                    x.iter_mut().zip(&corner).for_each(|(a, c)| *a *= c.abs().max(1e-3));
                }
                let (s, e) = (matmul(true, &x, m, &packed, out, inp), matmul(false, &x, m, &packed, out, inp));
                let same = s.iter().zip(&e).all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan());
                assert!(same, "{out}x{inp} m={m}: SIMD and emulation differ");
            }
        }
    }

    #[test]
    fn matches_a_reference_on_the_rounded_inputs() {
        let (out, inp) = (37, 29);
        let w = bits(&data(out * inp, 3));
        let packed = to_pair_panels(&w, out, inp);
        for m in [1, 5, 9] {
            let x = data(m * inp, 4);
            for simd in [false, true] {
                let y = matmul(simd, &x, m, &packed, out, inp);
                for i in 0..m {
                    for o in 0..out {
                        let r: f64 =
                            (0..inp).map(|k| f(round_to_bf16(x[i * inp + k])) as f64 * f(w[o * inp + k]) as f64).sum();
                        assert!((y[i * out + o] as f64 - r).abs() < 1e-5, "({i},{o}) {} vs {r}", y[i * out + o]);
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (out, inp) = (80, 96);
        let packed = to_pair_panels(&bits(&data(out * inp, 5)), out, inp);
        let target = data(inp, 6);
        for simd in [false, true] {
            let alone = matmul(simd, &target, 1, &packed, out, inp);
            for m in [2, 8, 9, 20] {
                let mut x = data(m * inp, 7 + m as u32);
                let pos = m / 2;
                x[pos * inp..(pos + 1) * inp].copy_from_slice(&target);
                let y = matmul(simd, &x, m, &packed, out, inp);
                assert_eq!(&y[pos * out..(pos + 1) * out], &alone[..], "m={m} simd={simd}");
            }
        }
    }

    #[test]
    fn simd_rounding_matches_the_scalar_rounding() {
        if !Isa::Avx512.available() {
            eprintln!("AVX-512 not available: only the scalar rounding ran");
            return;
        }
        eprintln!("AVX-512 rounding checked against the scalar one");
        // Every corner (ties either way, NaNs quiet and signalling, infinities, the largest
        // finite values, subnormals) and random bit patterns; an odd length leaves a tail.
        let mut bits = vec![
            0x3f80_8000u32,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x7fc0_0000,
            0x7f80_0001,
            0xff80_0001,
            0x7fbf_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f7f_8000,
            0x0000_0001,
            0x007f_ffff,
            0x807f_8000,
            0x0000_0000,
            0x8000_0000,
            0x0080_0000,
        ];
        bits.extend(crate::kernels::xorshift(9).take(4099));
        let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let round = |isa| {
            let mut out = vec![MaybeUninit::new(0u16); src.len()];
            round_row(isa, &src, &mut out);
            // SAFETY: `round_row` wrote every value (and they started initialised anyway).
            out.iter().map(|v| unsafe { v.assume_init() }).collect::<Vec<u16>>()
        };
        let (simd, scalar) = (round(Isa::Avx512), round(Isa::Scalar));
        for (i, (a, b)) in simd.iter().zip(&scalar).enumerate() {
            assert_eq!(a, b, "{:#010x}: SIMD {a:#06x}, scalar {b:#06x}", bits[i]);
        }
    }

    /// Several weights in one call, and gate/up fused with SiLU, give each output the bits of
    /// its own call (and of `silu_mul` after them), on the SIMD path and the emulation.
    #[test]
    fn many_and_gated_give_the_bits_of_single_calls() {
        let inp = 45;
        let ws: Vec<(usize, HugeBuf<u16>)> = [37, 16, 80]
            .iter()
            .map(|&out| (out, to_pair_panels(&bits(&data(out * inp, out as u32)), out, inp)))
            .collect();
        for isa in [Isa::Scalar, Isa::Avx512Bf16] {
            for m in [1, 7, 9, 20] {
                let x = data(m * inp, 40 + m as u32);
                let single: Vec<Vec<f32>> = ws
                    .iter()
                    .map(|(out, w)| {
                        let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
                        run(isa, &x, m, w, *out, inp, &mut y);
                        crate::kernels::written(&y)
                    })
                    .collect();
                let mut outs: Vec<Vec<MaybeUninit<f32>>> =
                    ws.iter().map(|(out, _)| vec![MaybeUninit::new(f32::NAN); m * out]).collect();
                let mut views: Vec<&mut [MaybeUninit<f32>]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                let parts: Vec<(&[u16], usize)> = ws.iter().map(|(out, w)| (&w[..], *out)).collect();
                run_many(isa, &x, m, &parts, inp, &mut views);
                for (j, o) in outs.iter().enumerate() {
                    let got = crate::kernels::written(o);
                    assert!(
                        got.iter().zip(&single[j]).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "many: matrix {j} m={m}"
                    );
                }
                // Gate = the first weight, up = a second weight of the same shape.
                let up = to_pair_panels(&bits(&data(37 * inp, 99)), 37, inp);
                let mut u = vec![MaybeUninit::new(f32::NAN); m * 37];
                run(isa, &x, m, &up, 37, inp, &mut u);
                let u = crate::kernels::written(&u);
                let mut want = vec![0f32; m * 37];
                crate::kernels::rowwise::silu_mul_row(&single[0], &u, &mut want);
                let mut y = vec![MaybeUninit::new(f32::NAN); m * 37];
                run_gated(isa, &x, m, &ws[0].1, &up, 37, inp, &mut y);
                let got = crate::kernels::written(&y);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "gated m={m} {isa:?}");
            }
        }
    }

    #[test]
    fn pair_layout_places_every_weight() {
        let (out, inp) = (20, 5);
        let w: Vec<u16> = (0..(out * inp) as u16).map(|v| v + 1).collect();
        let p = to_pair_panels(&w, out, inp);
        let kp = pairs(inp);
        for o in 0..out {
            for k in 0..inp {
                assert_eq!(p[(o / PANEL) * kp * STEP + index_in_panel(k, o % PANEL)], w[o * inp + k]);
            }
        }
        // The odd column's partner is zero padding.
        assert_eq!(p[index_in_panel(5, 3)], 0);
    }
}
