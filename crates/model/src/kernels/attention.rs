//! Causal attention that reads keys and values where they live: in fixed-size blocks of a paged
//! pool, found through each sequence's block table. Nothing is gathered into a contiguous copy.
//!
//! One task handles a run of up to [`QUERY_TILE`] query tokens of one sequence against one KV
//! head, for all the query heads that share that KV head (grouped-query attention without
//! repeating K/V). Softmax is online, one key block at a time. Every query row's result depends
//! only on its own query vector and the keys and values at positions `0..=pos`, visited in
//! position order in blocks of `block_size` positions — never on the batch, the prefill chunking
//! or which physical blocks hold the data, so batching cannot change a request's tokens.

use rayon::prelude::*;

/// Query tokens per task: enough tasks for the threads on one long prompt, few per decode.
const QUERY_TILE: usize = 16;

/// The paged pool of one layer: `[num_blocks][kv_heads][block_size][head_dim]` for K and for V.
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
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(s, h, t0, t1)| {
            let task = Task { q, q_heads, seq: &seqs[s], kv, h, t0, t1, window, scale };
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F was just detected.
                return unsafe { task.run_avx512() };
            }
            task.run()
        })
        .collect();
    for (&(s, h, t0, t1), res) in tasks.iter().zip(results) {
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
        self.body()
    }

    fn run(&self) -> Vec<f32> {
        self.body()
    }

    /// Transpose the key blocks this task reads once (`[block][dim][slot]`), so each score block
    /// is a 16-wide multiply-add over the head dimension; then an online softmax per query row.
    #[inline(always)]
    fn body(&self) -> Vec<f32> {
        let (kv, seq) = (self.kv, self.seq);
        let (bs, d, hkv) = (kv.block_size, kv.head_dim, kv.kv_heads);
        let g = self.q_heads / hkv;
        let pos_hi = seq.context_len + self.t1 - 1;
        let lo_min = self.window.map_or(0, |w| (seq.context_len + self.t0 + 1).saturating_sub(w));
        let (b0, b1) = (lo_min / bs, pos_hi / bs);
        let mut kt = vec![0f32; (b1 - b0 + 1) * d * bs];
        for b in b0..=b1 {
            let src = &kv.k[(seq.blocks[b] as usize * hkv + self.h) * bs * d..][..bs * d];
            let dst = &mut kt[(b - b0) * d * bs..][..d * bs];
            for k in 0..bs {
                for dd in 0..d {
                    dst[dd * bs + k] = src[k * d + dd];
                }
            }
        }
        let mut res = vec![0f32; (self.t1 - self.t0) * g * d];
        let mut scores = vec![0f32; bs];
        for t in self.t0..self.t1 {
            let pos = seq.context_len + t;
            let lo = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for j in 0..g {
                let qrow = &self.q[((seq.row + t) * self.q_heads + self.h * g + j) * d..][..d];
                let out = &mut res[((t - self.t0) * g + j) * d..][..d];
                let (mut max, mut denom) = (f32::NEG_INFINITY, 0f32);
                for b in lo / bs..=pos / bs {
                    let kb = &kt[(b - b0) * d * bs..][..d * bs];
                    if bs == 16 {
                        // The default block size: the 16 sums stay in one register.
                        block_scores::<16>(qrow, kb, &mut scores);
                    } else {
                        scores.fill(0.0);
                        for (dd, &qd) in qrow.iter().enumerate() {
                            let krow = &kb[dd * bs..(dd + 1) * bs];
                            for (s, &kv) in scores.iter_mut().zip(krow) {
                                *s += qd * kv;
                            }
                        }
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
                        out.iter_mut().for_each(|o| *o *= correction);
                    }
                    max = new_max;
                    for s in live.iter_mut() {
                        *s = exp(*s - max);
                    }
                    let vbase = (seq.blocks[b] as usize * hkv + self.h) * bs * d;
                    for (i, &p) in live.iter().enumerate() {
                        denom += p;
                        let vrow = &kv.v[vbase + (first - b * bs + i) * d..][..d];
                        for (o, &v) in out.iter_mut().zip(vrow) {
                            *o += p * v;
                        }
                    }
                }
                let inv = 1.0 / denom;
                out.iter_mut().for_each(|o| *o *= inv);
            }
        }
        res
    }
}

/// Scores of one query against a transposed key block of `BS` slots: for each slot, the sum over
/// the head dimension in order (the generic path's order, in a register).
#[inline(always)]
fn block_scores<const BS: usize>(q: &[f32], kb: &[f32], out: &mut [f32]) {
    let mut acc = [0f32; BS];
    for (krow, &qd) in kb.chunks_exact(BS).zip(q) {
        for k in 0..BS {
            acc[k] += qd * krow[k];
        }
    }
    out[..BS].copy_from_slice(&acc);
}

/// `e^x` for the softmax's arguments (x ≤ 0), in plain arithmetic that vectorises and gives the
/// same bits on every CPU: x = k·ln2 + r with |r| ≤ ln2/2, a degree-6 polynomial for e^r, and k
/// put into the exponent. Relative error below 3e-7; arguments under −87 give e^−87 ≈ 1.6e−38,
/// nothing next to the block maximum's 1.
#[inline(always)]
fn exp(x: f32) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::exp;

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
