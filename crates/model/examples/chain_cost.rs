//! A single sequence's dense projections the way a decode step chains them: each of `--layers`
//! layers' fused q/k/v call (qwen3-30b-a3b's shapes: 4096, 512 and 512 outputs of 2048 inputs,
//! Q4_K), then its o projection (2048 of 4096) and its f32 router (128 of 2048), one row each, so
//! that every call reads its weights from memory, not from the cache, as decode does. Made for
//! the small weights' pages (see `kernels::huge_buf`): a 512 × 2048 Q4_K weight is 0.6 MB.
//! `cargo run --release -p flint-model --example chain_cost -- [--layers 48] [--iters 20]`.
//! Prints each kind of call's median time and the rate it streamed its weights at; compare two
//! builds by alternating their binaries.

mod common;

use common::{arg, median, q4k, Rng};
use flint_model::kernels::as_uninit;
use flint_model::kernels::matmul_f32::{self, PackedF32};
use flint_model::kernels::matmul_q8::{matmul_many_uninit, matmul_uninit, PackedQ8};
use std::time::Instant;

const HIDDEN: usize = 2048;
const Q: usize = 4096;
const KV: usize = 512;
const EXPERTS: usize = 128;

fn main() {
    let layers: usize = arg("--layers", "48").parse().expect("--layers: a number");
    let iters: usize = arg("--iters", "20").parse().expect("--iters: a number");
    let mut rng = Rng(0x9E37_79B9);
    let x = rng.values(Q);
    let routers: Vec<PackedF32> =
        (0..layers).map(|_| PackedF32::pack(&rng.values(EXPERTS * HIDDEN), EXPERTS, HIDDEN)).collect();
    let mut rng = Rng(0x2545_F491);
    // In load order, as the model holds them: q, k, v, o.
    let proj: Vec<[PackedQ8; 4]> = (0..layers)
        .map(|_| {
            [q4k(Q, HIDDEN, &mut rng), q4k(KV, HIDDEN, &mut rng), q4k(KV, HIDDEN, &mut rng), q4k(HIDDEN, Q, &mut rng)]
        })
        .collect();
    let (mut q, mut k, mut v, mut o, mut r) =
        (vec![0f32; Q], vec![0f32; KV], vec![0f32; KV], vec![0f32; HIDDEN], vec![0f32; EXPERTS]);
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..iters {
        let mut sums = [0f64; 3];
        for (l, [wq, wk, wv, wo]) in proj.iter().enumerate() {
            let t = Instant::now();
            let mut ys = [as_uninit(&mut q), as_uninit(&mut k), as_uninit(&mut v)];
            matmul_many_uninit(&x[..HIDDEN], 1, &[wq, wk, wv], &mut ys);
            sums[0] += t.elapsed().as_secs_f64();
            let t = Instant::now();
            matmul_uninit(&x, 1, wo, as_uninit(&mut o));
            sums[1] += t.elapsed().as_secs_f64();
            let t = Instant::now();
            matmul_f32::matmul_uninit(&o, 1, &routers[l], as_uninit(&mut r));
            sums[2] += t.elapsed().as_secs_f64();
        }
        std::hint::black_box((&q, &k, &v, &r));
        for (t, s) in times.iter_mut().zip(sums) {
            t.push(s / layers as f64);
        }
    }
    let [wq, wk, wv, wo] = &proj[0];
    let bytes = [wq.packed_bytes() + wk.packed_bytes() + wv.packed_bytes(), wo.packed_bytes(), EXPERTS * HIDDEN * 4];
    for ((name, t), b) in ["q/k/v", "o", "router (f32)"].iter().zip(&times).zip(bytes) {
        let m = median(t);
        println!("{name:>12}: {:7.1} us a layer, {:5.1} GB/s of weights", m * 1e6, b as f64 / m / 1e9);
    }
}
