//! The AVX-512 body of [`super::segment`]: [`super::portable::Portable`]'s operations, one for
//! one, with 16 keys (scores) or 16 channels (values) per instruction, and the rows of a task
//! taken together so that each key and value tile is converted and loaded once for all of them:
//! the query heads of a KV head (grouped-query attention) and, in prefill, several tokens.

// Index loops mirror the registers and lanes they stand for (and unroll into them).
#![allow(clippy::needless_range_loop)]

mod int8;

use std::arch::x86_64::*;

use super::{load_tile_len, Region, Rows, SegState, Source, KEY_TILE};
use crate::kernels::attention::KvStore;

/// Rows whose scores are computed together (two partial sums each: 16 accumulators).
pub(super) const SCORE_ROWS: usize = 8;

/// [`super::exp_fma`] on 16 lanes, one instruction per step.
#[inline(always)]
unsafe fn exp16_fma(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_setzero_ps());
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(super::LN2_LO), _mm512_fnmadd_ps(k, _mm512_set1_ps(super::LN2_HI), x));
    let c = |v: f32| _mm512_set1_ps(v);
    let mut p = _mm512_fmadd_ps(c(1.0 / 720.0), r, c(1.0 / 120.0));
    for v in [1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, c(v));
    }
    _mm512_scalef_ps(p, k)
}

#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,fma")]
pub(super) unsafe fn exp16_for_tests(x: [f32; 16]) -> [f32; 16] {
    let mut out = [0f32; 16];
    _mm512_storeu_ps(out.as_mut_ptr(), exp16_fma(_mm512_loadu_ps(x.as_ptr())));
    out
}

/// [`super::portable::tree_sum`] on a vector: 8 + 8, 4 + 4, 2 + 2, 1 + 1.
#[inline(always)]
pub(super) unsafe fn tree_sum(p: __m512) -> f32 {
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

/// Dispatch on the head size (16, 32, 64 or 128: [`handles`]). `vnni`: stored int8 blocks use
/// AVX-512 VNNI (the same sums as without).
///
/// # Safety
/// AVX-512F and BW must be available (and VNNI when `vnni`); `rows.d` one of those.
#[target_feature(enable = "avx512f,avx512bw,fma")]
pub(super) unsafe fn segment(rows: &Rows, b0: usize, b1: usize, st: &mut SegState, vnni: bool) {
    match rows.d {
        16 => seg::<1>(rows, b0, b1, st, vnni),
        32 => seg::<2>(rows, b0, b1, st, vnni),
        64 => seg::<4>(rows, b0, b1, st, vnni),
        _ => seg::<8>(rows, b0, b1, st, vnni),
    }
}

/// The head sizes this path has a body for (every Qwen2 model has 64 or 128).
pub(super) fn handles(d: usize) -> bool {
    matches!(d, 16 | 32 | 64 | 128)
}

/// Rows that go through a block together (their scores and weights stay in L1).
pub(super) const SET_ROWS: usize = 32;

/// Per-thread scratch, allocated once: scores and weights of a row set over one block, the
/// query sides, a converted key and value tile, a block's value scales.
pub(super) struct Scratch {
    scores: Vec<f32>,
    w: Vec<f32>,
    qs: Vec<f32>,
    kt: Box<[f32; 128 * KEY_TILE]>,
    vt: Box<[f32; KEY_TILE * 128]>,
    vs: Vec<f32>,
    /// Int8: the rows' query codes (`[row][d]`) and weight codes (`[row][stride]`).
    q8: Vec<i8>,
    w16: Vec<i16>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// Every block of `b0..b1` for the rows of `rows`. Inlined into [`segment`], so its body is
/// compiled with its instruction sets (no closure in it: a closure would not inherit them).
#[inline(always)]
unsafe fn seg<const NV: usize>(rows: &Rows, b0: usize, b1: usize, st: &mut SegState, vnni: bool) {
    // SAFETY: the thread-local lives as long as this thread, which runs this whole call.
    let cell: *const std::cell::RefCell<Option<Scratch>> = SCRATCH.with(|c| c as *const _);
    let mut scratch = (*cell).borrow_mut();
    let bs = rows.kv.block_size;
    let scratch = scratch.get_or_insert_with(|| Scratch {
        scores: Vec::new(),
        w: Vec::new(),
        qs: Vec::new(),
        kt: Box::new([0.0; 128 * KEY_TILE]),
        vt: Box::new([0.0; KEY_TILE * 128]),
        vs: Vec::new(),
        q8: Vec::new(),
        w16: Vec::new(),
    });
    // Rows of whole tiles, so a tile's 16 lanes never reach into the next row.
    let stride = bs.next_multiple_of(KEY_TILE);
    scratch.scores.resize(SET_ROWS * stride, 0.0);
    scratch.w.resize(SET_ROWS * stride, 0.0);
    scratch.qs.resize(SET_ROWS * NV * 16, 0.0);
    scratch.vs.resize(stride, 0.0);
    scratch.q8.resize(SET_ROWS * NV * 16, 0);
    scratch.w16.resize(SET_ROWS * stride, 0);
    let mut set = [0usize; SET_ROWS];
    let mut n = 0;
    // Decode reads each block's keys and values once, mostly from memory: their lines are asked
    // for a few at a time while what comes before them is computed ([`Ahead`]): a block's values
    // during its scores, the next block's keys (or, after the task's last block, those of the
    // thread's likely next task) during its values. Otherwise (prefill, int8 codes) the next
    // block is asked for whole.
    let spread = rows.rows.len() <= SCORE_ROWS
        && bs.is_multiple_of(KEY_TILE)
        && matches!(rows.kv.store, KvStore::F32 { .. } | KvStore::Bf16 { .. });
    for b in b0..b1 {
        // The next block lives elsewhere in the pool (the table is indirect, so the hardware
        // prefetcher cannot guess it): fetch it while this one is computed.
        if b + 1 < b1 && !spread {
            prefetch_block(rows, b + 1);
        }
        // Past this segment's end (`b1`), a whole task goes on into its next segment.
        let next_keys = if !spread {
            None
        } else if b >= rows.last {
            Some(rows.then)
        } else {
            Some(rows.kv.regions(rows.store_head(b + 1), (0, 0)).0)
        };
        // Rows that read this block the same way (source and live keys) go together: all of
        // them off the diagonal, one token's heads on it.
        let mut key = None;
        for r in 0..rows.rows.len() {
            let this = rows.source(r, b).and_then(|src| {
                let (a, e) = rows.live(r, b * bs, bs);
                (a < e).then_some((src, a - b * bs, e - b * bs))
            });
            if (this != key || n == SET_ROWS) && n > 0 {
                if let Some(k) = key {
                    block::<NV>(rows, b, k, &set[..n], scratch, st, vnni, next_keys);
                }
                n = 0;
            }
            key = this;
            if this.is_some() {
                set[n] = r;
                n += 1;
            }
        }
        if let (Some(k), true) = (key, n > 0) {
            block::<NV>(rows, b, k, &set[..n], scratch, st, vnni, next_keys);
        }
        n = 0;
    }
}

/// A region's cache lines asked for (into L2) a few at a time, spread evenly over the `steps`
/// iterations of a loop that computes while they arrive (a loop of one step, as for the values
/// of a 16-token f32 block's single key tile, asks for them all at once). A decode task reads
/// each block once, from memory; the whole-block prefetch at each block's start (the prefill
/// way) left a task's first block unasked and gained little here. Measured on Zen 4, cache cold
/// as in a decode step (`attention_cost --flush`), alternated pairs, ms a 24-layer step: 16
/// sequences of 200 tokens with qwen3-30b-a3b's heads (`--seqs 16 --depth 200 --heads 32/4/128
/// --dtype bf16`) 14.3–14.8 → 9.6–10.8; 16 of 4,096 tokens 247 → 178; one sequence at 16,384
/// tokens (qwen2.5-0.5b's heads) 16.5–16.8 → 9.8–10.6 in bf16, 27–30 → 17–19 in f32. Asking
/// into L1 instead was about a fifth slower than into L2.
///
/// On the Sapphire Rapids-class Xeon (2 threads, `--seqs 16 --depth 192 --heads 32/4/128 --dtype
/// bf16 --flush 400`, alternated runs, ms a 24-layer step) this spread is worth 1.7×: 12.8–13.1
/// against 21.8–24.4 without it. Asking for every second line (the adjacent-line prefetcher did
/// not fetch the others) took 16.7–16.9, every fourth 19.3, into L1 13.9–14.2, into the outer
/// cache (T2) 12.6–12.7. Keys laid out per 16-key tile (each tile's channels one 4 KB run)
/// instead of `[d][bs]` were level (12.6–12.8). With every sequence reading the same blocks, so
/// that the cache held them, the step took 8.4 ms against 12.3: there, two thirds of decode
/// attention is arithmetic, not waiting for memory.
struct Ahead {
    next: *const i8,
    end: *const i8,
    per_step: usize,
}

impl Ahead {
    fn new(region: Region, steps: usize) -> Self {
        // From the line the region starts in.
        let skew = region.start as usize % 64;
        let start = region.start.wrapping_sub(skew).cast::<i8>();
        let bytes = if region.bytes == 0 { 0 } else { region.bytes + skew };
        Ahead { next: start, end: start.wrapping_add(bytes), per_step: bytes.div_ceil(64 * steps.max(1)) }
    }

    /// One iteration's share of the lines.
    #[inline(always)]
    unsafe fn step(&mut self) {
        for _ in 0..self.per_step {
            if self.next >= self.end {
                return;
            }
            _mm_prefetch::<_MM_HINT_T1>(self.next);
            self.next = self.next.wrapping_add(64);
        }
    }
}

/// One online-softmax step of rows `set` (all reading block `b` from `src`, keys `a..e` of it):
/// scores for 8 rows at a time against each key tile, the softmax per row, then the weighted
/// values for a few rows at a time, each value row loaded once for all of them. Decode
/// (`next_keys` given) asks for this block's values while it computes the scores, and for
/// `next_keys` while it weighs the values.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn block<const NV: usize>(
    rows: &Rows,
    b: usize,
    (src, a, e): (Source, usize, usize),
    set: &[usize],
    scratch: &mut Scratch,
    st: &mut SegState,
    vnni: bool,
    next_keys: Option<Region>,
) {
    if let (Source::Store, KvStore::Int8 { .. }) = (src, rows.kv.store) {
        let args = (rows, b, (a, e), set, scratch, st);
        return if vnni { int8::block_vnni::<NV>(args) } else { int8::block_madd::<NV>(args) };
    }
    let d = NV * 16;
    let bs = rows.kv.block_size;
    let stride = bs.next_multiple_of(KEY_TILE);
    let Scratch { scores, w, qs, kt, vt, .. } = scratch;
    for (i, &r) in set.iter().enumerate() {
        qs[i * d..(i + 1) * d].copy_from_slice(&rows.q[r * d..(r + 1) * d]);
    }
    let qbase = qs.as_ptr();
    let (j0, j1) = (a / KEY_TILE, (e - 1) / KEY_TILE + 1);
    // Decode (a few rows, whole tiles): keys and values converted as they are used, no scratch.
    let fused = set.len() <= SCORE_ROWS && bs.is_multiple_of(KEY_TILE);
    let at = rows.store_head(b) * bs * d;
    // Scores, `[row][position in block]`.
    if fused {
        let values = match src {
            Source::Store if next_keys.is_some() => rows.kv.regions(rows.store_head(b), (a, e)).1,
            _ => Region::NONE,
        };
        let args = (qbase, j0, j1, scores.as_mut_ptr(), stride, bs, Ahead::new(values, j1 - j0));
        match (src, rows.kv.store) {
            (Source::Store, KvStore::F32 { k, .. }) => scores_fused::<NV, F32s>(set.len(), args, k.as_ptr().add(at)),
            (Source::Store, KvStore::Bf16 { k, .. }) => scores_fused::<NV, Bf16s>(set.len(), args, k.as_ptr().add(at)),
            _ => scores_fused::<NV, F32s>(set.len(), args, rows.exact(b).0.as_ptr()),
        }
    } else {
        for j in j0..j1 {
            let t0 = j * KEY_TILE;
            let len = KEY_TILE.min(bs - t0);
            let (kp, ks) = key_tile::<NV>(rows, src, b, t0, len, kt);
            let kmask = lanes(0, len);
            for (g, group) in set.chunks(SCORE_ROWS).enumerate() {
                let i0 = g * SCORE_ROWS;
                let (q, out) = (qbase.add(i0 * d), scores.as_mut_ptr().add(i0 * stride + t0));
                let args = (q, kp, ks, kmask, out, stride);
                match group.len() {
                    1 => score_rows::<NV, 1>(args),
                    2 => score_rows::<NV, 2>(args),
                    3 => score_rows::<NV, 3>(args),
                    4 => score_rows::<NV, 4>(args),
                    5 => score_rows::<NV, 5>(args),
                    6 => score_rows::<NV, 6>(args),
                    7 => score_rows::<NV, 7>(args),
                    _ => score_rows::<NV, 8>(args),
                }
            }
        }
    }
    softmax_rows::<NV>(set, scores, w, None, (a, e), stride, st);
    // Weighted values: a few rows' outputs in registers, each value row loaded once for them.
    if fused {
        let passes = NV / columns(NV, set.len());
        let args = (
            set,
            &mut st.o[..],
            w.as_ptr(),
            stride,
            a,
            e,
            Ahead::new(next_keys.unwrap_or(Region::NONE), (e - a) * passes),
        );
        match (src, rows.kv.store) {
            (Source::Store, KvStore::F32 { v, .. }) => values_fused::<NV, F32s>(set.len(), args, v.as_ptr().add(at)),
            (Source::Store, KvStore::Bf16 { v, .. }) => values_fused::<NV, Bf16s>(set.len(), args, v.as_ptr().add(at)),
            _ => values_fused::<NV, F32s>(set.len(), args, rows.exact(b).1.as_ptr()),
        }
        return;
    }
    let rp = (16 / NV).clamp(1, 8);
    for j in j0..j1 {
        let t0 = j * KEY_TILE;
        let len = KEY_TILE.min(bs - t0);
        let vp = value_tile::<NV>(rows, src, b, t0, len, vt);
        let (ta, te) = (a.max(t0) - t0, e.min(t0 + len) - t0);
        for (g, group) in set.chunks(rp).enumerate() {
            let args = (group, &mut st.o[..], w.as_ptr().add(g * rp * stride + t0), stride, vp, ta, te);
            match group.len() {
                1 => weigh_values::<NV, 1>(args),
                2 => weigh_values::<NV, 2>(args),
                3 if NV <= 4 => weigh_values::<NV, 3>(args),
                4 if NV <= 4 => weigh_values::<NV, 4>(args),
                5 if NV <= 2 => weigh_values::<NV, 5>(args),
                6 if NV <= 2 => weigh_values::<NV, 6>(args),
                7 if NV <= 2 => weigh_values::<NV, 7>(args),
                8 if NV <= 2 => weigh_values::<NV, 8>(args),
                _ => unreachable!("value groups hold at most 16 vectors"),
            }
        }
    }
}

/// Lanes `a..e` of tile `j` of a block (only the first and last tiles of `a..e` can be partial).
#[inline(always)]
pub(super) fn tile_lanes(j: usize, a: usize, e: usize) -> __mmask16 {
    let t0 = j * KEY_TILE;
    if t0 >= a && t0 + KEY_TILE <= e {
        return !0;
    }
    lanes(a.max(t0) - t0, e.min(t0 + KEY_TILE) - t0)
}

/// The online-softmax step of each row of `set` over its scores (`[row][stride]`, live keys
/// `a..e`): the block's maximum, one rescale of what came before, the probabilities summed, and
/// the weights left in `w` (probabilities, times each value's scale `vs` for int8).
#[inline(always)]
pub(super) unsafe fn softmax_rows<const NV: usize>(
    set: &[usize],
    scores: &[f32],
    w: &mut [f32],
    vs: Option<&[f32]>,
    (a, e): (usize, usize),
    stride: usize,
    st: &mut SegState,
) {
    let d = NV * 16;
    let (j0, j1) = (a / KEY_TILE, (e - 1) / KEY_TILE + 1);
    let d16 = |x: usize| x * KEY_TILE;
    for (i, &r) in set.iter().enumerate() {
        let srow = scores.as_ptr().add(i * stride);
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        for j in j0..j1 {
            let s = _mm512_loadu_ps(srow.add(d16(j)));
            mx = _mm512_mask_max_ps(mx, tile_lanes(j, a, e), mx, s);
        }
        let block_max = _mm512_reduce_max_ps(mx);
        let new_max = st.m[r].max(block_max);
        let correction = super::exp_fma(st.m[r] - new_max);
        let m = _mm512_set1_ps(new_max);
        let mut acc = _mm512_setzero_ps();
        let wrow = w.as_mut_ptr().add(i * stride);
        for j in j0..j1 {
            let s = _mm512_loadu_ps(srow.add(d16(j)));
            let p = _mm512_maskz_mov_ps(tile_lanes(j, a, e), exp16_fma(_mm512_sub_ps(s, m)));
            acc = _mm512_add_ps(acc, p);
            let wv = match vs {
                Some(vs) => _mm512_mul_ps(p, _mm512_loadu_ps(vs.as_ptr().add(d16(j)))),
                None => p,
            };
            _mm512_storeu_ps(wrow.add(d16(j)), wv);
        }
        st.l[r] = st.l[r].mul_add(correction, tree_sum(acc));
        st.m[r] = new_max;
        st.touched[r] = true;
        if correction != 1.0 {
            let cv = _mm512_set1_ps(correction);
            let op = st.o.as_mut_ptr().add(r * d);
            for v in 0..NV {
                _mm512_storeu_ps(op.add(16 * v), _mm512_mul_ps(_mm512_loadu_ps(op.add(16 * v)), cv));
            }
        }
    }
}

/// Ask for every cache line of block `b`'s keys, values and statistics (this task's head).
#[inline(always)]
unsafe fn prefetch_block(rows: &Rows, b: usize) {
    unsafe fn lines<T>(s: &[T], start: usize, len: usize) {
        let p = s.as_ptr().add(start).cast::<i8>();
        for off in (0..len * std::mem::size_of::<T>()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.add(off));
        }
    }
    let (d, bs) = (rows.d, rows.kv.block_size);
    let (head, n) = (rows.store_head(b), rows.d * rows.kv.block_size);
    match rows.kv.store {
        KvStore::F32 { k, v } => (lines(k, head * n, n), lines(v, head * n, n)),
        KvStore::Bf16 { k, v } => (lines(k, head * n, n), lines(v, head * n, n)),
        KvStore::Int8 { k, k_min, k_scale, v, v_scale } => {
            lines(k, head * n, n);
            lines(v, head * n, n);
            lines(k_min, head * d, d);
            lines(k_scale, head * d, d);
            (lines(v_scale, head * bs, bs), ())
        }
    };
}

/// How a stored element type becomes 16 f32 lanes.
trait Lanes {
    type T;
    /// 16 consecutive elements at `p` as f32 (exactly).
    unsafe fn load16(p: *const Self::T) -> __m512;
}

struct F32s;
struct Bf16s;

impl Lanes for F32s {
    type T = f32;
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Lanes for Bf16s {
    type T = u16;
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> __m512 {
        widen_bf16(_mm256_loadu_si256(p.cast()))
    }
}

/// Arguments of [`scores_fused`]: queries, tiles `j0..j1`, scores out, row stride, block size.
type ScoreArgs = (*const f32, usize, usize, *mut f32, usize, usize, Ahead);

#[inline(always)]
unsafe fn scores_fused<const NV: usize, K: Lanes>(g: usize, args: ScoreArgs, k: *const K::T) {
    match g {
        1 => scores_rows::<NV, 1, K>(args, k),
        2 => scores_rows::<NV, 2, K>(args, k),
        3 => scores_rows::<NV, 3, K>(args, k),
        4 => scores_rows::<NV, 4, K>(args, k),
        5 => scores_rows::<NV, 5, K>(args, k),
        6 => scores_rows::<NV, 6, K>(args, k),
        7 => scores_rows::<NV, 7, K>(args, k),
        _ => scores_rows::<NV, 8, K>(args, k),
    }
}

/// [`score_rows`] for `G` rows over whole key tiles `j0..j1` of a block whose keys (`[d][bs]`)
/// start at `k`, each channel's 16 keys converted once for all the rows.
#[inline(always)]
unsafe fn scores_rows<const NV: usize, const G: usize, K: Lanes>(
    (q, j0, j1, out, stride, bs, mut ahead): ScoreArgs,
    k: *const K::T,
) {
    let d = NV * 16;
    for j in j0..j1 {
        ahead.step();
        let t0 = j * KEY_TILE;
        let mut a0 = [_mm512_setzero_ps(); G];
        let mut a1 = [_mm512_setzero_ps(); G];
        for c in (0..d).step_by(2) {
            let k0 = K::load16(k.add(c * bs + t0));
            let k1 = K::load16(k.add((c + 1) * bs + t0));
            for i in 0..G {
                let qi = q.add(i * d + c);
                a0[i] = _mm512_fmadd_ps(_mm512_set1_ps(*qi), k0, a0[i]);
                a1[i] = _mm512_fmadd_ps(_mm512_set1_ps(*qi.add(1)), k1, a1[i]);
            }
        }
        for i in 0..G {
            _mm512_storeu_ps(out.add(i * stride + t0), _mm512_add_ps(a0[i], a1[i]));
        }
    }
}

/// Arguments of [`values_fused`]: rows, outputs, weights, their row stride, live keys `a..e`.
type ValueArgs<'a> = (&'a [usize], &'a mut [f32], *const f32, usize, usize, usize, Ahead);

#[inline(always)]
unsafe fn values_fused<const NV: usize, V: Lanes>(g: usize, args: ValueArgs, v: *const V::T) {
    match g {
        1 => values_rows::<NV, 1, V>(args, v),
        2 => values_rows::<NV, 2, V>(args, v),
        3 => values_rows::<NV, 3, V>(args, v),
        4 => values_rows::<NV, 4, V>(args, v),
        5 => values_rows::<NV, 5, V>(args, v),
        6 => values_rows::<NV, 6, V>(args, v),
        7 => values_rows::<NV, 7, V>(args, v),
        _ => values_rows::<NV, 8, V>(args, v),
    }
}

/// Vectors of an output a pass of [`values_rows`] keeps for each of `g` rows: as many as fit 24
/// registers, a divisor of the head's `nv`.
pub(super) const fn columns(nv: usize, g: usize) -> usize {
    let mut c = nv;
    while c > 1 && (c * g > 24 || !nv.is_multiple_of(c)) {
        c -= 1;
    }
    c
}

/// `o += w·V` for `G` rows over the block's live keys `a..e` (values `[bs][d]` from `v`): the
/// outputs in registers a few vectors at a time, each value vector converted once for all rows.
#[inline(always)]
unsafe fn values_rows<const NV: usize, const G: usize, V: Lanes>(
    (set, o, w, stride, a, e, mut ahead): ValueArgs,
    v: *const V::T,
) {
    let d = NV * 16;
    let cols = columns(NV, G);
    for c0 in (0..NV).step_by(cols) {
        let mut acc = [[_mm512_setzero_ps(); 8]; G];
        for (i, &r) in set.iter().enumerate().take(G) {
            for c in 0..cols {
                acc[i][c] = _mm512_loadu_ps(o.as_ptr().add(r * d + 16 * (c0 + c)));
            }
        }
        for t in a..e {
            ahead.step();
            let mut vv = [_mm512_setzero_ps(); 8];
            for c in 0..cols {
                vv[c] = V::load16(v.add(t * d + 16 * (c0 + c)));
            }
            for i in 0..G {
                let wt = _mm512_set1_ps(*w.add(i * stride + t));
                for c in 0..cols {
                    acc[i][c] = _mm512_fmadd_ps(wt, vv[c], acc[i][c]);
                }
            }
        }
        for (i, &r) in set.iter().enumerate().take(G) {
            for c in 0..cols {
                _mm512_storeu_ps(o.as_mut_ptr().add(r * d + 16 * (c0 + c)), acc[i][c]);
            }
        }
    }
}

/// Scores of `G` rows (queries at `q`, `d` apart) against one key tile (channel `c` at `kp +
/// c·ks`, lanes `kmask` valid), stored to `out` (rows `stride` apart).
#[inline(always)]
unsafe fn score_rows<const NV: usize, const G: usize>(
    (q, kp, ks, kmask, out, stride): (*const f32, *const f32, usize, __mmask16, *mut f32, usize),
) {
    let d = NV * 16;
    let mut a0 = [_mm512_setzero_ps(); G];
    let mut a1 = [_mm512_setzero_ps(); G];
    for c in (0..d).step_by(2) {
        let k0 = _mm512_maskz_loadu_ps(kmask, kp.add(c * ks));
        let k1 = _mm512_maskz_loadu_ps(kmask, kp.add((c + 1) * ks));
        for i in 0..G {
            let qi = q.add(i * d + c);
            a0[i] = _mm512_fmadd_ps(_mm512_set1_ps(*qi), k0, a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_set1_ps(*qi.add(1)), k1, a1[i]);
        }
    }
    for i in 0..G {
        _mm512_storeu_ps(out.add(i * stride), _mm512_add_ps(a0[i], a1[i]));
    }
}

/// `o += w·V` for `G` rows over the tile's live tokens `ta..te`: their outputs in registers,
/// each value row (`vp`, rows of `d`) loaded once for all of them.
#[allow(clippy::type_complexity)]
#[inline(always)]
unsafe fn weigh_values<const NV: usize, const G: usize>(
    (group, o, w, stride, vp, ta, te): (&[usize], &mut [f32], *const f32, usize, *const f32, usize, usize),
) {
    let d = NV * 16;
    let mut acc = [[_mm512_setzero_ps(); NV]; G];
    for (i, &r) in group.iter().enumerate().take(G) {
        for v in 0..NV {
            acc[i][v] = _mm512_loadu_ps(o.as_ptr().add(r * d + 16 * v));
        }
    }
    for t in ta..te {
        let vrow = vp.add(t * d);
        let mut vv = [_mm512_setzero_ps(); NV];
        for v in 0..NV {
            vv[v] = _mm512_loadu_ps(vrow.add(16 * v));
        }
        for i in 0..G {
            let wt = _mm512_set1_ps(*w.add(i * stride + t));
            for v in 0..NV {
                acc[i][v] = _mm512_fmadd_ps(wt, vv[v], acc[i][v]);
            }
        }
    }
    for (i, &r) in group.iter().enumerate().take(G) {
        for v in 0..NV {
            _mm512_storeu_ps(o.as_mut_ptr().add(r * d + 16 * v), acc[i][v]);
        }
    }
}

/// Keys `t0..t0 + len` of block `b` as f32 `[d][16]`: (pointer, channel stride). f32 tiles are
/// read in place; bf16 ones are converted into `kt`.
#[inline(always)]
unsafe fn key_tile<const NV: usize>(
    rows: &Rows,
    src: Source,
    b: usize,
    t0: usize,
    len: usize,
    kt: &mut [f32; 128 * KEY_TILE],
) -> (*const f32, usize) {
    let (d, bs) = (NV * 16, rows.kv.block_size);
    let at = rows.store_head(b) * bs * d;
    match (src, rows.kv.store) {
        (Source::Exact, _) => (rows.exact(b).0.as_ptr().add(t0), bs),
        (Source::Store, KvStore::F32 { k, .. }) => (k.as_ptr().add(at + t0), bs),
        (Source::Store, KvStore::Bf16 { k, .. }) => {
            for c in 0..d {
                let src = &k[at + c * bs + t0..];
                let x = if len == KEY_TILE {
                    _mm256_loadu_si256(src.as_ptr().cast())
                } else {
                    _mm256_loadu_si256(load_tile_len::<u16>(src, len).as_ptr().cast())
                };
                _mm512_storeu_ps(kt.as_mut_ptr().add(c * KEY_TILE), widen_bf16(x));
            }
            (kt.as_ptr(), KEY_TILE)
        }
        // Never asked for: stored int8 blocks are read as codes (`block_int8`).
        (Source::Store, KvStore::Int8 { .. }) => (rows.exact(b).0.as_ptr().add(t0), bs),
    }
}

/// Values `t0..t0 + len` of block `b` as f32 rows of `d`: in place for f32, bf16 converted into
/// `vt`.
#[inline(always)]
unsafe fn value_tile<const NV: usize>(
    rows: &Rows,
    src: Source,
    b: usize,
    t0: usize,
    len: usize,
    vt: &mut [f32; KEY_TILE * 128],
) -> *const f32 {
    let (d, bs) = (NV * 16, rows.kv.block_size);
    let at = rows.store_head(b) * bs * d;
    match (src, rows.kv.store) {
        (Source::Exact, _) => rows.exact(b).1.as_ptr().add(t0 * d),
        (Source::Store, KvStore::F32 { v, .. }) => v.as_ptr().add(at + t0 * d),
        (Source::Store, KvStore::Bf16 { v, .. }) => {
            for t in 0..len {
                let row = v.as_ptr().add(at + (t0 + t) * d);
                for i in 0..NV {
                    let x = _mm256_loadu_si256(row.add(16 * i).cast());
                    _mm512_storeu_ps(vt.as_mut_ptr().add(t * d + 16 * i), widen_bf16(x));
                }
            }
            vt.as_ptr()
        }
        // Never asked for, as in `key_tile`.
        (Source::Store, KvStore::Int8 { .. }) => rows.exact(b).1.as_ptr().add(t0 * d),
    }
}

/// 16 bf16 values as f32 (exact).
#[inline(always)]
unsafe fn widen_bf16(x: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16))
}
