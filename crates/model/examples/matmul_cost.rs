//! One projection alone: `y = x·Wᵀ` for qwen2.5-0.5b's layer shapes with `--rows` activation rows
//! (512: a prefill chunk; 1: a decode step), weights of `--dtype bf16|f32`, the way a step runs
//! it. `cargo run --release -p flint-model --example matmul_cost -- [--rows 512] [--dtype bf16]
//! [--iters 20]`. Prints each shape's median time and its arithmetic rate; for bf16 also one
//! core's `vdpbf16ps` peak (where the CPU has it) and the MLP's gate/up as the model runs it,
//! two weights in one call against the SiLU-fused pass, alternated.

mod common;

use common::arg;
use flint_model::kernels::matmul_f32::{matmul, matmul_gated_uninit, matmul_many_uninit, Bf16Compute, PackedF32};
use std::mem::MaybeUninit;
use std::time::Instant;

/// qwen2.5-0.5b: (name, out, in) of each projection in a layer.
const SHAPES: [(&str, usize, usize); 4] =
    [("qkv", 1152, 896), ("o_proj", 896, 896), ("gate_up", 9728, 896), ("down_proj", 896, 4864)];

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn main() {
    let rows: usize = arg("--rows", "512").parse().expect("--rows: a number");
    let iters: usize = arg("--iters", "20").parse().expect("--iters: a number");
    let dtype = arg("--dtype", "bf16");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bf16") {
        let best = (0..5).map(|_| unsafe { peak_dp(2_000_000) }).fold(0f64, f64::max);
        println!("vdpbf16ps peak, one core: {best:.1} GFLOP/s");
    }
    if dtype == "bf16" {
        println!("bf16 weights: {}", Bf16Compute::native());
    }
    let mut total_flop = 0.0;
    let mut total_s = 0.0;
    for (name, out, inp) in SHAPES {
        let w = values(out * inp, 1);
        let packed = match dtype.as_str() {
            "bf16" => {
                let bits: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                PackedF32::pack_bf16(&bits, out, inp, Bf16Compute::native())
            }
            "f32" => PackedF32::pack(&w, out, inp),
            other => panic!("--dtype: bf16 or f32, not {other}"),
        };
        let x = values(rows * inp, 2);
        let mut y = vec![0f32; rows * out];
        matmul(&x, rows, &packed, &mut y);
        let mut times: Vec<f64> = (0..iters)
            .map(|_| {
                let t = Instant::now();
                matmul(&x, rows, &packed, &mut y);
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let med = times[iters / 2];
        let flop = 2.0 * (rows * out * inp) as f64;
        total_flop += flop;
        total_s += med;
        println!("{name:>10} {out:>5}x{inp:<5} rows {rows}: {:8.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med / 1e9);
    }
    if dtype == "bf16" {
        // The MLP's first half as the model runs it: gate and up in one call, then SiLU·up, or
        // fused in one pass.
        let (out, inp) = (4864, 896);
        let pack = |seed| {
            let bits: Vec<u16> = values(out * inp, seed).iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            PackedF32::pack_bf16(&bits, out, inp, Bf16Compute::native())
        };
        let (g, u) = (pack(3), pack(4));
        let x = values(rows * inp, 2);
        let flop = 4.0 * (rows * out * inp) as f64;
        for fused in [false, true, false, true] {
            let mut times: Vec<f64> = (0..iters)
                .map(|_| {
                    let t = Instant::now();
                    let mut y: Vec<MaybeUninit<f32>> = Vec::with_capacity(rows * out);
                    y.resize(rows * out, MaybeUninit::uninit());
                    if fused {
                        matmul_gated_uninit(&x, rows, &g, &u, &mut y);
                    } else {
                        let mut gy: Vec<MaybeUninit<f32>> = Vec::with_capacity(rows * out);
                        gy.resize(rows * out, MaybeUninit::uninit());
                        matmul_many_uninit(&x, rows, &[&g, &u], &mut [&mut gy, &mut y]);
                        // SAFETY: both outputs were written in full by the kernel.
                        let (gs, us) = unsafe { (gy.iter().map(|v| v.assume_init()).sum::<f32>(), y[0].assume_init()) };
                        std::hint::black_box((gs, us));
                    }
                    std::hint::black_box(&y);
                    t.elapsed().as_secs_f64()
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let med = times[iters / 2];
            let name = if fused { "gated" } else { "gate+up" };
            println!("{name:>10} 2x{out}x{inp} rows {rows}: {:8.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med / 1e9);
        }
    }
    println!("{:>10} per layer: {:8.3} ms  {:6.1} GFLOP/s", "all", total_s * 1e3, total_flop / total_s / 1e9);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn peak_dp(n: usize) -> f64 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_setzero_ps(); 16];
    let one: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80));
    let (w, x) = std::hint::black_box((one, one));
    let t = Instant::now();
    for _ in 0..n {
        for acc in a.iter_mut() {
            *acc = _mm512_dpbf16_ps(*acc, w, x);
        }
    }
    std::hint::black_box(a);
    (n * 16 * 64) as f64 / t.elapsed().as_secs_f64() / 1e9
}
