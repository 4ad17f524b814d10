//! Test data shared by the paged and device KV pools' unit tests: a small config and queries,
//! keys and values that depend only on (sequence, position).

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;

/// Two layers, 6 query heads over 2 KV heads of 64.
pub fn cfg() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":384,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":6,"num_key_value_heads":2,"vocab_size":10,"max_position_embeddings":4096,
            "rms_norm_eps":1e-6,"rope_theta":10000.0}"#,
    )
    .unwrap()
}

pub fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// q, k, v (`[n, heads, 64]` in `dtype`) for positions `p0..p0 + n` of sequence `seq`: a function
/// of (seq, position) only, so any chunking of a sequence feeds the same numbers. Keys get a
/// per-channel offset (Qwen2's k_proj bias).
pub fn qkv(seq: usize, p0: usize, n: usize, dtype: DType) -> [Tensor; 3] {
    let (hq, hkv, d) = (6, 2, 64);
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for p in p0..p0 + n {
        let seed = (seq * 100_000 + p) as u64;
        q.extend(rand(hq * d, 3 * seed + 1));
        k.extend(rand(hkv * d, 3 * seed + 2).into_iter().enumerate().map(|(i, x)| x + (i % 9) as f32 * 0.7));
        v.extend(rand(hkv * d, 3 * seed + 3));
    }
    let t = |v: Vec<f32>, h: usize| Tensor::from_vec(v, (n, h, d), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    [t(q, hq), t(k, hkv), t(v, hkv)]
}
