//! One mixture-of-experts feed-forward alone, as `merged_forward` runs it: qwen3-30b-a3b's experts
//! (128 of 768 × 2048, 8 per token) merged in Q4_K, `--rows` token rows each routed to 8 random
//! experts, the gate/up grouped call then the down one. Several layers' worth of weights are
//! cycled so that every pass reads its experts from memory, not from the cache, as a decode step
//! does. `cargo run --release -p flint-model --example moe_cost -- [--rows 1] [--iters 60]
//! [--layers 4]`. Prints the median time of a layer's pass and the bytes of the experts it read
//! per second (as the file counts them, and as the packed panels the kernel streams hold them),
//! against a peer in the same run: plain reads of the same number of streamed bytes from the
//! same places of a buffer laid out like the weights (huge pages, both threads), alternated with
//! the kernel pass by pass. Their ratio is the kernel's share of what the memory gives here,
//! steadier than either figure on a shared machine.

mod common;

use common::{arg, median, q4k, Rng, Q4K_BYTES};
use flint_model::kernels::huge_buf::HugeBuf;
use flint_model::kernels::matmul_q8::{grouped_gated_uninit, grouped_uninit, ExpertJob, PackedQ8};
use flint_model::kernels::{as_uninit, pool};
use std::mem::MaybeUninit;
use std::time::Instant;

const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const HIDDEN: usize = 2048;
const INTER: usize = 768;
fn main() {
    let n: usize = arg("--rows", "1").parse().expect("--rows: a number");
    let iters: usize = arg("--iters", "60").parse().expect("--iters: a number");
    let layers: usize = arg("--layers", "4").parse().expect("--layers: a number");
    let mut rng = Rng(0x9E37_79B9);
    let weights: Vec<[PackedQ8; 3]> = (0..layers)
        .map(|_| {
            [
                q4k(EXPERTS * INTER, HIDDEN, &mut rng),
                q4k(EXPERTS * INTER, HIDDEN, &mut rng),
                q4k(EXPERTS * HIDDEN, INTER, &mut rng),
            ]
        })
        .collect();
    let x = rng.values(n * HIDDEN);
    // The GGUF file's bytes of an expert (the throughput figure's unit), and the bytes the kernel
    // streams for one expert's projection (the peer reads as many: its packed Q4_K panels carry
    // 2.8% more than the file, so a peer reading the file's bytes made the kernel look that much
    // less efficient than it is).
    let expert_bytes = 3 * INTER * HIDDEN / 256 * Q4K_BYTES;
    let proj_bytes: Vec<usize> = weights[0].iter().map(|w| w.packed_bytes() / EXPERTS).collect();
    let mirror: Vec<HugeBuf<u8>> = (0..layers * 3)
        .map(|i| {
            let mut b = HugeBuf::<u8>::zeroed(EXPERTS * proj_bytes[i % 3]);
            b.iter_mut().enumerate().for_each(|(j, v)| *v = (i + j) as u8);
            b
        })
        .collect();
    let mut peer = Vec::new();
    let mut times = Vec::new();
    let mut read = Vec::new();
    for it in 0..iters + 3 {
        // Each row's 8 distinct experts, drawn at random.
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); EXPERTS];
        for r in 0..n {
            let mut chosen = Vec::new();
            while chosen.len() < TOP_K {
                let e = rng.next() as usize % EXPERTS;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            for e in chosen {
                rows[e].push(r as u32);
            }
        }
        let chosen: Vec<usize> = (0..EXPERTS).filter(|&e| !rows[e].is_empty()).collect();
        let [gate, up, down] = &weights[it % layers];
        let t = Instant::now();
        let jobs: Vec<ExpertJob> =
            chosen.iter().map(|&e| ExpertJob { rows: &rows[e], col0: e * INTER, cols: INTER }).collect();
        let mut gated: Vec<Vec<f32>> = chosen.iter().map(|&e| vec![0f32; rows[e].len() * INTER]).collect();
        {
            let mut ys: Vec<&mut [MaybeUninit<f32>]> = gated.iter_mut().map(|g| as_uninit(g)).collect();
            grouped_gated_uninit(&x, n, gate, up, &jobs, &mut ys);
        }
        let jobs: Vec<ExpertJob> =
            chosen.iter().map(|&e| ExpertJob { rows: &rows[e], col0: e * HIDDEN, cols: HIDDEN }).collect();
        let mut outs: Vec<Vec<f32>> = chosen.iter().map(|&e| vec![0f32; rows[e].len() * HIDDEN]).collect();
        {
            let inputs: Vec<&[f32]> = gated.iter().map(Vec::as_slice).collect();
            let mut ys: Vec<&mut [MaybeUninit<f32>]> = outs.iter_mut().map(|g| as_uninit(g)).collect();
            grouped_uninit(&inputs, down, &jobs, &mut ys);
        }
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(&outs);
        let pieces = pieces(&chosen, &proj_bytes);
        let t = Instant::now();
        read_like(&mirror[(it % layers) * 3..][..3], &pieces);
        let p = t.elapsed().as_secs_f64();
        if it >= 3 {
            times.push(s);
            peer.push(p);
            read.push(chosen.len());
        }
    }
    let ratios: Vec<f64> = peer.iter().zip(&times).map(|(p, t)| p / t).collect();
    let experts = read.iter().sum::<usize>() as f64 / read.len() as f64;
    let (file, streamed) = (experts * expert_bytes as f64, experts * proj_bytes.iter().sum::<usize>() as f64);
    println!(
        "rows {n}: {experts:.1} experts a pass; kernel median {:.3} ms = {:.1} GB/s of the file's expert bytes, \
         {:.1} GB/s streamed; plain reads of the same streamed bytes {:.1} GB/s; kernel / reads, median of \
         pass ratios: {:.2}",
        median(&times) * 1e3,
        file / median(&times) / 1e9,
        streamed / median(&times) / 1e9,
        streamed / median(&peer) / 1e9,
        median(&ratios)
    );
}

/// The chosen experts' bytes of each projection (`proj_bytes[b]` an expert in buffer `b`), one
/// piece `(buffer, start, end)` per expert and projection, listed before the peer's timing starts.
/// Whole experts, as the kernel's tasks mostly are (its panel ranges are cut at expert borders):
/// with 64 KiB pieces the peer streamed at most about 44 GB/s, where one stream a thread and
/// 864 KB pieces streamed 62-69 (Zen 4, 2 threads, alternated in one process), so it undercut what
/// the memory gives the kernel's access pattern whenever the host was fast.
fn pieces(chosen: &[usize], proj_bytes: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut pieces = Vec::new();
    for (b, &size) in proj_bytes.iter().enumerate() {
        for &e in chosen {
            pieces.push((b, e * size, (e + 1) * size));
        }
    }
    pieces
}

/// Read `pieces` of `bufs` over the pool.
fn read_like(bufs: &[HugeBuf<u8>], pieces: &[(usize, usize, usize)]) {
    let sink = std::sync::atomic::AtomicU64::new(0);
    pool::run(pieces.len(), |i| {
        let (b, start, end) = pieces[i];
        let piece = &bufs[b][start..end];
        let mut acc = [0u64; 8];
        for line in piece.chunks_exact(64) {
            for (a, w) in acc.iter_mut().zip(line.chunks_exact(8)) {
                *a = a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap_or_default()));
            }
        }
        sink.fetch_add(acc.iter().fold(0, |s, &a| s ^ a), std::sync::atomic::Ordering::Relaxed);
    });
    std::hint::black_box(sink.into_inner());
}
