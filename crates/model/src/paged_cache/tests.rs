use super::*;
use crate::batch::LogitsRows;
use crate::kv_cache::ContiguousKvCache;
use candle_core::DType;

const DTYPES: [KvCacheDtype; 3] = [KvCacheDtype::F32, KvCacheDtype::Bf16, KvCacheDtype::Int8];

use crate::kv_test_support::cfg;

/// [`crate::kv_test_support::qkv`] in f32, as a tuple.
fn qkv(seq: usize, p0: usize, n: usize) -> (Tensor, Tensor, Tensor) {
    let [q, k, v] = crate::kv_test_support::qkv(seq, p0, n, DType::F32);
    (q, k, v)
}

/// Run `plan` (steps of (seq, context_len, new tokens)) through both layers of `cache`; returns
/// the last layer's output row for each (seq, position).
fn run(
    cache: &mut dyn KvCache,
    tables: &[Vec<u32>],
    plan: &[Vec<(usize, usize, usize)>],
    window: Option<usize>,
) -> HashMap<(usize, usize), Vec<f32>> {
    let mut rows = HashMap::new();
    for step in plan {
        let mut batch = ForwardBatch::new();
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for &(seq, ctx, n) in step {
            batch.push_paged(seq, ctx, &vec![1; n], LogitsRows::All, tables[seq].clone());
            let (q, k, v) = qkv(seq, ctx, n);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let cat = |t: &[Tensor]| Tensor::cat(t, 0).unwrap();
        let (q, k, v) = (cat(&qs), cat(&ks), cat(&vs));
        let mut out = None;
        for layer in 0..2 {
            out = Some(cache.attention(layer, &batch, &q, &k, &v, window).unwrap().to_vec2::<f32>().unwrap());
        }
        let out = out.unwrap_or_default();
        let mut r = 0;
        for &(seq, ctx, n) in step {
            for i in 0..n {
                rows.insert((seq, ctx + i), out[r].clone());
                r += 1;
            }
        }
    }
    rows
}

fn tables() -> Vec<Vec<u32>> {
    // Scattered, non-adjacent, descending tables (blocks of 16: up to 7 × 16 = 112 tokens each).
    vec![vec![63, 7, 31, 2, 50, 11, 40], vec![5, 60, 0, 33, 21, 9, 48, 17], vec![44, 13, 3, 58, 26, 37]]
}

/// Uneven chunks, several sequences per step, block boundaries crossed mid-chunk.
fn plan_batched() -> Vec<Vec<(usize, usize, usize)>> {
    vec![
        vec![(0, 0, 9), (1, 0, 3)],
        vec![(1, 3, 14), (0, 9, 1), (2, 0, 1)],
        vec![(2, 1, 20), (0, 10, 23)],
        vec![(0, 33, 1), (1, 17, 1), (2, 21, 2)],
        vec![(0, 34, 30), (1, 18, 40), (2, 23, 17)],
    ]
}

/// The same tokens, one sequence at a time, one token per step.
fn plan_one_by_one() -> Vec<Vec<(usize, usize, usize)>> {
    let lens = [64, 58, 40];
    let mut p = Vec::new();
    for (seq, &len) in lens.iter().enumerate() {
        for pos in 0..len {
            p.push(vec![(seq, pos, 1)]);
        }
    }
    p
}

fn max_diff(a: &HashMap<(usize, usize), Vec<f32>>, b: &HashMap<(usize, usize), Vec<f32>>) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().map(|(key, x)| x.iter().zip(&b[key]).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max)).fold(0f32, f32::max)
}

#[test]
fn every_dtype_is_chunking_invariant_and_close_to_the_contiguous_reference() {
    let c = cfg();
    for window in [None, Some(21)] {
        let mut reference = ContiguousKvCache::for_config(&c, DType::F32, &Device::Cpu);
        let want = run(&mut reference, &tables(), &plan_batched(), window);
        for dt in DTYPES {
            let mut a = PagedKvCache::new(&c, dt, 16, 64).unwrap();
            let batched = run(&mut a, &tables(), &plan_batched(), window);
            let mut b = PagedKvCache::new(&c, dt, 16, 64).unwrap();
            let single = run(&mut b, &tables(), &plan_one_by_one(), window);
            // Same bits however the tokens were batched and chunked.
            assert_eq!(max_diff(&batched, &single), 0.0, "{dt} {window:?}: batched and one-by-one differ");
            let tol = match dt {
                KvCacheDtype::F32 => 1e-5,
                KvCacheDtype::Bf16 => 2e-2,
                KvCacheDtype::Int8 => 2e-2,
            };
            let diff = max_diff(&batched, &want);
            eprintln!("{dt} {window:?}: max |Δ| against the f32 contiguous reference {diff:e}");
            assert!(diff <= tol, "{dt} {window:?}: max |Δ| {diff} > {tol}");
            if dt == KvCacheDtype::Int8 {
                // Sequences 1 and 2 end in a partial block, still at full precision; sequence 0's
                // 64 tokens fill four blocks, quantized.
                assert_eq!(a.staging_blocks(), 2);
                assert!(diff > 0.0, "int8 blocks were never read quantized");
            }
        }
    }
}

#[test]
fn int8_staging_is_handed_back_when_blocks_fill_or_are_released() {
    let c = cfg();
    let mut cache = PagedKvCache::new(&c, KvCacheDtype::Int8, 16, 64).unwrap();
    let t = tables();
    run(&mut cache, &t, &[vec![(0, 0, 40)]], None);
    assert_eq!(cache.staging_blocks(), 1, "blocks 0 and 1 filled, block 2 holds 8 tokens");
    run(&mut cache, &t, &[vec![(0, 40, 8)]], None);
    assert_eq!(cache.staging_blocks(), 0, "48 tokens: three full blocks");
    run(&mut cache, &t, &[vec![(0, 48, 3)]], None);
    assert_eq!(cache.staging_blocks(), 1);
    cache.release(&t[0]);
    assert_eq!(cache.staging_blocks(), 0);
    // Continuing a partial block whose copy was released is an error, not a panic or garbage.
    let mut batch = ForwardBatch::new();
    batch.push_paged(0, 51, &[1], LogitsRows::Last, t[0].clone());
    let (q, k, v) = qkv(0, 51, 1);
    let err = cache.attention(0, &batch, &q, &k, &v, None).unwrap_err().to_string();
    assert!(err.contains("no full-precision copy"), "{err}");
}

#[test]
fn copy_on_write_and_rollback_work_on_int8_blocks() {
    let c = cfg();
    for dt in DTYPES {
        // Sequence 0 writes 40 tokens; block 1 (full) is copied to block 9, block 2 (partial,
        // staged) to block 12: a sequence on [b0, 9, 12] sees exactly what sequence 0 sees.
        let mut cache = PagedKvCache::new(&c, dt, 16, 64).unwrap();
        let t = tables();
        let mut plan = vec![vec![(0, 0, 40)]];
        run(&mut cache, &t, &plan, None);
        cache.copy_block(t[0][1], 9).unwrap();
        cache.copy_block(t[0][2], 12).unwrap();
        let twin = vec![t[0][0], 9, 12, 1, 4, 6, 8];
        plan = vec![vec![(0, 40, 5)]];
        let a = run(&mut cache, &t, &plan, None);
        let b = run(&mut cache, std::slice::from_ref(&twin), &[vec![(0, 40, 5)]], None);
        assert_eq!(max_diff(&a, &b), 0.0, "{dt}: the copied blocks read differently");
        assert!(cache.copy_block(0, 64).is_err());
        // Roll sequence 0 back to 20 tokens (into full block 1), then write 25 new positions:
        // reopening block 1 brings its first 4 tokens back to staging from their codes.
        cache.reopen_block(t[0][1], 4).unwrap();
        let again = run(&mut cache, &t, &[vec![(0, 20, 25)]], None);
        // Against a cache that never rolled back: identical for f32/bf16, close for int8 (the 4
        // kept tokens went through the codes once).
        let mut fresh = PagedKvCache::new(&c, dt, 16, 64).unwrap();
        run(&mut fresh, &t, &[vec![(0, 0, 20)]], None);
        let want = run(&mut fresh, &t, &[vec![(0, 20, 25)]], None);
        let diff = max_diff(&again, &want);
        match dt {
            KvCacheDtype::Int8 => assert!(diff < 2e-2, "{dt}: rollback drifted by {diff}"),
            _ => assert_eq!(diff, 0.0, "{dt}: rollback changed the numbers"),
        }
        assert!(cache.reopen_block(64, 0).is_err() && cache.reopen_block(0, 16).is_err());
    }
}

#[test]
fn short_block_table_is_an_error_not_a_panic() {
    let c = cfg();
    for dt in DTYPES {
        let mut paged = PagedKvCache::new(&c, dt, 4, 8).unwrap();
        let mut batch = ForwardBatch::new();
        batch.push_paged(0, 0, &[1; 9], LogitsRows::Last, vec![0, 1]);
        let z = |h| Tensor::zeros((9, h, 64), DType::F32, &Device::Cpu).unwrap();
        let err = paged.attention(0, &batch, &z(6), &z(2), &z(2), None).unwrap_err().to_string();
        assert!(err.contains("needs 3 blocks"), "{err}");
        let mut batch = ForwardBatch::new();
        batch.push_paged(0, 0, &[1; 2], LogitsRows::Last, vec![8]);
        let z = |h| Tensor::zeros((2, h, 64), DType::F32, &Device::Cpu).unwrap();
        assert!(paged.attention(0, &batch, &z(6), &z(2), &z(2), None).is_err());
    }
}
