//! Every path (scalar, AVX2, AVX-512, whichever this CPU has) and every split against each other
//! bit for bit, and against a plain f64 softmax over the values each dtype stores, for f32, bf16
//! and int8 pools, scattered block tables, prefix + new tokens, windows and ragged block sizes.

use super::portable::{dot16, tree_sum};
use super::*;
use crate::kernels::kv_quant::{
    dequantize_key, dequantize_value, from_bf16, key_code_at, quantize_keys, quantize_values, to_bf16, value_code_at,
};

fn data(n: usize, seed: u32) -> Vec<f32> {
    crate::kernels::xorshift(seed.wrapping_mul(2_654_435_761).wrapping_add(7))
        .take(n)
        .map(|s| (s % 20_000) as f32 / 5_000.0 - 2.0)
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dtype {
    F32,
    Bf16,
    Int8,
}

/// A pool of `nb` blocks in every dtype, made from the same f32 keys (some channels offset, as
/// Qwen2's k_proj bias does) and values.
struct Pool {
    d: usize,
    bs: usize,
    hkv: usize,
    kf: Vec<f32>,
    vf: Vec<f32>,
    kb: Vec<u16>,
    vb: Vec<u16>,
    k8: Vec<u8>,
    kmin: Vec<u16>,
    ksc: Vec<u8>,
    v8: Vec<i8>,
    vsc: Vec<u8>,
}

impl Pool {
    fn new(d: usize, bs: usize, hkv: usize, nb: usize) -> Self {
        let n = nb * hkv * d * bs;
        let mut kf = data(n, 1);
        for (i, x) in kf.iter_mut().enumerate() {
            if (i / bs % d).is_multiple_of(5) {
                *x += 3.0;
            }
        }
        let vf = data(n, 2);
        let (mut k8, mut kmin, mut ksc) = (vec![0u8; n], vec![0u16; nb * hkv * d], vec![0u8; nb * hkv * d]);
        let (mut v8, mut vsc) = (vec![0i8; n], vec![0u8; nb * hkv * bs]);
        for bh in 0..nb * hkv {
            let r = bh * d * bs..(bh + 1) * d * bs;
            quantize_keys(&kf[r.clone()], bs, &mut k8[r.clone()], &mut kmin[bh * d..][..d], &mut ksc[bh * d..][..d]);
            quantize_values(&vf[r.clone()], d, &mut v8[r], &mut vsc[bh * bs..][..bs]);
        }
        let kb = kf.iter().map(|&x| to_bf16(x)).collect();
        let vb = vf.iter().map(|&x| to_bf16(x)).collect();
        Self { d, bs, hkv, kf, vf, kb, vb, k8, kmin, ksc, v8, vsc }
    }

    fn layer(&self, dt: Dtype) -> PagedLayer<'_> {
        let store = match dt {
            Dtype::F32 => KvStore::F32 { k: &self.kf, v: &self.vf },
            Dtype::Bf16 => KvStore::Bf16 { k: &self.kb, v: &self.vb },
            Dtype::Int8 => {
                KvStore::Int8 { k: &self.k8, k_min: &self.kmin, k_scale: &self.ksc, v: &self.v8, v_scale: &self.vsc }
            }
        };
        PagedLayer { store, block_size: self.bs, kv_heads: self.hkv, head_dim: self.d }
    }

    /// The exact copies of physical blocks `table[first..=last]` (the f32 originals).
    fn exact(&self, table: &[u32], first: usize, last: usize) -> Vec<ExactBlock<'_>> {
        let per = self.hkv * self.d * self.bs;
        (first..=last)
            .map(|b| {
                let at = table[b] as usize * per;
                ExactBlock { k: &self.kf[at..at + per], v: &self.vf[at..at + per] }
            })
            .collect()
    }

    /// Key channel `c` and value row at position `p` of head `h`, as `dt` stores them (int8: as
    /// dequantized, or exact when `exact`).
    fn kv_at(&self, dt: Dtype, table: &[u32], h: usize, p: usize, exact: bool) -> (Vec<f64>, Vec<f64>) {
        let (d, bs) = (self.d, self.bs);
        let bh = table[p / bs] as usize * self.hkv + h;
        let off = p % bs;
        let k = (0..d)
            .map(|c| {
                let i = bh * d * bs + c * bs + off;
                let x = match dt {
                    Dtype::Int8 if !exact => {
                        let code = self.k8[bh * d * bs + key_code_at(d, bs, c, off)];
                        dequantize_key(code, self.kmin[bh * d + c], self.ksc[bh * d + c])
                    }
                    Dtype::Bf16 => from_bf16(self.kb[i]),
                    _ => self.kf[i],
                };
                x as f64
            })
            .collect();
        let v = (0..d)
            .map(|c| {
                let i = bh * d * bs + off * d + c;
                let x = match dt {
                    Dtype::Int8 if !exact => {
                        dequantize_value(self.v8[bh * d * bs + value_code_at(d, off, c)], self.vsc[bh * bs + off])
                    }
                    Dtype::Bf16 => from_bf16(self.vb[i]),
                    _ => self.vf[i],
                };
                x as f64
            })
            .collect();
        (k, v)
    }

    /// The score an int8 cache defines for query `q` (already times 1/√d) against the stored key at
    /// position `p` of head `h`: the query quantized against the block's statistics, the integer
    /// sum, its step and bias (see `int8`), evaluated in f64.
    fn int8_score(&self, table: &[u32], h: usize, p: usize, q: &[f32]) -> f64 {
        let (d, bs) = (self.d, self.bs);
        let bh = table[p / bs] as usize * self.hkv + h;
        let mut q8 = vec![0i8; d];
        let (step, bias) = int8::quantize_query(q, &self.kmin[bh * d..][..d], &self.ksc[bh * d..][..d], &mut q8);
        let dot: i64 = (0..d).map(|c| q8[c] as i64 * self.k8[bh * d * bs + key_code_at(d, bs, c, p % bs)] as i64).sum();
        dot as f64 * step as f64 + bias as f64
    }
}

/// Sequence 0: `ctx` cached + `n` new tokens; sequence 1: one decode token at `dec` (both on
/// scrambled tables). Returns the outputs of every path × split the CPU has, checked against f64.
#[allow(clippy::too_many_arguments)]
fn check(dt: Dtype, d: usize, bs: usize, g: usize, window: Option<usize>, ctx: usize, n: usize, dec: usize) {
    let hkv = 2;
    let q_heads = hkv * g;
    let need = |len: usize| len.div_ceil(bs);
    let (b0, b1) = (need(ctx + n), need(dec + 1));
    let nb = b0 + b1 + 3;
    let pool = Pool::new(d, bs, hkv, nb);
    // Scrambled, disjoint tables: a stride coprime with the pool walks a permutation of it.
    let stride = [7, 11, 13, 17].into_iter().find(|&k| nb % k != 0).unwrap_or(1) as u32;
    let perm: Vec<u32> = (0..nb as u32).map(|i| (i * stride + 3) % nb as u32).collect();
    let (t0, t1) = (perm[..b0].to_vec(), perm[b0..b0 + b1].to_vec());
    let int8 = dt == Dtype::Int8;
    let e0 = if int8 { pool.exact(&t0, ctx / bs, (ctx + n - 1) / bs) } else { Vec::new() };
    let e1 = if int8 { pool.exact(&t1, dec / bs, dec / bs) } else { Vec::new() };
    let seqs = [
        SeqView { row: 0, context_len: ctx, num_tokens: n, blocks: &t0, exact: &e0 },
        SeqView { row: n, context_len: dec, num_tokens: 1, blocks: &t1, exact: &e1 },
    ];
    let rows = n + 1;
    let q = data(rows * q_heads * d, 3);
    let layer = pool.layer(dt);
    let paths: Vec<Isa> =
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|&p| p <= widest_path(d)).collect();
    let mut first: Option<(Vec<f32>, Isa, bool)> = None;
    let name = format!("{dt:?} d={d} bs={bs} g={g} {window:?} ctx={ctx} n={n} dec={dec}");
    for &path in &paths {
        for split in [false, true] {
            let mut out = vec![f32::NAN; rows * q_heads * d];
            attention_with(&q, q_heads, &seqs, &layer, window, &mut out, split, path);
            match &first {
                None => {
                    reference_check(&name, &pool, dt, &seqs, &q, q_heads, window, &out);
                    first = Some((out, path, split));
                }
                Some((f, p0, s0)) => {
                    let same = f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{name}: {path:?} split={split} differs from {p0:?} split={s0}");
                }
            }
        }
    }
    eprintln!("{name}: paths {paths:?} agree");
}

#[allow(clippy::too_many_arguments)]
fn reference_check(
    name: &str,
    pool: &Pool,
    dt: Dtype,
    seqs: &[SeqView],
    q: &[f32],
    q_heads: usize,
    window: Option<usize>,
    out: &[f32],
) {
    let (d, bs) = (pool.d, pool.bs);
    let g = q_heads / pool.hkv;
    let scale = 1.0 / (d as f64).sqrt();
    for seq in seqs {
        for t in 0..seq.num_tokens {
            let pos = seq.context_len + t;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for hq in 0..q_heads {
                let h = hq / g;
                let qr = &q[((seq.row + t) * q_heads + hq) * d..][..d];
                let kvs: Vec<_> = (lo..=pos).map(|p| pool.kv_at(dt, seq.blocks, h, p, p / bs == pos / bs)).collect();
                // Int8 blocks other than the row's own: the score the int8 arithmetic defines.
                let qs: Vec<f32> = qr.iter().map(|&x| x * (1.0 / (d as f32).sqrt())).collect();
                let sc: Vec<f64> = (lo..=pos)
                    .zip(&kvs)
                    .map(|(p, (k, _))| {
                        if dt == Dtype::Int8 && p / bs != pos / bs {
                            pool.int8_score(seq.blocks, h, p, &qs)
                        } else {
                            k.iter().zip(qr).map(|(a, b)| a * *b as f64).sum::<f64>() * scale
                        }
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = w.iter().sum();
                for c in 0..d {
                    let want: f64 = kvs.iter().zip(&w).map(|((_, v), wi)| wi * v[c]).sum::<f64>() / z;
                    let got = out[((seq.row + t) * q_heads + hq) * d + c] as f64;
                    assert!((got - want).abs() < 2e-4, "{name}: row {t} head {hq} ch {c}: {got} vs {want}");
                }
            }
        }
    }
}

#[test]
fn every_path_and_split_agree_and_match_a_plain_softmax() {
    for dt in [Dtype::F32, Dtype::Bf16, Dtype::Int8] {
        // (d, bs, g): the usual shapes, GQA groups over 8 (two score groups), a head size
        // of 48 (three vectors), and block sizes that are not multiples of the tile.
        for (d, bs, g) in [(64, 16, 7), (128, 128, 6), (64, 128, 9), (32, 16, 4), (48, 24, 3), (16, 8, 2)] {
            for window in [None, Some(300)] {
                check(dt, d, bs, g, window, 5, 30, 2 * bs + 3);
                check(dt, d, bs, g, window, 700, 3, 1000);
            }
        }
    }
}

/// A row's output does not depend on the rest of its chunk: one call with every token gives
/// each row the same bits as one call per token (decode), for every dtype.
#[test]
fn a_row_is_the_same_alone_and_in_a_prefill_chunk() {
    for dt in [Dtype::F32, Dtype::Bf16, Dtype::Int8] {
        let (d, bs, g, hkv) = (64, 16, 7, 2);
        let q_heads = g * hkv;
        let (ctx, n): (usize, usize) = (37, 45);
        let nb = (ctx + n).div_ceil(bs) + 2;
        let pool = Pool::new(d, bs, hkv, nb);
        let table: Vec<u32> = (0..nb as u32).rev().collect();
        let layer = pool.layer(dt);
        let q = data(n * q_heads * d, 9);
        let int8 = dt == Dtype::Int8;
        let exact = if int8 { pool.exact(&table, ctx / bs, (ctx + n - 1) / bs) } else { Vec::new() };
        let whole = [SeqView { row: 0, context_len: ctx, num_tokens: n, blocks: &table, exact: &exact }];
        let mut all = vec![0f32; n * q_heads * d];
        paged_attention(&q, q_heads, &whole, &layer, None, &mut all);
        for t in 0..n {
            let pos = ctx + t;
            let ex = if int8 { pool.exact(&table, pos / bs, pos / bs) } else { Vec::new() };
            let one = [SeqView { row: 0, context_len: pos, num_tokens: 1, blocks: &table, exact: &ex }];
            let mut out = vec![0f32; q_heads * d];
            paged_attention(&q[t * q_heads * d..][..q_heads * d], q_heads, &one, &layer, None, &mut out);
            let want = &all[t * q_heads * d..][..q_heads * d];
            assert!(
                out.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dt:?}: token {t} differs alone and in the chunk"
            );
        }
    }
}

#[test]
fn exp_is_accurate_on_the_softmax_range() {
    for (name, f) in [("exp", exp as fn(f32) -> f32), ("exp_fma", exp_fma)] {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            let got = f(x) as f64;
            if want > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 3e-7, "{name}: max relative error {worst}");
        assert_eq!(f(0.0), 1.0);
        assert_eq!(f(f32::NEG_INFINITY), f(-87.0));
        assert!(f(-100.0) < 1e-37);
    }
}

/// The 16-lane exp is the scalar one, bit for bit, over the whole argument range.
#[cfg(target_arch = "x86_64")]
#[test]
fn vector_exp_matches_the_scalar_one() {
    if !Isa::Avx512.available() {
        eprintln!("no AVX-512 here: the vector exp is not run");
        return;
    }
    let xs: Vec<f32> =
        (0..160_000).map(|i| -(i as f32) * 90.0 / 160_000.0).chain([0.0, -0.0, f32::NEG_INFINITY]).collect();
    for chunk in xs.chunks(16) {
        let mut lanes = [0f32; 16];
        lanes[..chunk.len()].copy_from_slice(chunk);
        // SAFETY: AVX-512F was just detected.
        let got = unsafe { x86::exp16_for_tests(lanes) };
        for (g, x) in got.iter().zip(lanes) {
            assert_eq!(g.to_bits(), exp_fma(x).to_bits(), "e^{x}");
        }
    }
}

#[test]
fn tree_sum_and_dot16_follow_their_stated_order() {
    let p: [f32; 16] = std::array::from_fn(|i| 1.0 + i as f32 * 1e-7);
    let mut h = [0f32; 8];
    for i in 0..8 {
        h[i] = p[i] + p[i + 8];
    }
    let want = ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
    assert_eq!(tree_sum(&p), want);
    let a = data(40, 4);
    let b = data(40, 5);
    let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
    assert!((dot16(&a, &b) as f64 - exact).abs() < 1e-5);
}

/// Timing, not a check (run by hand: `cargo test --release -p flint-model --lib attention_speed
/// -- --ignored --nocapture`): one layer of qwen2.5-0.5b's attention (14 query heads over 2 KV
/// heads of 64) for a decode token and a 512-token prefill chunk after `ctx` cached tokens.
#[test]
#[ignore]
fn attention_speed() {
    let (d, hkv, g) = (64, 2, 7);
    let q_heads = hkv * g;
    let case = std::env::var("FLINT_ATTENTION_CASE").ok();
    for dt in [Dtype::F32, Dtype::Bf16, Dtype::Int8] {
        let bs = if dt == Dtype::Int8 { 128 } else { 16 };
        for ctx in [4096usize, 16384] {
            for n in [1usize, 512] {
                // FLINT_ATTENTION_CASE=Int8/16384/512 picks one case (for a profiler).
                if case.as_ref().is_some_and(|c| *c != format!("{dt:?}/{ctx}/{n}")) {
                    continue;
                }
                // Decode reads 24 layers' caches that no cache level holds: 24 disjoint tables.
                let layers = if n == 1 { 24 } else { 1 };
                let per = (ctx + n).div_ceil(bs);
                let pool = Pool::new(d, bs, hkv, per * layers + 1);
                let layer = pool.layer(dt);
                let tables: Vec<Vec<u32>> =
                    (0..layers).map(|l| (0..per as u32).map(|b| (l * per) as u32 + b).collect()).collect();
                let exact: Vec<Vec<ExactBlock>> = tables
                    .iter()
                    .map(|t| if dt == Dtype::Int8 { pool.exact(t, ctx / bs, (ctx + n - 1) / bs) } else { Vec::new() })
                    .collect();
                let q = data(n * q_heads * d, 5);
                let mut out = vec![0f32; n * q_heads * d];
                let pass = |out: &mut [f32]| {
                    for (t, e) in tables.iter().zip(&exact) {
                        let seqs = [SeqView { row: 0, context_len: ctx, num_tokens: n, blocks: t, exact: e }];
                        paged_attention(&q, q_heads, &seqs, &layer, None, out);
                    }
                };
                pass(&mut out);
                let reps = if n == 1 { 20 } else { 3 };
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    pass(&mut out);
                }
                let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
                if n == 1 {
                    eprintln!("{dt:?} ctx {ctx} decode: {ms:.2} ms per token (24 layers, caches cold)");
                } else {
                    eprintln!("{dt:?} ctx {ctx} prefill {n}: {ms:.1} ms per layer ({:.0} ms for 24)", ms * 24.0);
                }
            }
        }
    }
}
