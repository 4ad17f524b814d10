//! Cost of one `Sampler::sample` call over a full Qwen-sized row (151,936 logits), for the
//! temperature / top-p / top-k / min-p combinations a server sees. Prints median microseconds per
//! call (and the fastest call, steadier on a busy machine); it asserts nothing about time, so it
//! is a measurement, not a test.
//!
//! `cargo run --release -p flint-engine --example sampler_cost [filter]` (a filter keeps the rows
//! whose label contains it, e.g. `flat`).

use std::time::{Duration, Instant};

use flint_engine::{Sampler, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VOCAB: usize = 151_936;

/// Standard normal by Box–Muller; the example needs no distribution crate for it.
fn normal(rng: &mut StdRng) -> f32 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// Nearly uniform next-token distribution: what the random-weight demo model produces, and the
/// case where the nucleus holds most of the vocabulary.
fn flat(rng: &mut StdRng) -> Vec<f32> {
    (0..VOCAB).map(|_| 0.1 * normal(rng)).collect()
}

/// A trained model's shape: a broad body and a handful of clear favourites.
fn peaked(rng: &mut StdRng) -> Vec<f32> {
    let mut row: Vec<f32> = (0..VOCAB).map(|_| 3.0 * normal(rng)).collect();
    for (i, l) in [(1_234usize, 19.0f32), (99_000, 18.2), (42, 17.5), (150_000, 16.0), (7_777, 14.0)] {
        row[i] = l;
    }
    row
}

/// Median and fastest wall time of one call, sampling repeatedly from the same row (the
/// generator advances, so every call draws afresh), and how many calls were timed.
fn median_us(row: &[f32], p: &SamplingParams) -> (f64, f64, usize) {
    let mut s = Sampler::new(p.clone(), VOCAB);
    let mut times = Vec::new();
    let start = Instant::now();
    let mut sink = 0u64;
    while times.len() < 9 || (times.len() < 400 && start.elapsed() < Duration::from_millis(400)) {
        let t = Instant::now();
        sink = sink.wrapping_add(u64::from(s.sample(row, &[])));
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    std::hint::black_box(sink);
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0], times.len())
}

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    let mut rng = StdRng::seed_from_u64(20_240_601);
    let rows = [("flat N(0,0.1)", flat(&mut rng)), ("peaked N(0,3)+5", peaked(&mut rng))];
    println!(
        "{:<16} {:>5} {:>5} {:>5} {:>5} {:>10} {:>8} {:>6}",
        "logits", "temp", "top_p", "top_k", "min_p", "median_us", "min_us", "calls"
    );
    for (name, row) in &rows {
        for temperature in [0.7f32, 1.0] {
            for top_p in [1.0f32, 0.95, 0.9, 0.5] {
                for top_k in [0usize, 50] {
                    for min_p in [0.0f32, 0.05] {
                        let label = format!("{name:<16} {temperature:>5} {top_p:>5} {top_k:>5} {min_p:>5}");
                        if !label.contains(&filter) {
                            continue;
                        }
                        let p =
                            SamplingParams { temperature, top_p, top_k, min_p, seed: Some(7), ..Default::default() };
                        let (median, min, calls) = median_us(row, &p);
                        println!("{label} {median:>10.1} {min:>8.1} {calls:>6}");
                    }
                }
            }
        }
    }
}
