//! One-row Q4_K matmuls the size of a decode step's per-layer calls against one large call over
//! the same kind of weights: qwen3-30b-a3b's q/k/v (`[5120, 2048]`) and o (`[2048, 4096]`) for
//! `--layers` layers, each its own weight so every call streams from memory, alternated with its
//! lm_head (`[151936, 2048]`) call by call. Their ratio is what the per-call costs (the pool's
//! hand-out and finish, each thread's weight stream starting anew) take from the bandwidth a long
//! stream gets. `cargo run --release -p flint-model --example call_cost -- [--layers 48]
//! [--iters 30]`. Prints each round's GB/s and the medians.

mod common;

use common::{arg, median, q4k, Rng};
use flint_model::kernels::matmul_q8::{matmul_uninit, PackedQ8};
use std::mem::MaybeUninit;
use std::time::Instant;

fn main() {
    let iters: usize = arg("--iters", "30").parse().expect("--iters: a number");
    let layers: usize = arg("--layers", "48").parse().expect("--layers: a number");
    assert!(iters >= 1 && layers >= 1, "--iters and --layers: at least 1");
    let mut rng = Rng(0x1234_5678);
    let head = q4k(151_936, 2048, &mut rng);
    let calls: Vec<(PackedQ8, PackedQ8)> =
        (0..layers).map(|_| (q4k(5120, 2048, &mut rng), q4k(2048, 4096, &mut rng))).collect();
    let x = rng.values(4096);
    let mut y = vec![MaybeUninit::<f32>::uninit(); 151_936];
    let layer_bytes: usize = calls.iter().map(|(qkv, o)| qkv.packed_bytes() + o.packed_bytes()).sum();
    let (mut big, mut small, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for it in 0..iters + 2 {
        let t = Instant::now();
        matmul_uninit(&x[..2048], 1, &head, &mut y);
        let b = head.packed_bytes() as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        for (qkv, o) in &calls {
            matmul_uninit(&x[..2048], 1, qkv, &mut y[..5120]);
            matmul_uninit(&x[..4096], 1, o, &mut y[..2048]);
        }
        let s = layer_bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        // The first two rounds warm the pool and the page tables.
        if it >= 2 {
            println!(
                "round {}: one call {b:.1} GB/s, {} layer-sized calls {s:.1} GB/s ({:.2})",
                it - 1,
                2 * layers,
                s / b
            );
            big.push(b);
            small.push(s);
            ratio.push(s / b);
        }
    }
    println!(
        "median: one call {:.1} GB/s, layer-sized calls {:.1} GB/s, ratio {:.2}",
        median(&big),
        median(&small),
        median(&ratio)
    );
}
