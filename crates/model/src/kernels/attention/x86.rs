//! The AVX-512 body of [`super::segment`]: [`super::Portable`]'s operations, one for one, with 16
//! keys (scores) or 16 channels (values) per instruction, and the rows of a task taken together so
//! that each key and value tile is converted and loaded once for all of them: the query heads of a
//! KV head (grouped-query attention) and, in prefill, several tokens.

use std::arch::x86_64::*;

use super::{load_tile_len, Rows, SegState, Source, KEY_TILE};
use crate::kernels::attention::KvStore;
use crate::kernels::kv_quant::scale;

/// Rows whose scores are computed together (two partial sums each: 16 accumulators).
const SCORE_ROWS: usize = 8;

/// `e^x` on 16 lanes: [`super::exp`]'s operations, one for one.
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_setzero_ps());
    let magic = _mm512_set1_ps(12_582_912.0);
    let k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)), magic), magic);
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693_145_75))),
        _mm512_mul_ps(k, _mm512_set1_ps(1.428_606_8e-6)),
    );
    let c = |v: f32| _mm512_set1_ps(v);
    let mut p = _mm512_add_ps(c(1.0 / 120.0), _mm512_mul_ps(r, c(1.0 / 720.0)));
    p = _mm512_add_ps(c(1.0 / 24.0), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(c(1.0 / 6.0), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(c(0.5), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(c(1.0), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(c(1.0), _mm512_mul_ps(r, p));
    let bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
    _mm512_mul_ps(p, _mm512_castsi512_ps(bits))
}

/// [`super::tree_sum`] on a vector: 8 + 8, 4 + 4, 2 + 2, 1 + 1.
#[inline(always)]
unsafe fn tree_sum(p: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(p);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
    let h = _mm256_add_ps(lo, hi);
    let g = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    let f = _mm_add_ps(g, _mm_movehl_ps(g, g));
    _mm_cvtss_f32(_mm_add_ss(f, _mm_shuffle_ps(f, f, 1)))
}

/// Lanes `a..e` of a tile.
#[inline(always)]
fn lanes(a: usize, e: usize) -> __mmask16 {
    (((1u32 << e) - 1) & !((1u32 << a) - 1)) as __mmask16
}

/// Dispatch on the head size (16 to 128 in steps of 16).
///
/// # Safety
/// AVX-512F and BW must be available; `rows.d` a multiple of 16, at most 128.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn segment(rows: &Rows, b0: usize, b1: usize, st: &mut SegState) {
    match rows.d / 16 {
        1 => seg::<1>(rows, b0, b1, st),
        2 => seg::<2>(rows, b0, b1, st),
        3 => seg::<3>(rows, b0, b1, st),
        4 => seg::<4>(rows, b0, b1, st),
        5 => seg::<5>(rows, b0, b1, st),
        6 => seg::<6>(rows, b0, b1, st),
        7 => seg::<7>(rows, b0, b1, st),
        _ => seg::<8>(rows, b0, b1, st),
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn seg<const NV: usize>(rows: &Rows, b0: usize, b1: usize, st: &mut SegState) {
    let d = NV * 16;
    let bs = rows.kv.block_size;
    let n = rows.rows.len();
    let mut kt = [0f32; 128 * KEY_TILE];
    let mut vt = [0f32; KEY_TILE * 128];
    let mut qs = vec![0f32; n * d];
    let mut qb = vec![0f32; n];
    let mut sel: Vec<usize> = Vec::with_capacity(n);
    let mut tile_rows: Vec<(usize, usize, usize)> = Vec::with_capacity(n);
    let mut scores = vec![_mm512_setzero_ps(); n];
    for b in b0..b1 {
        for src in [Source::Store, Source::Exact] {
            sel.clear();
            sel.extend((0..n).filter(|&r| rows.source(r, b) == Some(src)));
            if sel.is_empty() {
                continue;
            }
            // The query side of this block: int8 keys fold their per-channel scale into the
            // query and their minimum into one bias per row.
            let int8 = match (src, rows.kv.store) {
                (Source::Store, KvStore::Int8 { k_min, k_scale, .. }) => {
                    let at = rows.store_head(b) * d;
                    let mut sc = [0f32; 128];
                    for c in 0..d {
                        sc[c] = scale(k_scale[at + c]);
                    }
                    for &r in &sel {
                        let q = rows.q.as_ptr().add(r * d);
                        let mut acc = _mm512_setzero_ps();
                        for i in 0..NV {
                            let qv = _mm512_loadu_ps(q.add(16 * i));
                            let mins = _mm512_cvtph_ps(_mm256_loadu_si256(k_min.as_ptr().add(at + 16 * i).cast()));
                            _mm512_storeu_ps(
                                qs.as_mut_ptr().add(r * d + 16 * i),
                                _mm512_mul_ps(qv, _mm512_loadu_ps(sc.as_ptr().add(16 * i))),
                            );
                            acc = _mm512_fmadd_ps(qv, mins, acc);
                        }
                        qb[r] = tree_sum(acc);
                    }
                    true
                }
                _ => {
                    for &r in &sel {
                        qs[r * d..(r + 1) * d].copy_from_slice(&rows.q[r * d..(r + 1) * d]);
                    }
                    false
                }
            };
            for t0 in (0..bs).step_by(KEY_TILE) {
                let len = KEY_TILE.min(bs - t0);
                let start = b * bs + t0;
                tile_rows.clear();
                for &r in &sel {
                    let (a, e) = rows.live(r, start, len);
                    if a < e {
                        tile_rows.push((r, a - start, e - start));
                    }
                }
                if tile_rows.is_empty() {
                    continue;
                }
                // The tile as f32: straight from the pool or the exact block, else converted.
                let (kp, ks, vp, vscale) = tile::<NV>(rows, src, b, t0, len, &mut kt, &mut vt);
                let kmask: __mmask16 = lanes(0, len);
                for group in tile_rows.chunks(SCORE_ROWS) {
                    let mut a0 = [_mm512_setzero_ps(); SCORE_ROWS];
                    let mut a1 = [_mm512_setzero_ps(); SCORE_ROWS];
                    for c in (0..d).step_by(2) {
                        let k0 = _mm512_maskz_loadu_ps(kmask, kp.add(c * ks));
                        let k1 = _mm512_maskz_loadu_ps(kmask, kp.add((c + 1) * ks));
                        for (i, &(r, _, _)) in group.iter().enumerate() {
                            let q = qs.as_ptr().add(r * d + c);
                            a0[i] = _mm512_fmadd_ps(_mm512_set1_ps(*q), k0, a0[i]);
                            a1[i] = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(1)), k1, a1[i]);
                        }
                    }
                    for (i, &(r, _, _)) in group.iter().enumerate() {
                        let s = _mm512_add_ps(a0[i], a1[i]);
                        scores[r] = if int8 { _mm512_add_ps(s, _mm512_set1_ps(qb[r])) } else { s };
                    }
                }
                for &(r, a, e) in &tile_rows {
                    let live = lanes(a, e);
                    let s = scores[r];
                    let block_max = _mm512_mask_reduce_max_ps(live, s);
                    let new_max = st.m[r].max(block_max);
                    let correction = super::exp(st.m[r] - new_max);
                    let p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
                    st.l[r] = st.l[r].mul_add(correction, tree_sum(p));
                    st.m[r] = new_max;
                    st.touched[r] = true;
                    let w = match &vscale {
                        Some(vs) => _mm512_mul_ps(p, _mm512_loadu_ps(vs.as_ptr())),
                        None => p,
                    };
                    let mut wl = [0f32; KEY_TILE];
                    _mm512_storeu_ps(wl.as_mut_ptr(), w);
                    let op = st.o.as_mut_ptr().add(r * d);
                    let mut o = [_mm512_setzero_ps(); NV];
                    for (i, x) in o.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(op.add(16 * i));
                    }
                    if correction != 1.0 {
                        let cv = _mm512_set1_ps(correction);
                        for x in o.iter_mut() {
                            *x = _mm512_mul_ps(*x, cv);
                        }
                    }
                    for (t, &wt) in wl.iter().enumerate().take(e).skip(a) {
                        let wv = _mm512_set1_ps(wt);
                        let vrow = vp.add(t * d);
                        for (i, x) in o.iter_mut().enumerate() {
                            *x = _mm512_fmadd_ps(wv, _mm512_loadu_ps(vrow.add(16 * i)), *x);
                        }
                    }
                    for (i, x) in o.iter().enumerate() {
                        _mm512_storeu_ps(op.add(16 * i), *x);
                    }
                }
            }
        }
    }
}

/// Key tile `t0..t0 + len` of block `b` as f32: (keys, their channel stride, values with rows of
/// `d`, int8 value scales). f32 tiles are read in place; bf16 and int8 are converted into `kt`
/// (`[d][16]`) and `vt` (`[16][d]`), int8 codes as their integer values.
#[allow(clippy::type_complexity)]
#[inline(always)]
unsafe fn tile<const NV: usize>(
    rows: &Rows,
    src: Source,
    b: usize,
    t0: usize,
    len: usize,
    kt: &mut [f32; 128 * KEY_TILE],
    vt: &mut [f32; KEY_TILE * 128],
) -> (*const f32, usize, *const f32, Option<[f32; KEY_TILE]>) {
    let (d, bs) = (NV * 16, rows.kv.block_size);
    let at = rows.store_head(b) * bs * d;
    match (src, rows.kv.store) {
        (Source::Exact, _) => {
            let (k, v) = rows.exact(b);
            (k.as_ptr().add(t0), bs, v.as_ptr().add(t0 * d), None)
        }
        (Source::Store, KvStore::F32 { k, v }) => (k.as_ptr().add(at + t0), bs, v.as_ptr().add(at + t0 * d), None),
        (Source::Store, KvStore::Bf16 { k, v }) => {
            let widen = |x: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
            for c in 0..d {
                let row = load_tile_len::<u16>(&k[at + c * bs + t0..], len);
                _mm512_storeu_ps(kt.as_mut_ptr().add(c * KEY_TILE), widen(_mm256_loadu_si256(row.as_ptr().cast())));
            }
            for t in 0..len {
                let row = v.as_ptr().add(at + (t0 + t) * d);
                for i in 0..NV {
                    let x = _mm256_loadu_si256(row.add(16 * i).cast());
                    _mm512_storeu_ps(vt.as_mut_ptr().add(t * d + 16 * i), widen(x));
                }
            }
            (kt.as_ptr(), KEY_TILE, vt.as_ptr(), None)
        }
        (Source::Store, KvStore::Int8 { k, v, v_scale, .. }) => {
            for c in 0..d {
                let row = load_tile_len::<u8>(&k[at + c * bs + t0..], len);
                let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.as_ptr().cast()));
                _mm512_storeu_ps(kt.as_mut_ptr().add(c * KEY_TILE), _mm512_cvtepi32_ps(x));
            }
            for t in 0..len {
                let row = v.as_ptr().add(at + (t0 + t) * d);
                for i in 0..NV {
                    let x = _mm512_cvtepi8_epi32(_mm_loadu_si128(row.add(16 * i).cast()));
                    _mm512_storeu_ps(vt.as_mut_ptr().add(t * d + 16 * i), _mm512_cvtepi32_ps(x));
                }
            }
            let mut vs = [0f32; KEY_TILE];
            let s0 = rows.store_head(b) * bs + t0;
            for (t, x) in vs.iter_mut().enumerate().take(len) {
                *x = scale(v_scale[s0 + t]);
            }
            (kt.as_ptr(), KEY_TILE, vt.as_ptr(), Some(vs))
        }
    }
}
