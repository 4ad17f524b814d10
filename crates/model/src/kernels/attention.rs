//! Causal attention that reads keys and values where they live: in fixed-size blocks of a paged
//! pool, found through each sequence's block table. Nothing is gathered into a contiguous copy.
//!
//! One task handles a run of up to [`QUERY_TILE`] query tokens of one sequence against one KV
//! head, for all the query heads that share that KV head (grouped-query attention without
//! repeating K/V). Softmax is online, one key block at a time. Every query row's result depends
//! only on its own query vector and the keys and values at positions `0..=pos`, visited in
//! position order in blocks of `block_size` positions — never on the batch, the prefill chunking
//! or which physical blocks hold the data, so batching cannot change a request's tokens.

use std::sync::OnceLock;

use super::pool;

/// Query tokens per task: enough tasks for the threads on one long prompt, few per decode.
const QUERY_TILE: usize = 16;

/// The paged pool of one layer: K as `[num_blocks][kv_heads][head_dim][block_size]` (transposed,
/// so a block's 16 scores are 16-wide multiply-adds over the head dimension with no per-step
/// transpose) and V as `[num_blocks][kv_heads][block_size][head_dim]`.
pub struct PagedLayer<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One sequence's share of the batch: its new query rows start at `row`, the first sits at
/// position `context_len`; `blocks` maps position `p` to block `blocks[p / block_size]`.
pub struct SeqView<'a> {
    pub row: usize,
    pub context_len: usize,
    pub num_tokens: usize,
    pub blocks: &'a [u32],
}

/// `q`: `[N, q_heads, head_dim]` (all sequences' new tokens). Writes `out`: `[N, q_heads·head_dim]`.
/// The keys and values of the new tokens must already be in the pool.
pub fn paged_attention(
    q: &[f32],
    q_heads: usize,
    seqs: &[SeqView],
    kv: &PagedLayer,
    window: Option<usize>,
    out: &mut [f32],
) {
    let (d, hkv) = (kv.head_dim, kv.kv_heads);
    let g = q_heads / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let mut tasks = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        for h in 0..hkv {
            for t0 in (0..seq.num_tokens).step_by(QUERY_TILE) {
                tasks.push((s, h, t0, (t0 + QUERY_TILE).min(seq.num_tokens)));
            }
        }
    }
    let compute = |i: usize| {
        let (s, h, t0, t1) = tasks[i];
        let task = Task { q, q_heads, seq: &seqs[s], kv, h, t0, t1, window, scale };
        #[cfg(target_arch = "x86_64")]
        if super::has_avx512() {
            // SAFETY: AVX-512F was just detected.
            return unsafe { task.run_avx512() };
        }
        task.run()
    };
    let results: Vec<OnceLock<Vec<f32>>> = tasks.iter().map(|_| OnceLock::new()).collect();
    pool::run(tasks.len(), |i| {
        let _ = results[i].set(compute(i));
    });
    for (i, (&(s, h, t0, t1), res)) in tasks.iter().zip(results).enumerate() {
        // `run` runs every task, so each result is there; recomputing is the fallback.
        let res = res.into_inner().unwrap_or_else(|| compute(i));
        let row0 = seqs[s].row;
        for t in t0..t1 {
            let src = &res[(t - t0) * g * d..][..g * d];
            out[((row0 + t) * q_heads + h * g) * d..][..g * d].copy_from_slice(src);
        }
    }
}

/// One task: query tokens `t0..t1` of one sequence, all query heads of KV head `h`.
struct Task<'a> {
    q: &'a [f32],
    q_heads: usize,
    seq: &'a SeqView<'a>,
    kv: &'a PagedLayer<'a>,
    h: usize,
    t0: usize,
    t1: usize,
    window: Option<usize>,
    scale: f32,
}

impl Task<'_> {
    /// The same body compiled for AVX-512: plain IEEE arithmetic (Rust never contracts into FMA),
    /// so the bits are those of [`run`](Self::run), only wider vectors.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self) -> Vec<f32> {
        self.body::<true>()
    }

    fn run(&self) -> Vec<f32> {
        self.body::<false>()
    }

    /// An online softmax per query row over the (transposed) key blocks.
    #[inline(always)]
    fn body<const AVX512: bool>(&self) -> Vec<f32> {
        let (kv, seq) = (self.kv, self.seq);
        let (bs, d, hkv) = (kv.block_size, kv.head_dim, kv.kv_heads);
        let g = self.q_heads / hkv;
        let mut res = vec![0f32; (self.t1 - self.t0) * g * d];
        let (mut scores, mut acc) = (vec![0f32; bs], vec![0f32; d]);
        for t in self.t0..self.t1 {
            let pos = seq.context_len + t;
            let lo = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            // The default block size and the usual head sizes have an explicit AVX-512 body, which
            // takes the query heads of this KV head together (up to `MAX_GROUP` at a time), so
            // each key/value block is read from memory once, not once per head. Everything else
            // takes the portable body. Both do the same arithmetic in the same order.
            #[cfg(target_arch = "x86_64")]
            if AVX512 && bs == 16 && (d == 64 || d == 128) {
                let q0 = ((seq.row + t) * self.q_heads + self.h * g) * d;
                let out = &mut res[(t - self.t0) * g * d..][..g * d];
                for j0 in (0..g).step_by(x86::MAX_GROUP) {
                    let heads = (g - j0).min(x86::MAX_GROUP);
                    let (q, o) = (&self.q[q0 + j0 * d..][..heads * d], &mut out[j0 * d..][..heads * d]);
                    // SAFETY: `AVX512` is only set by `run_avx512`, after detecting AVX-512F; `q`
                    // and `o` hold `heads` rows of `d`, and the block table covers `0..=pos`.
                    unsafe {
                        if d == 64 {
                            x86::attend_heads::<64>(self, heads, lo, pos, q, o)
                        } else {
                            x86::attend_heads::<128>(self, heads, lo, pos, q, o)
                        }
                    }
                }
                continue;
            }
            for j in 0..g {
                let qrow = &self.q[((seq.row + t) * self.q_heads + self.h * g + j) * d..][..d];
                let out = &mut res[((t - self.t0) * g + j) * d..][..d];
                self.attend_row(&mut acc, lo, pos, qrow, out, &mut scores);
            }
        }
        res
    }

    /// One query row against positions `lo..=pos`: online softmax over the key blocks in order,
    /// the weighted values summed into `acc`, the normalised result written to `out`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn attend_row(&self, acc: &mut [f32], lo: usize, pos: usize, qrow: &[f32], out: &mut [f32], scores: &mut [f32]) {
        let (kv, seq) = (self.kv, self.seq);
        let (bs, d, hkv) = (kv.block_size, kv.head_dim, kv.kv_heads);
        acc.fill(0.0);
        let (mut max, mut denom) = (f32::NEG_INFINITY, 0f32);
        for b in lo / bs..=pos / bs {
            let kb = &kv.k[(seq.blocks[b] as usize * hkv + self.h) * d * bs..][..d * bs];
            if bs == 16 {
                // The default block size: the 16 sums stay in registers.
                block_scores::<16>(qrow, kb, scores);
            } else {
                block_scores_any(qrow, kb, bs, scores);
            }
            let (first, last) = ((b * bs).max(lo), ((b + 1) * bs - 1).min(pos));
            let live = &mut scores[first - b * bs..=last - b * bs];
            let mut block_max = f32::NEG_INFINITY;
            for s in live.iter_mut() {
                *s *= self.scale;
                block_max = block_max.max(*s);
            }
            let new_max = max.max(block_max);
            // Rescale what was accumulated under the old maximum (0 on the first block).
            let correction = exp(max - new_max);
            if correction != 1.0 {
                denom *= correction;
                acc.iter_mut().for_each(|o| *o *= correction);
            }
            max = new_max;
            for s in live.iter_mut() {
                *s = exp(*s - max);
            }
            let vbase = (seq.blocks[b] as usize * hkv + self.h) * bs * d;
            for (i, &p) in live.iter().enumerate() {
                denom += p;
                let vrow = &kv.v[vbase + (first - b * bs + i) * d..][..d];
                for (o, &v) in acc.iter_mut().zip(vrow) {
                    *o += p * v;
                }
            }
        }
        let inv = 1.0 / denom;
        for (o, a) in out.iter_mut().zip(acc.iter()) {
            *o = a * inv;
        }
    }
}

/// Scores of one query against a transposed key block of `BS` slots: for each slot, the head
/// dimension summed in four interleaved partial sums (`dd mod 4`), then `(s0 + s1) + (s2 + s3)`
/// — four independent chains instead of one long one. Every path uses this order.
#[inline(always)]
fn block_scores<const BS: usize>(q: &[f32], kb: &[f32], out: &mut [f32]) {
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; BS], [0f32; BS], [0f32; BS], [0f32; BS]);
    let quads = q.len() / 4;
    for i in 0..quads {
        let kr = &kb[i * 4 * BS..(i + 1) * 4 * BS];
        let qs = &q[i * 4..i * 4 + 4];
        for k in 0..BS {
            a0[k] += qs[0] * kr[k];
            a1[k] += qs[1] * kr[BS + k];
            a2[k] += qs[2] * kr[2 * BS + k];
            a3[k] += qs[3] * kr[3 * BS + k];
        }
    }
    for dd in quads * 4..q.len() {
        let a = match dd % 4 {
            0 => &mut a0,
            1 => &mut a1,
            2 => &mut a2,
            _ => &mut a3,
        };
        for k in 0..BS {
            a[k] += q[dd] * kb[dd * BS + k];
        }
    }
    for k in 0..BS {
        out[k] = (a0[k] + a1[k]) + (a2[k] + a3[k]);
    }
}

/// [`block_scores`] for any block size, in the same order.
fn block_scores_any(q: &[f32], kb: &[f32], bs: usize, out: &mut [f32]) {
    for (k, o) in out.iter_mut().enumerate().take(bs) {
        let mut a = [0f32; 4];
        for (dd, &qd) in q.iter().enumerate() {
            a[dd % 4] += qd * kb[dd * bs + k];
        }
        *o = (a[0] + a[1]) + (a[2] + a[3]);
    }
}

/// `e^x` for the softmax's arguments (x ≤ 0), in plain arithmetic that vectorises and gives the
/// same bits on every CPU: x = k·ln2 + r with |r| ≤ ln2/2, a degree-6 polynomial for e^r, and k
/// put into the exponent. Relative error below 3e-7; arguments under −87 give e^−87 ≈ 1.6e−38,
/// nothing next to the block maximum's 1.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // No branches, so the loops calling it vectorise; NaN passes through the clamp and the
    // polynomial and comes out NaN.
    let x = x.clamp(-87.0, 0.0);
    let k = (x * LOG2E + MAGIC) - MAGIC;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let bits = ((k as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // index loops mirror the lanes and slots they stand for
mod x86 {
    use super::Task;
    use std::arch::x86_64::*;

    /// `e^x` on 16 lanes: [`super::exp`]'s operations, one for one.
    #[target_feature(enable = "avx512f")]
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

    /// The most query heads [`attend_heads`] takes at once (Qwen2 models have 5 to 8 per KV head).
    pub(super) const MAX_GROUP: usize = 8;

    /// [`Task::attend_row`] for 16-slot blocks, a head size `D` (64 or 128) and `g ≤ MAX_GROUP`
    /// query heads of one token that share a KV head, block by block: each head's arithmetic is
    /// exactly `attend_row`'s (scores in four partial-sum registers, a 16-lane exp, the output
    /// in `D / 16` registers), only interleaved with the others', so a key/value block is loaded
    /// once for all of them. Per-head state lives in small arrays.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn attend_heads<const D: usize>(
        task: &Task,
        g: usize,
        lo: usize,
        pos: usize,
        qrows: &[f32],
        out: &mut [f32],
    ) {
        const BS: usize = 16;
        let (kv, seq) = (task.kv, task.seq);
        let hkv = kv.kv_heads;
        let nv = D / 16;
        let mut acc = [[_mm512_setzero_ps(); 8]; MAX_GROUP];
        let (mut max, mut denom) = ([f32::NEG_INFINITY; MAX_GROUP], [0f32; MAX_GROUP]);
        let mut p = [0f32; BS];
        for b in lo / BS..=pos / BS {
            let blk = (seq.blocks[b] as usize * hkv + task.h) * BS * D;
            let (kb, vbase) = (kv.k.as_ptr().add(blk), kv.v.as_ptr().add(blk));
            let (first, last) = ((b * BS).max(lo) - b * BS, ((b + 1) * BS - 1).min(pos) - b * BS);
            let live: __mmask16 = ((1u32 << (last + 1)) - (1u32 << first)) as __mmask16;
            // The next block is somewhere else in the pool (the table is indirect, so the
            // hardware prefetcher cannot guess it): fetch it while this one is computed.
            if b < pos / BS {
                let next = (seq.blocks[b + 1] as usize * hkv + task.h) * BS * D;
                let (nk, nv_) = (kv.k.as_ptr().add(next) as *const i8, kv.v.as_ptr().add(next) as *const i8);
                for line in (0..BS * D * 4).step_by(64) {
                    _mm_prefetch(nk.add(line), _MM_HINT_T0);
                    _mm_prefetch(nv_.add(line), _MM_HINT_T0);
                }
            }
            for j in 0..g {
                let q = qrows.as_ptr().add(j * D);
                let mut s = [_mm512_setzero_ps(); 4];
                for dd in (0..D).step_by(4) {
                    for u in 0..4 {
                        let k = _mm512_loadu_ps(kb.add((dd + u) * BS));
                        s[u] = _mm512_add_ps(s[u], _mm512_mul_ps(_mm512_set1_ps(*q.add(dd + u)), k));
                    }
                }
                let sc = _mm512_mul_ps(
                    _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])),
                    _mm512_set1_ps(task.scale),
                );
                let block_max = _mm512_mask_reduce_max_ps(live, sc);
                let new_max = max[j].max(block_max);
                let correction = super::exp(max[j] - new_max);
                let mut a = [_mm512_setzero_ps(); 8];
                a[..nv].copy_from_slice(&acc[j][..nv]);
                if correction != 1.0 {
                    denom[j] *= correction;
                    let cv = _mm512_set1_ps(correction);
                    for c in 0..nv {
                        a[c] = _mm512_mul_ps(a[c], cv);
                    }
                }
                max[j] = new_max;
                _mm512_storeu_ps(p.as_mut_ptr(), exp16(_mm512_sub_ps(sc, _mm512_set1_ps(new_max))));
                for i in first..=last {
                    let pi = p[i];
                    denom[j] += pi;
                    let pv = _mm512_set1_ps(pi);
                    let vrow = vbase.add(i * D);
                    for c in 0..nv {
                        a[c] = _mm512_add_ps(a[c], _mm512_mul_ps(pv, _mm512_loadu_ps(vrow.add(c * 16))));
                    }
                }
                acc[j][..nv].copy_from_slice(&a[..nv]);
            }
        }
        for j in 0..g {
            let inv = _mm512_set1_ps(1.0 / denom[j]);
            for c in 0..nv {
                _mm512_storeu_ps(out.as_mut_ptr().add(j * D + c * 16), _mm512_mul_ps(acc[j][c], inv));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(7);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 20_000) as f32 / 5_000.0 - 2.0
            })
            .collect()
    }

    /// Every path (portable, AVX-512) against a plain f64 softmax, and against each other bit
    /// for bit, on scattered block tables, prefix + new tokens, with and without a window.
    #[test]
    fn paths_agree_bit_for_bit_and_match_a_plain_softmax() {
        // g = 3 takes the AVX-512 body in one pass over the heads, g = 9 in two (8 + 1).
        for (d, bs, g) in [(64, 16, 3), (128, 16, 3), (64, 16, 9), (128, 16, 9), (32, 16, 3), (64, 8, 3)] {
            for window in [None, Some(21)] {
                check(d, bs, g, window);
            }
        }
    }

    fn check(d: usize, bs: usize, g: usize, window: Option<usize>) {
        let (hkv, num_blocks) = (2, 12);
        let q_heads = hkv * g;
        let k = data(num_blocks * hkv * bs * d, 1);
        let v = data(num_blocks * hkv * bs * d, 2);
        let kv = PagedLayer { k: &k, v: &v, block_size: bs, kv_heads: hkv, head_dim: d };
        // Sequence 0: 5 cached + 30 new tokens over blocks in scrambled order; sequence 1: decode.
        let t0: Vec<u32> = vec![7, 2, 9, 0, 11, 4];
        let t1: Vec<u32> = vec![5, 3, 10];
        let seqs = [
            SeqView { row: 0, context_len: 5, num_tokens: 30, blocks: &t0 },
            SeqView { row: 30, context_len: 2 * bs + 3, num_tokens: 1, blocks: &t1 },
        ];
        let n = 31;
        let q = data(n * q_heads * d, 3);
        let scale = 1.0 / (d as f32).sqrt();
        let mut first: Option<Vec<f32>> = None;
        for simd in [false, true] {
            #[cfg(target_arch = "x86_64")]
            if simd && !std::arch::is_x86_feature_detected!("avx512f") {
                continue;
            }
            #[cfg(not(target_arch = "x86_64"))]
            if simd {
                continue;
            }
            let mut out = vec![0f32; n * q_heads * d];
            for (si, seq) in seqs.iter().enumerate() {
                for h in 0..hkv {
                    let task = Task { q: &q, q_heads, seq, kv: &kv, h, t0: 0, t1: seq.num_tokens, window, scale };
                    #[cfg(target_arch = "x86_64")]
                    let res = if simd { unsafe { task.run_avx512() } } else { task.run() };
                    #[cfg(not(target_arch = "x86_64"))]
                    let res = task.run();
                    for t in 0..seq.num_tokens {
                        let dst = ((seq.row + t) * q_heads + h * g) * d;
                        out[dst..dst + g * d].copy_from_slice(&res[t * g * d..(t + 1) * g * d]);
                    }
                    let _ = si;
                }
            }
            for seq in &seqs {
                for t in 0..seq.num_tokens {
                    let pos = seq.context_len + t;
                    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    for hq in 0..q_heads {
                        let h = hq / g;
                        let qr = &q[((seq.row + t) * q_heads + hq) * d..][..d];
                        let at = |buf: &[f32], p: usize| {
                            let base = (seq.blocks[p / bs] as usize * hkv + h) * bs * d + (p % bs) * d;
                            buf[base..base + d].to_vec()
                        };
                        let key = |p: usize| -> Vec<f32> {
                            let base = (seq.blocks[p / bs] as usize * hkv + h) * bs * d + p % bs;
                            (0..d).map(|dd| k[base + dd * bs]).collect()
                        };
                        let sc: Vec<f64> = (lo..=pos)
                            .map(|p| {
                                key(p).iter().zip(qr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                            })
                            .collect();
                        let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let w: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                        let z: f64 = w.iter().sum();
                        for dd in 0..d {
                            let want: f64 =
                                (lo..=pos).zip(&w).map(|(p, wi)| wi * at(&v, p)[dd] as f64).sum::<f64>() / z;
                            let got = out[((seq.row + t) * q_heads + hq) * d + dd] as f64;
                            assert!((got - want).abs() < 1e-4, "d={d} bs={bs} {window:?} simd={simd}: {got} vs {want}");
                        }
                    }
                }
            }
            match &first {
                None => first = Some(out),
                Some(f) => assert!(f == &out, "d={d} bs={bs} {window:?}: AVX-512 differs from the portable path"),
            }
        }
    }

    #[test]
    fn exp_is_accurate_on_the_softmax_range() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            if want > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 3e-7, "max relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
        assert!(exp(-100.0) < 1e-37);
    }
}
