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
//!
//! The same panels feed AMX-BF16's `tdpbf16ps` ([`run_tiles_many`], `amx`), whose order of sums
//! is its own (see [`super::amx_bf16`]): a weight packed for tiles runs on tiles (or their
//! emulation) for every row count, never on `vdpbf16ps`.

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
    round_rows_padded(isa, x, m, inp, pairs(inp))
}

/// [`round_rows`] with `stride` ≥ `pairs(inp)` pairs per row, the pairs past the row's zero.
fn round_rows_padded(isa: Isa, x: &[f32], m: usize, inp: usize, stride: usize) -> Vec<u32> {
    assert!(stride >= pairs(inp), "rounded row stride");
    // Not zero-filled first (megabytes per call in a prefill): every half is written below.
    let mut out: Vec<u32> = Vec::with_capacity(m * stride);
    for (row, dst) in x.chunks_exact(inp).zip(out.spare_capacity_mut().chunks_exact_mut(stride)) {
        // SAFETY: `u16` has a smaller alignment than `u32` and two of them fill one exactly;
        // little-endian, the first (even k) is the low half, as the pair layout wants.
        let halves = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<MaybeUninit<u16>>(), 2 * stride) };
        round_row(isa, row, &mut halves[..inp]);
        // An odd width's zero partner, and the padding.
        halves[inp..].fill(MaybeUninit::new(0));
    }
    // SAFETY: each of the `m` rows wrote all `2 · stride` halves of its `stride` values above.
    unsafe { out.set_len(m * stride) };
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
pub(crate) fn widen_daz(bits: u16) -> f32 {
    let v = f32::from_bits((bits as u32) << 16);
    if v.is_subnormal() {
        f32::from_bits((bits as u32 & 0x8000) << 16)
    } else {
        v
    }
}

/// A subnormal f32 replaced by a zero of its sign (the instruction's FTZ, and DAZ on `acc`).
#[inline(always)]
pub(crate) fn flush(v: f32) -> f32 {
    if v.is_subnormal() {
        f32::from_bits(v.to_bits() & 0x8000_0000)
    } else {
        v
    }
}

/// `w·x + acc` with one rounding, as `vdpbf16ps` adds each product: a result that is tiny after
/// rounding to 24 bits with an unbounded exponent is flushed to a zero of its sign.
#[inline(always)]
pub(crate) fn fma_ftz(w: f32, x: f32, acc: f32) -> f32 {
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

// `run_many` and `run_gated` on AMX-BF16 tiles, for weights packed for them.
pub(crate) use amx::{run_gated as run_tiles_gated, run_many as run_tiles_many};

mod amx;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
