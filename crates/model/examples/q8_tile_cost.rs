//! The int8 kernel's arithmetic alone: a Q4_K (or `--format q8_0|q4_0|q6_k`) `[--out, --in]` weight small enough to stay in
//! the caches (1024 x 2048 is 1.2 MB), times `rows` activation rows for each of `--rows`
//! (default 1,2,3,8,16), the way a decode step's projections and a mixture's experts run it.
//! `cargo run --release -p flint-model --example q8_tile_cost -- [--rows 1,2,3,8,16] [--format q4_k] [--out 1024]
//! [--in 2048] [--calls 200]`. Prints each row count's median time per call (of 15 rounds of
//! `--calls` calls) and its rate. Compare two builds by alternating their binaries: the figures
//! move with this shared machine's clock and neighbours, their ratio much less.
//!
//! To stream the weight from memory instead, make it larger than what the last-level cache keeps
//! of it between calls: on the 2-core Sapphire Rapids-class Xeon (2026-12-06) a buffer read over
//! and over by both threads streamed at 57 GB/s up to 64 MB, 48.5 at 128 MB, 37 at 256 MB, 34 at
//! 384 MB and 31.3–33 from 512 MB to 2 GB (`membw`'s 1 GiB: 31.8), so use at least 1 GB there
//! (`--out 1048576 --in 2048 --calls 2`: 1.2 GB in Q4_K).

mod common;

use common::{arg, format, ggml_bytes, weights, Rng};
use flint_model::kernels::as_uninit;
use flint_model::kernels::matmul_q8::matmul_uninit;
use std::time::Instant;

fn main() {
    let out: usize = arg("--out", "1024").parse().expect("--out: a number");
    let inp: usize = arg("--in", "2048").parse().expect("--in: a number");
    let format = format(&arg("--format", "q4_k"));
    let calls: usize = arg("--calls", "200").parse().expect("--calls: a number");
    let rows: Vec<usize> =
        arg("--rows", "1,2,3,8,16").split(',').map(|r| r.trim().parse().expect("--rows: numbers")).collect();
    assert!(out.is_multiple_of(16) && inp.is_multiple_of(256), "--out: a multiple of 16, --in of 256");
    let mut rng = Rng(0x9E37_79B9);
    let w = weights(format, out, inp, &mut rng);
    for m in rows {
        let x = rng.values(m * inp);
        let mut y = vec![0f32; m * out];
        let mut times: Vec<f64> = (0..15)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..calls {
                    matmul_uninit(&x, m, &w, as_uninit(&mut y));
                }
                t.elapsed().as_secs_f64() / calls as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let bytes = ggml_bytes(format, out, inp) as f64;
        println!(
            "rows {m:>2}: {:8.2} us a call  {:6.1} GMAC/s  {:6.1} GB/s of weights",
            med * 1e6,
            (m * out * inp) as f64 / med / 1e9,
            bytes / med / 1e9
        );
    }
}
