//! Attention at depth, alone: query tokens of qwen2.5-0.5b's shape (14 query heads, 2 KV heads,
//! head size 64; `--heads Q/KV/D` for another) against a context of `--depth` tokens in every
//! layer of a paged pool of the chosen dtype, the way a step runs it, for `--seqs` sequences
//! (default 1) at once. `--chunk 1` (the default) is a decode step, and the bytes
//! of cache it reads per second are printed; `--chunk 512` is one prefill chunk at that depth.
//! `cargo run --release -p flint-model --example attention_cost -- [--depth 16384] [--chunk 1]
//! [--dtype int8|bf16|f32] [--block-size N] [--iters 20] [--flush 400] [--seqs 1]
//! [--heads 14/2/64]` (the block size defaults to the dtype's default). Prints the median time of
//! one step (all layers).

mod common;

use common::arg;
use flint_model::kernels::attention::{paged_attention, ExactBlock, KvStore, PagedLayer, SeqView};
use flint_model::kernels::huge_buf::HugeBuf;
use flint_model::kv_dtype::KvCacheDtype;
use std::time::Instant;

const LAYERS: usize = 24;

fn fill<T: Copy>(n: usize, f: impl Fn(usize) -> T) -> Vec<T> {
    (0..n).map(f).collect()
}

fn hash(i: usize) -> u32 {
    let mut x = (i as u32).wrapping_mul(2_654_435_761) ^ 0x9e37_79b9;
    x ^= x >> 15;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^ (x >> 13)
}

fn main() {
    let depth: usize = arg("--depth", "16384").parse().expect("--depth: a number");
    let nseq: usize = arg("--seqs", "1").parse().expect("--seqs: a number");
    assert!(nseq >= 1, "--seqs: at least 1");
    let heads: Vec<usize> =
        arg("--heads", "14/2/64").split('/').map(|v| v.parse().expect("--heads: Q/KV/D, numbers")).collect();
    let [qh, hkv, dh] = heads[..] else { panic!("--heads: Q/KV/D") };
    let dtype = arg("--dtype", "int8");
    let iters: usize = arg("--iters", "20").parse().expect("--iters: a number");
    let chunk: usize = arg("--chunk", "1").parse().expect("--chunk: a number");
    assert!(chunk >= 1, "--chunk: at least 1");
    let kv_dtype: KvCacheDtype = dtype.parse().expect("--dtype: int8, bf16 or f32");
    let bs_default = kv_dtype.default_block_size().to_string();
    let bs: usize = arg("--block-size", &bs_default).parse().expect("--block-size: a number");
    let blocks = ((depth + chunk - 1) / bs + 1) * nseq;
    let per_layer = blocks * hkv * dh * bs;
    // One pool per layer, blocks in a scrambled order as a busy pool hands them out.
    // i·m + 3 mod blocks, with m prime to blocks: a permutation.
    let m = [7, 11, 13, 17, 19].into_iter().find(|m| !blocks.is_multiple_of(*m)).unwrap_or(1);
    let table: Vec<u32> = (0..blocks).map(|i| ((i * m + 3) % blocks) as u32).collect();
    let f32s = |seed: usize| fill(per_layer, |i| (hash(i + seed) % 2000) as f32 / 1000.0 - 1.0);
    struct Layer {
        kf: HugeBuf<f32>,
        vf: HugeBuf<f32>,
        kb: HugeBuf<u16>,
        vb: HugeBuf<u16>,
        k8: HugeBuf<u8>,
        kmin: HugeBuf<u16>,
        ksc: HugeBuf<u8>,
        v8: HugeBuf<i8>,
        vsc: HugeBuf<u8>,
    }
    let layers: Vec<Layer> = (0..LAYERS)
        .map(|l| {
            let big = |v: Vec<f32>| {
                if dtype == "f32" {
                    HugeBuf::from_slice(&v)
                } else {
                    HugeBuf::from_slice(&v[..dh * bs * hkv])
                }
            };
            let bf = |v: &[f32]| HugeBuf::from_slice(&fill(v.len(), |i| (v[i].to_bits() >> 16) as u16));
            let (kf, vf) = (f32s(l * 7), f32s(l * 7 + 1));
            let (kb, vb) = if dtype == "bf16" { (bf(&kf), bf(&vf)) } else { (HugeBuf::zeroed(1), HugeBuf::zeroed(1)) };
            let n8 = if dtype == "int8" { per_layer } else { 1 };
            Layer {
                kb,
                vb,
                k8: HugeBuf::from_slice(&fill(n8, |i| hash(i + l) as u8)),
                kmin: HugeBuf::from_slice(&fill(blocks * hkv * dh, |i| half_bits(-((hash(i) % 100) as f32) / 50.0))),
                ksc: HugeBuf::from_slice(&fill(blocks * hkv * dh, |i| 150 + (hash(i) % 20) as u8)),
                v8: HugeBuf::from_slice(&fill(n8, |i| hash(i + 3 * l) as i8)),
                vsc: HugeBuf::from_slice(&fill(blocks * hkv * bs, |i| 150 + (hash(i) % 20) as u8)),
                kf: big(kf),
                vf: big(vf),
            }
        })
        .collect();
    let q: Vec<f32> = fill(nseq * chunk * qh * dh, |i| (hash(i + 99) % 2000) as f32 / 1000.0 - 1.0);
    let exact_k: Vec<f32> = fill(hkv * dh * bs, |i| (hash(i + 5) % 2000) as f32 / 1000.0 - 1.0);
    // Int8: the chunk's own blocks at full precision.
    let own_blocks = (depth + chunk - 1) / bs - depth / bs + 1;
    let mut out = vec![0f32; nseq * chunk * qh * dh];
    // A decode step also streams the weights, which pushes the cache out of every CPU cache:
    // `--flush MB` reads that many megabytes between tokens (untimed), as the weights would.
    let flush_mb: usize = arg("--flush", "0").parse().expect("--flush: a number");
    let flush = HugeBuf::<f32>::from_slice(&vec![1.0f32; flush_mb * 262_144]);
    let mut sink = 0f32;
    let mut times = Vec::new();
    for it in 0..iters + 2 {
        sink += flush.iter().step_by(16).sum::<f32>();
        let t = Instant::now();
        for l in &layers {
            let store = match dtype.as_str() {
                "f32" => KvStore::F32 { k: &l.kf, v: &l.vf },
                "bf16" => KvStore::Bf16 { k: &l.kb, v: &l.vb },
                _ => KvStore::Int8 { k: &l.k8, k_min: &l.kmin, k_scale: &l.ksc, v: &l.v8, v_scale: &l.vsc },
            };
            let kv = PagedLayer { store, block_size: bs, kv_heads: hkv, head_dim: dh };
            let exact = vec![ExactBlock { k: &exact_k, v: &exact_k }; own_blocks];
            let ex: &[ExactBlock] = if dtype == "int8" { &exact } else { &[] };
            // Each sequence its own share of the (scrambled) table.
            let per_seq = blocks / nseq;
            let seqs: Vec<SeqView> = (0..nseq)
                .map(|s| SeqView {
                    row: s * chunk,
                    context_len: depth,
                    num_tokens: chunk,
                    blocks: &table[s * per_seq..][..per_seq],
                    exact: ex,
                })
                .collect();
            paged_attention(&q, qh, &seqs, &kv, None, &mut out);
        }
        if it >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let per_tok = match dtype.as_str() {
        "f32" => 2 * dh * 4,
        "bf16" => 2 * dh * 2,
        _ => 2 * dh + 1,
    } * hkv
        * LAYERS
        * nseq;
    let bytes = (per_tok * depth) as f64;
    println!(
        "dtype {dtype} depth {depth} chunk {chunk} seqs {nseq}: {:.2} ms per step (median of {iters}, min {:.2}), {:.1} MB of cache, {:.1} GB/s, checksum {:.4}",
        med * 1e3,
        times[0] * 1e3,
        bytes / 1e6,
        bytes / med / 1e9,
        out.iter().sum::<f32>() + sink * 0.0
    );
}

fn half_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}
