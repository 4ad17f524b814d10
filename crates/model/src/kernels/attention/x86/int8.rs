//! The AVX-512 body of a stored int8 block ([`super::block`] hands it over): the integer
//! arithmetic of [`crate::kernels::attention::int8`], 64 key products per `vpdpbusd` and 32 value
//! products per `vpdpwssd` with AVX-512 VNNI, or the same sums from `vpmaddwd` without it.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{columns, softmax_rows, tile_lanes, tree_sum, Scratch, SCORE_ROWS, SET_ROWS};
use crate::kernels::attention::int8::{WeightStep, Q_LEVELS, W_LEVELS};
use crate::kernels::attention::{KvStore, Rows, SegState, KEY_TILE};
use crate::kernels::kv_quant::scale;

/// The integer multiply-adds of the int8 cache: exact, so both forms give the same sums.
trait IntDots {
    /// Per 32-bit lane: `acc + Σ₄ u8(a)·i8(b)`.
    unsafe fn dpbusd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i;
    /// Per 32-bit lane: `acc + Σ₂ i16(a)·i16(b)`.
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i;
}

/// AVX-512 VNNI.
struct Vnni;
/// AVX-512BW's `vpmaddwd`: bytes widened to 16 bits first (products of u8 and i8 fit; the sum of
/// two never reaches `vpmaddwd`'s only overflow, −32768·−32768 twice).
struct Madd;

impl IntDots for Vnni {
    #[inline(always)]
    unsafe fn dpbusd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        _mm512_dpwssd_epi32(acc, a, b)
    }
}

impl IntDots for Madd {
    #[inline(always)]
    unsafe fn dpbusd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        let a_even = _mm512_and_si512(a, _mm512_set1_epi16(0xff));
        let a_odd = _mm512_srli_epi16::<8>(a);
        let b_even = _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(b));
        let b_odd = _mm512_srai_epi16::<8>(b);
        let sum = _mm512_add_epi32(_mm512_madd_epi16(a_even, b_even), _mm512_madd_epi16(a_odd, b_odd));
        _mm512_add_epi32(acc, sum)
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
    }
}

/// What [`block`] works on: the rows, the block, its live keys, the row set, scratch, the state.
pub(super) type BlockArgs<'a, 'r> =
    (&'a Rows<'r>, usize, (usize, usize), &'a [usize], &'a mut Scratch, &'a mut SegState);

/// [`block`] with AVX-512 VNNI.
///
/// # Safety
/// AVX-512F, BW and VNNI must be available; the head size must be `16·NV`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
pub(super) unsafe fn block_vnni<const NV: usize>((rows, b, live, set, scratch, st): BlockArgs) {
    block::<NV, Vnni>(rows, b, live, set, scratch, st)
}

/// [`block`] with `vpmaddwd`.
///
/// # Safety
/// AVX-512F and BW must be available; the head size must be `16·NV`.
#[target_feature(enable = "avx512f,avx512bw,fma")]
pub(super) unsafe fn block_madd<const NV: usize>((rows, b, live, set, scratch, st): BlockArgs) {
    block::<NV, Madd>(rows, b, live, set, scratch, st)
}

/// [`super::block`] for a stored int8 block, in [`crate::kernels::attention::int8`]'s integer
/// arithmetic: each row's query quantized against the block's key statistics, scores as
/// `vpdpbusd` sums over four channels of 16 keys, the softmax, each row's weights quantized, and
/// the weighted values as `vpdpwssd` sums over two tokens of 16 channels.
#[inline(always)]
unsafe fn block<const NV: usize, D: IntDots>(
    rows: &Rows,
    b: usize,
    (a, e): (usize, usize),
    set: &[usize],
    scratch: &mut Scratch,
    st: &mut SegState,
) {
    let KvStore::Int8 { k, k_min, k_scale, v, v_scale } = rows.kv.store else { return };
    let d = NV * 16;
    let bs = rows.kv.block_size;
    let stride = bs.next_multiple_of(KEY_TILE);
    let head = rows.store_head(b);
    let Scratch { scores, w, qs, vs, q8, w16, .. } = scratch;
    // The query side: q·scale per channel (the scales are the block's, shared by the rows).
    let mut sc = [0f32; 128];
    for c in 0..d {
        sc[c] = scale(k_scale[head * d + c]);
    }
    let mut side = [(0f32, 0f32); SET_ROWS];
    for (i, &r) in set.iter().enumerate() {
        side[i] = quantize_query::<NV>(
            rows.q.as_ptr().add(r * d),
            sc.as_ptr(),
            k_min.as_ptr().add(head * d),
            qs.as_mut_ptr(),
            q8.as_mut_ptr().add(i * d),
        );
    }
    let (j0, j1) = (a / KEY_TILE, (e - 1) / KEY_TILE + 1);
    let codes = k.as_ptr().add(head * d * bs);
    for j in j0..j1 {
        for (g, group) in set.chunks(SCORE_ROWS).enumerate() {
            let i0 = g * SCORE_ROWS;
            let args = (
                q8.as_ptr().add(i0 * d),
                &side[i0..i0 + group.len()],
                codes,
                bs,
                j,
                scores.as_mut_ptr().add(i0 * stride),
                stride,
            );
            match group.len() {
                1 => scores_int8::<NV, 1, D>(args),
                2 => scores_int8::<NV, 2, D>(args),
                3 => scores_int8::<NV, 3, D>(args),
                4 => scores_int8::<NV, 4, D>(args),
                5 => scores_int8::<NV, 5, D>(args),
                6 => scores_int8::<NV, 6, D>(args),
                7 => scores_int8::<NV, 7, D>(args),
                _ => scores_int8::<NV, 8, D>(args),
            }
        }
    }
    for t in a..e {
        vs[t] = scale(v_scale[head * bs + t]);
    }
    softmax_rows::<NV>(set, scores, w, Some(vs), (a, e), stride, st);
    // Each row's weights as codes over whole token pairs (zero outside `a..e`).
    let (p0, p1) = (a / 2, e.div_ceil(2));
    let mut steps = [WeightStep::Nothing; SET_ROWS];
    for i in 0..set.len() {
        steps[i] = quantize_weights(w.as_ptr().add(i * stride), (a, e), w16.as_mut_ptr().add(i * stride));
    }
    let vcodes = v.as_ptr().add(head * bs * d);
    for (g, group) in set.chunks(SCORE_ROWS).enumerate() {
        let i0 = g * SCORE_ROWS;
        let args = (
            group,
            &steps[i0..i0 + group.len()],
            w16.as_ptr().add(i0 * stride),
            stride,
            vcodes,
            (p0, p1),
            &mut st.o[..],
        );
        match group.len() {
            1 => values_int8::<NV, 1, D>(args),
            2 => values_int8::<NV, 2, D>(args),
            3 => values_int8::<NV, 3, D>(args),
            4 => values_int8::<NV, 4, D>(args),
            5 => values_int8::<NV, 5, D>(args),
            6 => values_int8::<NV, 6, D>(args),
            7 => values_int8::<NV, 7, D>(args),
            _ => values_int8::<NV, 8, D>(args),
        }
    }
}

/// [`crate::kernels::attention::int8::quantize_query`] on 16 channels at a time (the same
/// operations: the multiplications and roundings per channel, an order-free maximum, the bias's
/// fused chains in lane `c mod 16` then the tree sum). `xs`: scratch for `d` floats.
#[inline(always)]
unsafe fn quantize_query<const NV: usize>(
    q: *const f32,
    sc: *const f32,
    mins: *const u16,
    xs: *mut f32,
    q8: *mut i8,
) -> (f32, f32) {
    let mut bias = _mm512_setzero_ps();
    let mut amax = _mm512_setzero_ps();
    let mut bad: __mmask16 = 0;
    let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
    for v in 0..NV {
        let qv = _mm512_loadu_ps(q.add(16 * v));
        let m = _mm512_cvtph_ps(_mm256_loadu_si256(mins.add(16 * v).cast()));
        bias = _mm512_fmadd_ps(qv, m, bias);
        let x = _mm512_mul_ps(qv, _mm512_loadu_ps(sc.add(16 * v)));
        _mm512_storeu_ps(xs.add(16 * v), x);
        let ax = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), abs_mask));
        // Not below infinity: infinite or NaN.
        bad |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(ax, _mm512_set1_ps(f32::INFINITY));
        amax = _mm512_max_ps(amax, ax);
    }
    let bias = tree_sum(bias);
    let amax = _mm512_reduce_max_ps(amax);
    if bad != 0 || amax == 0.0 {
        for c in 0..16 * NV {
            *q8.add(c) = 0;
        }
        return (if bad != 0 { f32::NAN } else { 0.0 }, bias);
    }
    let inv = _mm512_set1_ps(Q_LEVELS / amax);
    for v in 0..NV {
        // Round to nearest even (the default mode), then narrow: |code| ≤ 127.
        let c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs.add(16 * v)), inv));
        _mm_storeu_si128(q8.add(16 * v).cast(), _mm512_cvtepi32_epi8(c));
    }
    (amax / Q_LEVELS, bias)
}

/// [`crate::kernels::attention::int8::quantize_weights`] on one row's weights over whole tiles:
/// codes written for every position of the token pairs `a/2..⌈e/2⌉` (zero outside `a..e`).
#[inline(always)]
unsafe fn quantize_weights(w: *const f32, (a, e): (usize, usize), w16: *mut i16) -> WeightStep {
    let (j0, j1) = (a / KEY_TILE, (e - 1) / KEY_TILE + 1);
    let mut wmax = _mm512_setzero_ps();
    let mut bad: __mmask16 = 0;
    for j in j0..j1 {
        let x = _mm512_maskz_loadu_ps(tile_lanes(j, a, e), w.add(j * KEY_TILE));
        bad |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(f32::INFINITY));
        wmax = _mm512_max_ps(wmax, x);
    }
    let wmax = _mm512_reduce_max_ps(wmax);
    let inv = W_LEVELS / wmax;
    if bad != 0 {
        return WeightStep::Nan;
    }
    if wmax <= 0.0 || !inv.is_finite() {
        return WeightStep::Nothing;
    }
    let iv = _mm512_set1_ps(inv);
    for j in j0..j1 {
        let x = _mm512_maskz_loadu_ps(tile_lanes(j, a, e), w.add(j * KEY_TILE));
        let c = _mm512_cvtps_epi32(_mm512_mul_ps(x, iv));
        _mm256_storeu_si256(w16.add(j * KEY_TILE).cast(), _mm512_cvtepi32_epi16(c));
    }
    WeightStep::Step(wmax / W_LEVELS)
}

/// Arguments of [`scores_int8`]: the rows' query codes (`d` apart), their (step, bias), the
/// block's key codes, the block size, the tile, scores out (rows `stride` apart), the stride.
type Int8ScoreArgs<'a> = (*const i8, &'a [(f32, f32)], *const u8, usize, usize, *mut f32, usize);

/// Scores of `G` rows against key tile `j`: per four channels one 64-byte load (16 keys × 4
/// channels, [`crate::kernels::kv_quant::key_code_at`]) and one `dpbusd` per row.
#[inline(always)]
unsafe fn scores_int8<const NV: usize, const G: usize, D: IntDots>(
    (q8, side, codes, bs, j, out, stride): Int8ScoreArgs,
) {
    let d = NV * 16;
    let t0 = j * KEY_TILE;
    let len = KEY_TILE.min(bs - t0);
    let bytes: __mmask64 = if len == KEY_TILE { !0 } else { (1u64 << (4 * len)) - 1 };
    let tile = codes.add(t0 * d);
    let mut acc = [_mm512_setzero_si512(); G];
    for c4 in 0..d / 4 {
        let kv = _mm512_maskz_loadu_epi8(bytes, tile.add(c4 * len * 4).cast());
        for i in 0..G {
            let qd = q8.add(i * d + 4 * c4).cast::<i32>().read_unaligned();
            acc[i] = D::dpbusd(acc[i], kv, _mm512_set1_epi32(qd));
        }
    }
    for i in 0..G {
        let (step, bias) = side[i];
        let s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_set1_ps(step), _mm512_set1_ps(bias));
        _mm512_storeu_ps(out.add(i * stride + t0), s);
    }
}

/// Arguments of [`values_int8`]: rows, their weight steps, their weight codes (`stride` apart),
/// the stride, the block's value codes, the token pairs, the outputs.
type Int8ValueArgs<'a> = (&'a [usize], &'a [WeightStep], *const i16, usize, *const i8, (usize, usize), &'a mut [f32]);

/// `o += step·Σ w16·code` for `G` rows over token pairs `p0..p1`: the sums in registers a few
/// vectors at a time, each pair's 32 codes of 16 channels widened once for all rows.
#[inline(always)]
unsafe fn values_int8<const NV: usize, const G: usize, D: IntDots>(
    (set, steps, w16, stride, v, (p0, p1), o): Int8ValueArgs,
) {
    let d = NV * 16;
    let cols = columns(NV, G);
    for c0 in (0..NV).step_by(cols) {
        let mut acc = [[_mm512_setzero_si512(); 8]; G];
        for p in p0..p1 {
            let mut vv = [_mm512_setzero_si512(); 8];
            for c in 0..cols {
                vv[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(v.add(p * 2 * d + 32 * (c0 + c)).cast()));
            }
            for i in 0..G {
                let wp = _mm512_set1_epi32(w16.add(i * stride + 2 * p).cast::<i32>().read_unaligned());
                for c in 0..cols {
                    acc[i][c] = D::dpwssd(acc[i][c], vv[c], wp);
                }
            }
        }
        for (i, &r) in set.iter().enumerate().take(G) {
            let op = o.as_mut_ptr().add(r * d + 16 * c0);
            match steps[i] {
                WeightStep::Nothing => {}
                WeightStep::Nan => {
                    for c in 0..cols {
                        _mm512_storeu_ps(op.add(16 * c), _mm512_set1_ps(f32::NAN));
                    }
                }
                WeightStep::Step(s) => {
                    let sv = _mm512_set1_ps(s);
                    for c in 0..cols {
                        let x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][c]), sv, _mm512_loadu_ps(op.add(16 * c)));
                        _mm512_storeu_ps(op.add(16 * c), x);
                    }
                }
            }
        }
    }
}
