//! The AVX-512 BF16 micro-kernels, the start-up timing of `vdpbf16ps` against FMAs, and the
//! AVX-512 rounding of activation rows to bf16.

use super::{PANEL, ROWS, STEP};
use std::arch::x86_64::*;

/// k-pairs to prefetch ahead: one 64-byte line of each panel per step.
///
/// Zen 5 (AMD family 26, 2026-12-06, 2 threads), where the int8 tiles' few rows stream fastest
/// prefetching into L2 only: here, into L2 4 KiB ahead at up to four rows streamed a lone 537 MB
/// bf16 weight 10–16% faster (alternated call by call, `membw` 64–67 GB/s), but the whole of
/// qwen2.5-1.5b bf16 decoded level (every step alternated in one process, three runs of 256
/// steps: 1.002, 1.011, 0.991), so this one prefetch stays on every CPU.
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
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(v, _mm512_add_epi32(bias, _mm512_and_si512(high, one))));
        let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs_mask), inf);
        let r = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, quiet));
        _mm256_storeu_si256(dst.as_mut_ptr().add(k) as *mut __m256i, _mm512_cvtepi32_epi16(r));
        k += 16;
    }
    for (d, &v) in dst[k..n].iter_mut().zip(&src[k..n]) {
        *d = std::mem::MaybeUninit::new(super::round_to_bf16(v));
    }
}
