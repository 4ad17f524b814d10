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
            let seq = &seqs[s];
            let mut res = vec![0f32; (t1 - t0) * g * d];
            let mut scores = vec![0f32; kv.block_size];
            for t in t0..t1 {
                let pos = seq.context_len + t;
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for j in 0..g {
                    let head = h * g + j;
                    let qrow = &q[((seq.row + t) * q_heads + head) * d..][..d];
                    let dst = &mut res[((t - t0) * g + j) * d..][..d];
                    attend_one(qrow, seq.blocks, kv, h, lo, pos, scale, &mut scores, dst);
                }
            }
            res
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

/// Online softmax of one query over keys `lo..=pos` of KV head `h`, block by block.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    q: &[f32],
    blocks: &[u32],
    kv: &PagedLayer,
    h: usize,
    lo: usize,
    pos: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (bs, d) = (kv.block_size, kv.head_dim);
    let (mut max, mut denom) = (f32::NEG_INFINITY, 0f32);
    out.fill(0.0);
    for (b, &block) in blocks.iter().enumerate().take(pos / bs + 1).skip(lo / bs) {
        let base = (block as usize * kv.kv_heads + h) * bs * d;
        let (first, last) = ((b * bs).max(lo), ((b + 1) * bs - 1).min(pos));
        let n = last - first + 1;
        let off = first - b * bs;
        let mut block_max = f32::NEG_INFINITY;
        for (i, s) in scores[..n].iter_mut().enumerate() {
            *s = dot(q, &kv.k[base + (off + i) * d..][..d]) * scale;
            block_max = block_max.max(*s);
        }
        let new_max = max.max(block_max);
        // Rescale what was accumulated under the old maximum (exp(-inf) = 0 on the first block).
        let correction = (max - new_max).exp();
        if correction != 1.0 {
            denom *= correction;
            out.iter_mut().for_each(|o| *o *= correction);
        }
        max = new_max;
        for (i, &s) in scores[..n].iter().enumerate() {
            let p = (s - max).exp();
            denom += p;
            let vrow = &kv.v[base + (off + i) * d..][..d];
            for (o, &v) in out.iter_mut().zip(vrow) {
                *o += p * v;
            }
        }
    }
    let inv = 1.0 / denom;
    out.iter_mut().for_each(|o| *o *= inv);
}

/// Dot product in sixteen fixed lanes, summed in a fixed order: vectorises without fast-math and
/// gives the same bits on every CPU.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = a.len() / 16;
    for c in 0..chunks {
        let (x, y) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for l in 0..16 {
            lanes[l] += x[l] * y[l];
        }
    }
    for i in chunks * 16..a.len() {
        lanes[i % 16] += a[i] * b[i];
    }
    let mut s = 0f32;
    for l in lanes {
        s += l;
    }
    s
}
