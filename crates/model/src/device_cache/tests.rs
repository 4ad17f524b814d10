//! The device pool on the CPU (its ops' reference implementations) against the contiguous cache:
//! the same attention for mixed chunked prefills and decodes over scattered block tables, GQA, a
//! sliding window, in f32, bf16 and f16. On a GPU the golden tests run the same pool through the
//! CUDA kernels (`tests/golden_device.rs`).

use super::*;
use crate::batch::LogitsRows;
use crate::kv_cache::ContiguousKvCache;

use crate::kv_test_support::{cfg, qkv};

/// Tables of 16-token blocks from a pool of 97, scattered (stride 5), disjoint per sequence.
fn table(seq: usize, len: usize) -> Vec<u32> {
    (0..len.div_ceil(16)).map(|i| (((20 * seq + i) * 5 + 2) % 97) as u32).collect()
}

/// Run `plan` (steps of (seq, context_len, new tokens)) through both layers; every output row,
/// in plan order, as f32.
fn run(cache: &mut dyn KvCache, plan: &[Vec<(usize, usize, usize)>], window: Option<usize>, dtype: DType) -> Vec<f32> {
    let mut rows = Vec::new();
    for step in plan {
        let mut batch = ForwardBatch::new();
        let mut parts: [Vec<Tensor>; 3] = Default::default();
        for &(seq, ctx, n) in step {
            batch.push_paged(seq, ctx, &vec![1; n], LogitsRows::All, table(seq, 300));
            for (part, t) in parts.iter_mut().zip(qkv(seq, ctx, n, dtype)) {
                part.push(t);
            }
        }
        let [q, k, v] = parts.map(|p| Tensor::cat(&p, 0).unwrap());
        for layer in 0..2 {
            let out = cache.attention(layer, &batch, &q, &k, &v, window).unwrap();
            assert_eq!(out.dtype(), dtype);
            if layer == 1 {
                rows.extend(out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            }
        }
    }
    rows
}

/// Two sequences: uneven prefill chunks side by side, then decodes of both in one batch.
fn plan() -> Vec<Vec<(usize, usize, usize)>> {
    let mut plan = vec![vec![(0, 0, 21), (1, 0, 5)], vec![(0, 21, 40), (1, 5, 33)], vec![(1, 38, 9)]];
    for i in 0..6 {
        plan.push(vec![(0, 61 + i, 1), (1, 47 + i, 1)]);
    }
    plan
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn matches_the_contiguous_cache_in_each_dtype() {
    // Stated tolerances: f32 summation order only; bf16 and f16 round the output once (the
    // contiguous cache rounds the scores and probabilities too).
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2), (DType::F16, 4e-3)] {
        for window in [None, Some(24)] {
            let mut device = DeviceKvCache::new(&cfg(), dtype, 16, 97, &Device::Cpu).unwrap();
            let mut reference = ContiguousKvCache::for_config(&cfg(), dtype, &Device::Cpu);
            let got = run(&mut device, &plan(), window, dtype);
            let want = run(&mut reference, &plan(), window, dtype);
            let d = max_diff(&got, &want);
            assert!(d <= tol, "{dtype:?}, window {window:?}: max |Δ| {d} > {tol}");
        }
    }
}

#[test]
fn chunking_and_batching_do_not_change_f32_results() {
    let whole = vec![vec![(0, 0, 67)], vec![(1, 0, 53)]];
    let mut a = DeviceKvCache::new(&cfg(), DType::F32, 16, 97, &Device::Cpu).unwrap();
    let mut b = DeviceKvCache::new(&cfg(), DType::F32, 16, 97, &Device::Cpu).unwrap();
    let chunked = run(&mut a, &plan(), None, DType::F32);
    let at_once = run(&mut b, &whole, None, DType::F32);
    // Rows of `plan()` in plan order, regrouped by sequence.
    let row = 6 * 64;
    let mut per_seq: [Vec<f32>; 2] = Default::default();
    let mut r = 0;
    for step in plan() {
        for (seq, _, n) in step {
            per_seq[seq].extend_from_slice(&chunked[r * row..(r + n) * row]);
            r += n;
        }
    }
    assert_eq!(per_seq.concat(), at_once, "the reference op's rows depend on how the batch was cut");
}

#[test]
fn bad_tables_are_errors_not_panics() {
    let mut cache = DeviceKvCache::new(&cfg(), DType::F32, 16, 97, &Device::Cpu).unwrap();
    let [q, k, v] = qkv(0, 0, 20, DType::F32);
    let mut short = ForwardBatch::new();
    short.push_paged(0, 0, &[1; 20], LogitsRows::All, vec![3]);
    let err = cache.attention(0, &short, &q, &k, &v, None).unwrap_err().to_string();
    assert!(err.contains("reaches position 20"), "{err}");
    let mut outside = ForwardBatch::new();
    outside.push_paged(0, 0, &[1; 20], LogitsRows::All, vec![3, 97]);
    let err = cache.attention(0, &outside, &q, &k, &v, None).unwrap_err().to_string();
    assert!(err.contains("block 97 of a pool of 97"), "{err}");
    assert!(DeviceKvCache::new(&cfg(), DType::U32, 16, 4, &Device::Cpu).is_err());
}
