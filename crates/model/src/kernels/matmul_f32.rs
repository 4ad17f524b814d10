//! `y = x·Wᵀ` in f32 whose every output row is bit-identical however many rows share the call.
//!
//! candle's CPU matmul (the `gemm` crate) picks a different kernel for one row than for several,
//! and another when the output is narrow (a 128-wide k_proj), so a request's logits changed with
//! the batch around it. Here every output element is one accumulator fed `x[k]·w[k]` for
//! k = 0, 1, …, K−1 in order with a fused multiply-add, whatever the tiling, the thread split or
//! the instruction set: AVX-512, AVX2+FMA and the scalar `f32::mul_add` reference all round
//! exactly the same way. The weight is packed once at load into panels of 16 output columns,
//! `[out/16][in][16]`, so the inner loop streams it contiguously.
//!
//! A bf16 checkpoint keeps its weights in bf16: half the bytes to stream per token. Packed for
//! [`Bf16Compute::WidenF32`], the panels are widened as they are read (exact, a 16-bit shift), so
//! the products, and the bits, are those of the same weights upcast to f32. Packed for
//! [`Bf16Compute::Dot`] (the default where the CPU has AVX-512 BF16 and it outpaces f32 FMAs),
//! they are in [`super::matmul_bf16`]'s pair layout and computed in bf16 dot products. f16
//! weights stay f16, widened exactly as read.

use std::mem::MaybeUninit;

use super::huge_buf::{HugeBuf, Plain};
use super::matmul_bf16;
use super::{as_uninit, by_panel_stripes, streamed, Isa};

/// Output columns per panel: one AVX-512 register, two AVX2 registers.
pub const PANEL: usize = 16;
/// Rows per micro-tile: eight rows share each loaded panel vector (16 AVX-512 accumulators).
const ROWS: usize = 8;

/// A `[out, in]` weight packed for [`matmul`], its values in f32 or bf16.
#[derive(Clone)]
pub struct PackedF32 {
    out: usize,
    inp: usize,
    data: PanelData,
}

#[derive(Clone)]
enum PanelData {
    F32(HugeBuf<f32>),
    /// bf16 bit patterns, `[out/16][in][16]`, widened to f32 for the products.
    Bf16(HugeBuf<u16>),
    /// bf16 bit patterns in [`matmul_bf16`]'s `[out/16][in/2][16][2]`, for bf16 dot products.
    Bf16Pairs(HugeBuf<u16>),
    /// The same layout, for AMX-BF16 tiles (their order of sums: other bits than `Bf16Pairs`).
    Bf16Tiles(HugeBuf<u16>),
    /// IEEE half bit patterns, `[out/16][in][16]`, widened to f32 (exactly) for the products.
    F16(HugeBuf<u16>),
}

/// How a bf16 weight is multiplied: its exact f32 value times the f32 activations, or in bf16 dot
/// products (activations rounded to bf16; 32 products per instruction, which is faster where the
/// CPU issues `vdpbf16ps` as often as FMAs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Compute {
    WidenF32,
    Dot,
    Tiles,
}

/// The dot path must beat the FMA rate by this much to be chosen: it also rounds activations.
const DOT_MIN_SPEEDUP: f64 = 1.25;

impl Bf16Compute {
    /// What this machine computes bf16 weights with: `FLINT_BF16_COMPUTE` (`dot`, `f32`) when
    /// set, else [`Dot`](Self::Dot) where the CPU has `vdpbf16ps` (and `FLINT_CPU_ISA` allows
    /// it) and it outpaces f32 FMAs ([`matmul_bf16::dot_speedup`]), else
    /// [`WidenF32`](Self::WidenF32). `dot` without the instruction stays `WidenF32`: the
    /// emulation is exact but slow. Read once, so every weight of the process agrees.
    pub fn native() -> Self {
        static CHOICE: std::sync::OnceLock<Bf16Compute> = std::sync::OnceLock::new();
        *CHOICE.get_or_init(|| {
            let forced = std::env::var("FLINT_BF16_COMPUTE").ok().and_then(|v| v.parse::<Bf16Compute>().ok());
            let has = matmul_bf16::simd_available();
            let tiles = Isa::AmxBf16.available() && super::amx_bf16::hardware_available();
            match forced {
                Some(Bf16Compute::Dot) if has => Bf16Compute::Dot,
                Some(Bf16Compute::Tiles) if tiles => Bf16Compute::Tiles,
                Some(_) => Bf16Compute::WidenF32,
                None if tiles => Bf16Compute::Tiles,
                None if matmul_bf16::dot_speedup().is_some_and(|s| s >= DOT_MIN_SPEEDUP) => Bf16Compute::Dot,
                None => Bf16Compute::WidenF32,
            }
        })
    }
}

impl std::str::FromStr for Bf16Compute {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "dot" | "bf16" => Ok(Bf16Compute::Dot),
            "f32" => Ok(Bf16Compute::WidenF32),
            "tiles" | "amx" => Ok(Bf16Compute::Tiles),
            other => Err(format!("unknown bf16 compute {other:?} (expected dot, tiles or f32)")),
        }
    }
}

impl std::fmt::Display for Bf16Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bf16Compute::WidenF32 => "f32 products (exact)",
            Bf16Compute::Dot => "bf16 dot products (AVX-512 BF16, activations rounded to bf16)",
            Bf16Compute::Tiles => "bf16 tile products (AMX-BF16, activations rounded to bf16)",
        })
    }
}

/// One panel's values, `[in][16]`.
#[derive(Clone, Copy)]
enum Panel<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl Panel<'_> {
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        match self {
            Panel::F32(v) => v[i],
            Panel::Bf16(v) => bf16_to_f32(v[i]),
            Panel::F16(v) => half::f16::from_bits(v[i]).to_f32(),
        }
    }

    /// The element kind, as the SIMD loads' const parameter.
    fn kind(self) -> u8 {
        match self {
            Panel::F32(_) => x86k::F32,
            Panel::Bf16(_) => x86k::BF16,
            Panel::F16(_) => x86k::F16,
        }
    }

    fn ptr(self) -> *const u8 {
        match self {
            Panel::F32(v) => v.as_ptr().cast(),
            Panel::Bf16(v) | Panel::F16(v) => v.as_ptr().cast(),
        }
    }
}

/// Element kinds of a panel, for the SIMD loads.
mod x86k {
    pub const F32: u8 = 0;
    pub const BF16: u8 = 1;
    pub const F16: u8 = 2;
}

#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Lay a row-major `[out, in]` matrix out as panels.
fn to_panels<T: Plain>(w: &[T], out: usize, inp: usize) -> HugeBuf<T> {
    assert_eq!(w.len(), out * inp, "packed weight length");
    let mut panels = HugeBuf::<T>::zeroed(out.div_ceil(PANEL) * inp * PANEL);
    for (o, row) in w.chunks_exact(inp).enumerate() {
        let base = (o / PANEL) * inp * PANEL + o % PANEL;
        for (k, &v) in row.iter().enumerate() {
            panels[base + k * PANEL] = v;
        }
    }
    panels
}

impl PackedF32 {
    /// Pack a row-major `[out, in]` matrix (a Linear weight as checkpoints store it).
    pub fn pack(w: &[f32], out: usize, inp: usize) -> Self {
        Self { out, inp, data: PanelData::F32(to_panels(w, out, inp)) }
    }

    /// Pack a row-major `[out, in]` matrix of bf16 bit patterns, kept in bf16, for `compute`.
    pub fn pack_bf16(w: &[u16], out: usize, inp: usize, compute: Bf16Compute) -> Self {
        let data = match compute {
            Bf16Compute::WidenF32 => PanelData::Bf16(to_panels(w, out, inp)),
            Bf16Compute::Dot => PanelData::Bf16Pairs(matmul_bf16::to_pair_panels(w, out, inp)),
            Bf16Compute::Tiles => PanelData::Bf16Tiles(matmul_bf16::to_pair_panels(w, out, inp)),
        };
        Self { out, inp, data }
    }

    /// Pack a row-major `[out, in]` matrix of IEEE half bit patterns, kept in f16 (widened to
    /// f32 as it is read, with F16C where the CPU has it).
    pub fn pack_f16(w: &[u16], out: usize, inp: usize) -> Self {
        Self { out, inp, data: PanelData::F16(to_panels(w, out, inp)) }
    }

    /// How a bf16 weight is computed (`None` for f32 and f16 weights).
    pub fn bf16_compute(&self) -> Option<Bf16Compute> {
        match self.data {
            PanelData::F32(_) | PanelData::F16(_) => None,
            PanelData::Bf16(_) => Some(Bf16Compute::WidenF32),
            PanelData::Bf16Pairs(_) => Some(Bf16Compute::Dot),
            PanelData::Bf16Tiles(_) => Some(Bf16Compute::Tiles),
        }
    }

    /// Panel `p` of an f32 or widened-bf16 weight.
    fn panel(&self, p: usize) -> Panel<'_> {
        let span = p * self.inp * PANEL..(p + 1) * self.inp * PANEL;
        match &self.data {
            PanelData::F32(v) => Panel::F32(&v[span]),
            PanelData::Bf16(v) => Panel::Bf16(&v[span]),
            PanelData::F16(v) => Panel::F16(&v[span]),
            PanelData::Bf16Pairs(_) | PanelData::Bf16Tiles(_) => unreachable!("pair panels are read by matmul_bf16"),
        }
    }

    /// The bytes a product with this weight streams: its panels as packed.
    pub fn packed_bytes(&self) -> usize {
        match &self.data {
            PanelData::F32(v) => v.len() * 4,
            PanelData::Bf16(v) | PanelData::Bf16Pairs(v) | PanelData::Bf16Tiles(v) | PanelData::F16(v) => v.len() * 2,
        }
    }

    pub fn out_features(&self) -> usize {
        self.out
    }

    pub fn in_features(&self) -> usize {
        self.inp
    }

    /// Row `o` of the original matrix (an embedding lookup from a tied lm_head).
    pub fn row(&self, o: usize, dst: &mut [f32]) {
        if let PanelData::Bf16Pairs(v) | PanelData::Bf16Tiles(v) = &self.data {
            let base = (o / PANEL) * matmul_bf16::pairs(self.inp) * 2 * PANEL;
            for (k, d) in dst.iter_mut().enumerate().take(self.inp) {
                *d = bf16_to_f32(v[base + matmul_bf16::index_in_panel(k, o % PANEL)]);
            }
            return;
        }
        let panel = self.panel(o / PANEL);
        for (k, d) in dst.iter_mut().enumerate().take(self.inp) {
            *d = panel.at(k * PANEL + o % PANEL);
        }
    }
}

/// `y[m, out] = x[m, in] · Wᵀ`. Panels are split across the kernel pool's threads; rows are tiled by eight.
pub fn matmul(x: &[f32], m: usize, w: &PackedF32, y: &mut [f32]) {
    matmul_with(Isa::detected(), x, m, w, y)
}

/// [`matmul`] into an uninitialised `y`; every one of its `m · out` values is written.
pub fn matmul_uninit(x: &[f32], m: usize, w: &PackedF32, y: &mut [MaybeUninit<f32>]) {
    run(Isa::detected(), x, m, w, y)
}

/// Several weights of one input width applied to the same `x` (a layer's q/k/v, or its gate/up),
/// into uninitialised `ys[j]` (`[m][ws[j].out]`), every value written, each with exactly the bits
/// [`matmul`] gives it alone. bf16 weights all packed for [`Bf16Compute::Dot`] (or all for
/// [`Bf16Compute::Tiles`]) share one rounding of the rows and one parallel region; any other mix
/// runs one call per weight.
pub fn matmul_many_uninit(x: &[f32], m: usize, ws: &[&PackedF32], ys: &mut [&mut [MaybeUninit<f32>]]) {
    assert_eq!(ws.len(), ys.len(), "matmul: one output per weight");
    let inp = ws.first().map_or(0, |w| w.inp);
    let tiles = ws.first().is_some_and(|w| matches!(w.data, PanelData::Bf16Tiles(_)));
    let pairs: Option<Vec<(&[u16], usize)>> = ws
        .iter()
        .map(|w| match &w.data {
            PanelData::Bf16Pairs(p) if w.inp == inp && !tiles => Some((&p[..], w.out)),
            PanelData::Bf16Tiles(p) if w.inp == inp && tiles => Some((&p[..], w.out)),
            _ => None,
        })
        .collect();
    if pairs.is_some() {
        streamed::add(ws.iter().map(|w| w.packed_bytes()).sum());
    }
    match pairs {
        Some(pairs) if tiles => matmul_bf16::run_tiles_many(Isa::detected(), x, m, &pairs, inp, ys),
        Some(pairs) => matmul_bf16::run_many(Isa::detected(), x, m, &pairs, inp, ys),
        None => ws.iter().zip(ys.iter_mut()).for_each(|(w, y)| run(Isa::detected(), x, m, w, y)),
    }
}

/// `silu(x·gateᵀ) · (x·upᵀ)` into uninitialised `y` `[m][out]` in one pass
/// ([`matmul_bf16::run_gated`], [`matmul_bf16::run_tiles_gated`]) when both are bf16 weights of
/// one shape packed for [`Bf16Compute::Dot`], or both for [`Bf16Compute::Tiles`]; `false`
/// (nothing written) otherwise. The bits are those of [`matmul`] for each followed by
/// [`rowwise::silu_mul`](super::rowwise::silu_mul).
pub fn matmul_gated_uninit(x: &[f32], m: usize, gate: &PackedF32, up: &PackedF32, y: &mut [MaybeUninit<f32>]) -> bool {
    if (gate.out, gate.inp) != (up.out, up.inp) {
        return false;
    }
    match (&gate.data, &up.data) {
        (PanelData::Bf16Pairs(g), PanelData::Bf16Pairs(u)) => {
            matmul_bf16::run_gated(Isa::detected(), x, m, g, u, gate.out, gate.inp, y);
        }
        (PanelData::Bf16Tiles(g), PanelData::Bf16Tiles(u)) => {
            matmul_bf16::run_tiles_gated(Isa::detected(), x, m, g, u, gate.out, gate.inp, y);
        }
        _ => return false,
    }
    streamed::add(gate.packed_bytes() + up.packed_bytes());
    true
}

/// [`matmul`] with an explicit instruction set (tests compare them bit for bit). One this CPU
/// lacks falls back to the scalar path, which gives the same bits.
pub fn matmul_with(isa: Isa, x: &[f32], m: usize, w: &PackedF32, y: &mut [f32]) {
    run(isa, x, m, w, as_uninit(y))
}

fn run(isa: Isa, x: &[f32], m: usize, w: &PackedF32, y: &mut [MaybeUninit<f32>]) {
    streamed::add(w.packed_bytes());
    match &w.data {
        PanelData::Bf16Pairs(panels) => return matmul_bf16::run(isa, x, m, panels, w.out, w.inp, y),
        PanelData::Bf16Tiles(panels) => {
            return matmul_bf16::run_tiles_many(isa, x, m, &[(panels, w.out)], w.inp, &mut [y]);
        }
        _ => {}
    }
    // AVX-512 is the widest path this kernel has.
    let isa = isa.or_scalar().min(Isa::Avx512);
    assert_eq!(x.len(), m * w.inp, "matmul input length");
    assert_eq!(y.len(), m * w.out, "matmul output length");
    // With several row tiles each 16-bit panel would be widened once per tile; widen it once
    // into a scratch panel instead (exact, so the same bits) and run the f32 loop on that.
    let widen = matches!(w.data, PanelData::Bf16(_) | PanelData::F16(_)) && m > ROWS;
    let n = w.inp * PANEL;
    by_panel_stripes(m, w.out, PANEL, 2, y, |p0, p1, stripe| {
        let mut scratch = if widen { vec![0f32; 2 * n] } else { Vec::new() };
        // Two panels at a time: eight independent accumulators hide the FMA latency.
        for p in (p0..p1).step_by(2) {
            let pair = p + 1 < p1;
            let (pa, pb) = if widen {
                let (sa, sb) = scratch.split_at_mut(n);
                for (j, dst) in [sa, sb].into_iter().enumerate().take(1 + usize::from(pair)) {
                    widen_into(isa, w.panel(p + j), dst);
                }
                (Panel::F32(&scratch[..n]), Panel::F32(&scratch[n..]))
            } else {
                (w.panel(p), w.panel((p + 1).min(p1 - 1)))
            };
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(ROWS);
                let xs = &x[r * w.inp..(r + rows) * w.inp];
                let mut acc = [[[0f32; PANEL]; ROWS]; 2];
                let [a0, a1] = &mut acc;
                if pair {
                    tile_pair(isa, xs, rows, w.inp, pa, pb, a0, a1);
                } else {
                    tile(isa, xs, rows, w.inp, pa, a0);
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

/// A 16-bit panel's values as f32 (exact), for the multi-tile loop.
fn widen_into(isa: Isa, src: Panel, dst: &mut [f32]) {
    match src {
        Panel::F32(v) => dst.copy_from_slice(v),
        Panel::Bf16(v) => dst.iter_mut().zip(v).for_each(|(d, &b)| *d = bf16_to_f32(b)),
        Panel::F16(v) => {
            #[cfg(target_arch = "x86_64")]
            if isa != Isa::Scalar {
                // SAFETY: AVX2 (which implies F16C here) confirmed by `isa`; equal lengths.
                return unsafe { x86::widen_f16(v, dst) };
            }
            let _ = isa;
            // half's conversion in software: exact, as `vcvtph2ps` is, but slow.
            dst.iter_mut().zip(v).for_each(|(d, &b)| *d = half::f16::from_bits(b).to_f32())
        }
    }
}

/// `acc[i][c] = Σ_k x[i][k] · panel[k][c]` for `rows ≤ 4` rows, k ascending, one FMA per term.
fn tile(isa: Isa, x: &[f32], rows: usize, k: usize, panel: Panel, acc: &mut [[f32; PANEL]; ROWS]) {
    // SAFETY (all arms): `run` only passes an available ISA (`Isa::Avx2` includes F16C); the
    // pointers are to a whole panel of `k · PANEL` values of the kind named.
    let (kind, p) = (panel.kind(), panel.ptr());
    match (isa, kind) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, x86k::F32) => unsafe { x86::tile_avx512::<{ x86k::F32 }>(x, rows, k, p, acc) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, x86k::BF16) => unsafe { x86::tile_avx512::<{ x86k::BF16 }>(x, rows, k, p, acc) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, _) => unsafe { x86::tile_avx512::<{ x86k::F16 }>(x, rows, k, p, acc) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, x86k::F32) => unsafe { x86::tile_avx2::<{ x86k::F32 }>(x, rows, k, p, acc) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, x86k::BF16) => unsafe { x86::tile_avx2::<{ x86k::BF16 }>(x, rows, k, p, acc) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => unsafe { x86::tile_avx2::<{ x86k::F16 }>(x, rows, k, p, acc) },
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
    p0: Panel,
    p1: Panel,
    acc0: &mut [[f32; PANEL]; ROWS],
    acc1: &mut [[f32; PANEL]; ROWS],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F confirmed by the caller's `isa`; `x` holds `rows` rows of `k`, each
        // panel `k · PANEL` values of the element type the flag names.
        unsafe {
            let (a, b) = (p0.ptr(), p1.ptr());
            match (p0.kind(), p1.kind()) {
                (x86k::F32, x86k::F32) => return x86::tile_pair_avx512::<{ x86k::F32 }>(x, rows, k, a, b, acc0, acc1),
                (x86k::BF16, x86k::BF16) => {
                    return x86::tile_pair_avx512::<{ x86k::BF16 }>(x, rows, k, a, b, acc0, acc1)
                }
                (x86k::F16, x86k::F16) => return x86::tile_pair_avx512::<{ x86k::F16 }>(x, rows, k, a, b, acc0, acc1),
                _ => {}
            }
        }
    }
    tile(isa, x, rows, k, p0, acc0);
    tile(isa, x, rows, k, p1, acc1);
}

/// The portable reference; `mul_add` is a correctly rounded FMA, exactly what the SIMD paths do.
fn tile_scalar(x: &[f32], rows: usize, k: usize, panel: Panel, acc: &mut [[f32; PANEL]; ROWS]) {
    for (i, a) in acc.iter_mut().enumerate().take(rows) {
        let xr = &x[i * k..(i + 1) * k];
        for (kk, &xv) in xr.iter().enumerate() {
            for (c, ac) in a.iter_mut().enumerate() {
                *ac = xv.mul_add(panel.at(kk * PANEL + c), *ac);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::x86k::{BF16, F16, F32};
    use super::{PANEL, ROWS};
    use std::arch::x86_64::*;

    const PREFETCH_STEPS: usize = 32;

    /// Sixteen panel values from element `i` on, widened to f32 (exactly: bf16 by a shift, f16
    /// by `vcvtph2ps`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn ld16<const K: u8>(base: *const u8, i: usize) -> __m512 {
        match K {
            BF16 => {
                let h = _mm256_loadu_si256(base.add(i * 2) as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
            }
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(base.add(i * 2) as *const __m256i)),
            _ => _mm512_loadu_ps(base.add(i * 4) as *const f32),
        }
    }

    /// Eight panel values from element `i` on, widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn ld8<const K: u8>(base: *const u8, i: usize) -> __m256 {
        match K {
            BF16 => {
                let h = _mm_loadu_si128(base.add(i * 2) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            }
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(base.add(i * 2) as *const __m128i)),
            _ => _mm256_loadu_ps(base.add(i * 4) as *const f32),
        }
    }

    /// The byte address of panel element `i` (for prefetching; may point past the panel).
    #[inline(always)]
    fn at<const K: u8>(base: *const u8, i: usize) -> *const i8 {
        base.wrapping_add(i * if K == F32 { 4 } else { 2 }) as *const i8
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_avx512<const K: u8>(
        x: &[f32],
        rows: usize,
        k: usize,
        wp: *const u8,
        acc: &mut [[f32; PANEL]; ROWS],
    ) {
        let xp = x.as_ptr();
        for (i, dst) in acc.iter_mut().enumerate().take(rows) {
            let mut a = _mm512_setzero_ps();
            for kk in 0..k {
                _mm_prefetch(at::<K>(wp, (kk + PREFETCH_STEPS) * PANEL), _MM_HINT_T0);
                a = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(i * k + kk)), ld16::<K>(wp, kk * PANEL), a);
            }
            _mm512_storeu_ps(dst.as_mut_ptr(), a);
        }
    }

    /// Two panels, the row count made a constant so the accumulators are registers.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_pair_avx512<const K: u8>(
        x: &[f32],
        rows: usize,
        k: usize,
        w0: *const u8,
        w1: *const u8,
        acc0: &mut [[f32; PANEL]; ROWS],
        acc1: &mut [[f32; PANEL]; ROWS],
    ) {
        match rows {
            1 => tile_rx2::<1, K>(x, k, w0, w1, acc0, acc1),
            2 => tile_rx2::<2, K>(x, k, w0, w1, acc0, acc1),
            3 => tile_rx2::<3, K>(x, k, w0, w1, acc0, acc1),
            4 => tile_rx2::<4, K>(x, k, w0, w1, acc0, acc1),
            5 => tile_rx2::<5, K>(x, k, w0, w1, acc0, acc1),
            6 => tile_rx2::<6, K>(x, k, w0, w1, acc0, acc1),
            7 => tile_rx2::<7, K>(x, k, w0, w1, acc0, acc1),
            _ => tile_rx2::<8, K>(x, k, w0, w1, acc0, acc1),
        }
    }

    /// `R` rows against two panels: 2·R accumulators, each still one in-order FMA chain.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_rx2<const R: usize, const K: u8>(
        x: &[f32],
        k: usize,
        w0: *const u8,
        w1: *const u8,
        acc0: &mut [[f32; PANEL]; ROWS],
        acc1: &mut [[f32; PANEL]; ROWS],
    ) {
        let (mut a, mut b) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        let xp = x.as_ptr();
        for kk in 0..k {
            // One cache line (or half of one) of each panel per step, prefetched well ahead:
            // a single row's FMA chain alone does not keep enough misses in flight to stream
            // memory.
            _mm_prefetch(at::<K>(w0, (kk + PREFETCH_STEPS) * PANEL), _MM_HINT_T0);
            _mm_prefetch(at::<K>(w1, (kk + PREFETCH_STEPS) * PANEL), _MM_HINT_T0);
            let v0 = ld16::<K>(w0, kk * PANEL);
            let v1 = ld16::<K>(w1, kk * PANEL);
            for i in 0..R {
                let xv = _mm512_set1_ps(*xp.add(i * k + kk));
                a[i] = _mm512_fmadd_ps(xv, v0, a[i]);
                b[i] = _mm512_fmadd_ps(xv, v1, b[i]);
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(acc0[i].as_mut_ptr(), a[i]);
            _mm512_storeu_ps(acc1[i].as_mut_ptr(), b[i]);
        }
    }

    /// `dst[i] = f32(src[i])` for IEEE halves, eight at a time (`src.len()` is a multiple of 16).
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn widen_f16(src: &[u16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        for (s, d) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr() as *const __m128i)));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_avx2<const K: u8>(
        x: &[f32],
        rows: usize,
        k: usize,
        wp: *const u8,
        acc: &mut [[f32; PANEL]; ROWS],
    ) {
        for (i, dst) in acc.iter_mut().enumerate().take(rows) {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for kk in 0..k {
                let xv = _mm256_set1_ps(*x.as_ptr().add(i * k + kk));
                lo = _mm256_fmadd_ps(xv, ld8::<K>(wp, kk * PANEL), lo);
                hi = _mm256_fmadd_ps(xv, ld8::<K>(wp, kk * PANEL + 8), hi);
            }
            _mm256_storeu_ps(dst.as_mut_ptr(), lo);
            _mm256_storeu_ps(dst.as_mut_ptr().add(8), hi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_data as data;

    /// Every path this CPU has: scalar, AVX2, AVX-512, and for bf16 dot-product weights
    /// AVX-512 BF16 (below it they run the emulation).
    fn isas() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16].into_iter().filter(|i| i.available()).collect()
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

    /// bf16 panels give exactly the f32 kernel's bits on the same (upcast) weights, on every path.
    #[test]
    fn bf16_panels_match_the_upcast_weights_bit_for_bit() {
        let (out, inp) = (37, 45);
        let bits: Vec<u16> = data(out * inp, 11).iter().map(|&v| (v.to_bits() >> 16) as u16).collect();
        let up: Vec<f32> = bits.iter().map(|&b| bf16_to_f32(b)).collect();
        let (pb, pf) = (PackedF32::pack_bf16(&bits, out, inp, Bf16Compute::WidenF32), PackedF32::pack(&up, out, inp));
        for m in [1, 2, 5, 8, 11] {
            let x = data(m * inp, 12 + m as u32);
            for isa in isas() {
                let (mut yb, mut yf) = (vec![0f32; m * out], vec![0f32; m * out]);
                matmul_with(isa, &x, m, &pb, &mut yb);
                matmul_with(isa, &x, m, &pf, &mut yf);
                assert_eq!(yb, yf, "{isa:?} m={m}");
            }
        }
        let mut r = [0f32; 45];
        pb.row(30, &mut r);
        assert_eq!(&r[..], &up[30 * inp..31 * inp]);
    }

    /// f16 panels likewise give the bits of the upcast weights, subnormal halves included.
    #[test]
    fn f16_panels_match_the_upcast_weights_bit_for_bit() {
        let (out, inp) = (37, 45);
        let mut bits: Vec<u16> = data(out * inp, 15).iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
        bits[3] = 0x0001; // the smallest subnormal half
        bits[50] = 0x83ff; // a negative subnormal
        let up: Vec<f32> = bits.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
        let (ph, pf) = (PackedF32::pack_f16(&bits, out, inp), PackedF32::pack(&up, out, inp));
        for m in [1, 2, 5, 8, 11] {
            let x = data(m * inp, 16 + m as u32);
            for isa in isas() {
                let (mut yh, mut yf) = (vec![0f32; m * out], vec![0f32; m * out]);
                matmul_with(isa, &x, m, &ph, &mut yh);
                matmul_with(isa, &x, m, &pf, &mut yf);
                assert_eq!(yh, yf, "{isa:?} m={m}");
            }
        }
        let mut r = [0f32; 45];
        ph.row(1, &mut r);
        assert_eq!(&r[..], &up[inp..2 * inp]);
    }

    /// `matmul_uninit` writes every output (the caller treats the buffer as initialised after).
    #[test]
    fn uninit_output_is_fully_written() {
        for (out, inp) in [(37, 29), (16, 8), (130, 5)] {
            let p = PackedF32::pack(&data(out * inp, 21), out, inp);
            for m in [1, 7, 8, 9, 20] {
                let x = data(m * inp, 22);
                let mut want = vec![0f32; m * out];
                matmul(&x, m, &p, &mut want);
                let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
                matmul_uninit(&x, m, &p, &mut y);
                let got = crate::kernels::written(&y);
                assert_eq!(got, want, "{out}x{inp} m={m}");
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
        let bits: Vec<u16> = w.iter().map(|&v| (v.to_bits() >> 16) as u16).collect();
        let p = PackedF32::pack_bf16(&bits, 20, 3, Bf16Compute::Dot);
        p.row(17, &mut r);
        let want: Vec<f32> = bits[17 * 3..18 * 3].iter().map(|&b| bf16_to_f32(b)).collect();
        assert_eq!(&r[..], &want[..]);
    }

    /// Packed for bf16 dot products, a weight runs `matmul_bf16` on every ISA (the emulation
    /// below AVX-512 BF16) with the same bits, and stays close to the f32 product.
    #[test]
    fn bf16_dot_weights_give_the_same_bits_on_every_isa() {
        let (out, inp) = (37, 45);
        let bits: Vec<u16> = data(out * inp, 13).iter().map(|&v| (v.to_bits() >> 16) as u16).collect();
        let p = PackedF32::pack_bf16(&bits, out, inp, Bf16Compute::Dot);
        let widened = PackedF32::pack_bf16(&bits, out, inp, Bf16Compute::WidenF32);
        assert_eq!(p.bf16_compute(), Some(Bf16Compute::Dot));
        for m in [1, 9] {
            let x = data(m * inp, 14);
            let mut first: Option<Vec<f32>> = None;
            for isa in isas() {
                let mut y = vec![0f32; m * out];
                matmul_with(isa, &x, m, &p, &mut y);
                let mut exact = vec![0f32; m * out];
                matmul_with(isa, &x, m, &widened, &mut exact);
                // Activations rounded to 8 significant bits: |Δ| ≤ 2^-8 · Σ|x·w| ≤ 45/256.
                assert!(y.iter().zip(&exact).all(|(a, b)| (a - b).abs() < 0.2), "{isa:?}");
                assert_ne!(y, exact, "the activations were not rounded");
                match &first {
                    None => first = Some(y),
                    Some(f) => assert_eq!(f, &y, "{isa:?} differs"),
                }
            }
        }
    }
}
