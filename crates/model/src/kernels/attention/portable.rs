//! The reference arithmetic of [`super`]'s attention, row by row, in the order every path
//! follows: per block the scores of each key tile, the block's maximum, one rescale, the
//! probabilities and the weighted values. It is also the path for CPUs without AVX-512, compiled
//! for AVX2 and FMA where the CPU has them. The exponentials and the lane-sum order that every
//! path shares live here too.

use super::{int8, KvStore, Rows, SegState, Source, KEY_TILE};
use crate::kernels::kv_quant::{from_bf16, scale};

/// The reference: each row on its own, in the order every path follows. Also the path for CPUs
/// without AVX-512 (compiled for AVX2 and FMA where the CPU has them, which vectorises the
/// 16-lane loops).
pub(super) struct Portable;

impl Portable {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn segment_avx2(rows: &Rows, b0: usize, b1: usize, st: &mut SegState) {
        Self::segment(rows, b0, b1, st)
    }

    /// Blocks in the outer loop and rows in the inner one: a block's f32 key tiles and values are
    /// loaded once for every row that reads them (a prefill chunk's rows, times the query heads
    /// sharing the KV head), not once per row. Each row still sees its blocks in order with its
    /// own state, so its arithmetic is the same as row by row.
    #[inline(always)]
    pub(super) fn segment(rows: &Rows, b0: usize, b1: usize, st: &mut SegState) {
        let (d, bs) = (rows.d, rows.kv.block_size);
        let tiles_per_block = bs.div_ceil(KEY_TILE);
        // Key tile j of the current block at `kts[j·d·16..]` (`[d][16]`), its values at
        // `values[t·d..]`, and which source each tile was loaded from.
        let mut kts = vec![0f32; tiles_per_block * d * KEY_TILE];
        let mut vt = vec![0f32; KEY_TILE * d];
        let mut loaded: Vec<Option<Source>> = vec![None; tiles_per_block];
        let (mut scores, mut w, mut vs) = (vec![0f32; bs], vec![0f32; bs], vec![1f32; bs]);
        let mut values = vec![0f32; bs * d];
        let (mut q8, mut w16) = (vec![0i8; d], vec![0i16; bs]);
        for b in b0..b1 {
            loaded.fill(None);
            for r in 0..rows.rows.len() {
                let Some(src) = rows.source(r, b) else { continue };
                let (a, e) = rows.live(r, b * bs, bs);
                if a >= e {
                    continue;
                }
                let (a, e) = (a - b * bs, e - b * bs);
                let q = &rows.q[r * d..][..d];
                let tiles = a / KEY_TILE..(e - 1) / KEY_TILE + 1;
                match (src, rows.kv.store) {
                    // Int8 keys and values: integer sums over the codes (see `int8`).
                    (Source::Store, KvStore::Int8 { k, k_min, k_scale, v, v_scale }) => {
                        let head = rows.store_head(b);
                        let side = int8::quantize_query(q, &k_min[head * d..][..d], &k_scale[head * d..][..d], &mut q8);
                        let codes = &k[head * d * bs..][..d * bs];
                        let (t0, t1) = (tiles.start * KEY_TILE, (tiles.end * KEY_TILE).min(bs));
                        for (t, s) in scores.iter_mut().enumerate().take(t1).skip(t0) {
                            *s = int8::score(&q8, codes, bs, t, side);
                        }
                        for (t, x) in vs.iter_mut().enumerate().take(e).skip(a) {
                            *x = scale(v_scale[head * bs + t]);
                        }
                        Self::softmax(&scores, Some(&vs), &mut w, tiles, a, e, bs, d, r, st);
                        let step = int8::quantize_weights(&w, a, e, &mut w16);
                        let o = &mut st.o[r * d..][..d];
                        int8::weigh_values(&w16, a, e, &v[head * bs * d..][..bs * d], step, o);
                    }
                    _ => {
                        for j in tiles.clone() {
                            let t0 = j * KEY_TILE;
                            let len = KEY_TILE.min(bs - t0);
                            let kt = &mut kts[j * d * KEY_TILE..][..d * KEY_TILE];
                            if loaded[j] != Some(src) {
                                load_tile(rows, src, b, t0, len, kt, &mut vt);
                                values[t0 * d..(t0 + len) * d].copy_from_slice(&vt[..len * d]);
                                loaded[j] = Some(src);
                            }
                            let s = Self::scores(q, kt, d);
                            scores[t0..t0 + len].copy_from_slice(&s[..len]);
                        }
                        Self::softmax(&scores, None, &mut w, tiles, a, e, bs, d, r, st);
                        let o = &mut st.o[r * d..][..d];
                        for t in a..e {
                            for (x, &v) in o.iter_mut().zip(&values[t * d..][..d]) {
                                *x = w[t].mul_add(v, *x);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The 16 scores of one key tile: channel c goes to partial sum c mod 2, each a chain of
    /// fused multiply-adds; then the two added.
    #[inline(always)]
    fn scores(qs: &[f32], kt: &[f32], d: usize) -> [f32; KEY_TILE] {
        let (mut a0, mut a1) = ([0f32; KEY_TILE], [0f32; KEY_TILE]);
        for c in 0..d {
            let acc = if c % 2 == 0 { &mut a0 } else { &mut a1 };
            let krow = &kt[c * KEY_TILE..][..KEY_TILE];
            for t in 0..KEY_TILE {
                acc[t] = qs[c].mul_add(krow[t], acc[t]);
            }
        }
        let mut s = [0f32; KEY_TILE];
        for t in 0..KEY_TILE {
            s[t] = a0[t] + a1[t];
        }
        s
    }

    /// One row's online-softmax step over the live keys `a..e` of one block (positions within
    /// it; `tiles` the key tiles they span): the block's maximum, one rescale of what came before,
    /// the probabilities summed lane-wise over the tiles then as [`tree_sum`]. Leaves the weights
    /// (probabilities, times each value's scale for int8) in `w` for the caller to weigh the
    /// values with.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn softmax(
        scores: &[f32],
        vscale: Option<&[f32]>,
        w: &mut [f32],
        tiles: std::ops::Range<usize>,
        a: usize,
        e: usize,
        bs: usize,
        d: usize,
        r: usize,
        st: &mut SegState,
    ) {
        let block_max = scores[a..e].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let new_max = st.m[r].max(block_max);
        let correction = exp_fma(st.m[r] - new_max);
        let mut acc = [0f32; KEY_TILE];
        for j in tiles {
            for (i, x) in acc.iter_mut().enumerate() {
                let t = j * KEY_TILE + i;
                let p = if (a..e).contains(&t) { exp_fma(scores[t] - new_max) } else { 0.0 };
                *x += p;
                if t < bs {
                    w[t] = match vscale {
                        Some(vs) => p * vs[t],
                        None => p,
                    };
                }
            }
        }
        st.l[r] = st.l[r].mul_add(correction, tree_sum(&acc));
        st.m[r] = new_max;
        st.touched[r] = true;
        let o = &mut st.o[r * d..][..d];
        if correction != 1.0 {
            o.iter_mut().for_each(|x| *x *= correction);
        }
    }
}

/// Key tile `t0..t0 + len` of block `b` of an f32 or bf16 store, or of an exact block, as f32
/// (`kt`: `[d][16]`, `vt`: `[16][d]`; lanes past `len` are zero). Int8 blocks are read as codes
/// (see [`super::int8`]).
pub(in crate::kernels) fn load_tile(
    rows: &Rows,
    src: Source,
    b: usize,
    t0: usize,
    len: usize,
    kt: &mut [f32],
    vt: &mut [f32],
) {
    let (d, bs) = (rows.d, rows.kv.block_size);
    kt.fill(0.0);
    vt.fill(0.0);
    let at = rows.store_head(b) * bs * d;
    // Generic, not `dyn`: each element is a load (and a widening for bf16), not an indirect call.
    #[inline(always)]
    fn fill<K: Copy, V: Copy>(
        (kt, vt): (&mut [f32], &mut [f32]),
        (k, v): (&[K], &[V]),
        (d, bs, t0, len): (usize, usize, usize, usize),
        kf: impl Fn(K) -> f32,
        vf: impl Fn(V) -> f32,
    ) {
        for c in 0..d {
            let src = &k[c * bs + t0..][..len];
            for (dst, &x) in kt[c * KEY_TILE..][..len].iter_mut().zip(src) {
                *dst = kf(x);
            }
        }
        for (dst, &x) in vt[..len * d].iter_mut().zip(&v[t0 * d..][..len * d]) {
            *dst = vf(x);
        }
    }
    let geometry = (d, bs, t0, len);
    match (src, rows.kv.store) {
        (Source::Exact, _) => {
            let (k, v) = rows.exact(b);
            fill((kt, vt), (k, v), geometry, |x| x, |x| x);
        }
        // Never asked for: stored int8 blocks are read as codes.
        (Source::Store, KvStore::Int8 { .. }) => debug_assert!(false, "int8 codes are not loaded as f32 tiles"),
        (Source::Store, KvStore::F32 { k, v }) => {
            fill((kt, vt), (&k[at..][..d * bs], &v[at..][..bs * d]), geometry, |x| x, |x| x)
        }
        (Source::Store, KvStore::Bf16 { k, v }) => {
            fill((kt, vt), (&k[at..][..d * bs], &v[at..][..bs * d]), geometry, from_bf16, from_bf16)
        }
    }
}

/// The first `len` (≤ 16) elements of `s`, zero-padded to a tile.
#[inline(always)]
pub(in crate::kernels) fn load_tile_len<T: Copy + Default>(s: &[T], len: usize) -> [T; KEY_TILE] {
    let mut a = [T::default(); KEY_TILE];
    a[..len].copy_from_slice(&s[..len]);
    a
}

#[cfg(test)]
/// Σ a[c]·b[c] as 16 lane-wise fused chains (channel c in lane c mod 16), then [`tree_sum`].
#[inline(always)]
pub(in crate::kernels) fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; KEY_TILE];
    for (c, (&x, &y)) in a.iter().zip(b).enumerate() {
        acc[c % KEY_TILE] = x.mul_add(y, acc[c % KEY_TILE]);
    }
    tree_sum(&acc)
}

/// The sum of 16 lanes as a vector reduction does it: halves added pairwise, 8 + 8, 4 + 4, 2 + 2, 1 + 1.
#[inline(always)]
pub(in crate::kernels) fn tree_sum(p: &[f32; KEY_TILE]) -> f32 {
    let mut h = [0f32; 8];
    for i in 0..8 {
        h[i] = p[i] + p[i + 8];
    }
    let g = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    let f = [g[0] + g[2], g[1] + g[3]];
    f[0] + f[1]
}

/// `e^x` for the softmax (x ≤ 0) with fused multiply-adds, half the operations of [`exp`]: x =
/// k·ln2 + r (k rounded to nearest even), a degree-6 polynomial for e^r in Horner form, then
/// p·2^k. Each step is one IEEE operation that AVX-512 has as one instruction (`vroundscaleps`,
/// `vfnmadd`, `vfmadd`, `vscalefps`), so every path gives the same bits. Relative error below
/// 3e-7; arguments under −87 give e^−87.
#[inline(always)]
pub(in crate::kernels) fn exp_fma(x: f32) -> f32 {
    let x = x.clamp(-87.0, 0.0);
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-k).mul_add(LN2_LO, (-k).mul_add(LN2_HI, x));
    let mut p = (1.0 / 720.0f32).mul_add(r, 1.0 / 120.0);
    for c in [1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    // k ∈ −126..=0: 2^k is a normal f32, so this is the exact scaling `vscalefps` does.
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// ln 2 split in two: `k·LN2_HI` is exact for the k of [`exp_fma`].
pub(super) const LN2_HI: f32 = 0.693_145_75;
pub(super) const LN2_LO: f32 = 1.428_606_8e-6;

/// `e^x` for the softmax's arguments (x ≤ 0), in plain arithmetic that vectorises and gives the
/// same bits on every CPU: x = k·ln2 + r with |r| ≤ ln2/2, a degree-6 polynomial for e^r, and k
/// put into the exponent. Relative error below 3e-7; arguments under −87 give e^−87 ≈ 1.6e−38,
/// nothing next to the block maximum's 1.
#[inline(always)]
pub(in crate::kernels) fn exp(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // No branches, so the loops calling it vectorise; NaN passes through the clamp and the
    // polynomial and comes out NaN.
    let x = x.clamp(-87.0, 0.0);
    let k = (x * LOG2E + MAGIC) - MAGIC;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let bits = ((k as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}
