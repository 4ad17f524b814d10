//! Deterministic weights: a pure function of (seed, tensor name, element index). A counter-based
//! generator (SplitMix64) is evaluated at each index, so any slice of any tensor can be generated
//! independently, in parallel, in any chunking, and the safetensors and GGUF outputs of one shape
//! and seed hold the same numbers.
//!
//! Scales were chosen so activations stay O(1) through 28 layers and the logits are a spread-out
//! distribution rather than a one-hot, which keeps sampling code paths meaningful:
//! - every matrix (embedding and `lm_head` included) ~ N(0, 1/fan_in), fan_in = its row length,
//!   so a unit-RMS input gives unit-variance outputs and tied or untied logits have std ≈ 1
//!   (an embedding of std 1 would give tied logits of std √hidden ≈ 30–60);
//! - q/k/v biases ~ N(0, 0.5²), so the bias path visibly matters;
//! - RMSNorm weights 1 + N(0, 0.05²).
//!
//! Normal deviates are approximated by a sum of four 16-bit uniforms (Irwin–Hall, rescaled to unit
//! variance, bounded at ±3.46σ): one 64-bit hash per value, fast enough for 7.6e9 values.

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::kernels::pool;

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: a bijective 64-bit mix with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of the tensor name: spelled out because std's hashers may change between Rust
/// releases, and the weights of a seed must not.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3))
}

pub(super) fn tensor_key(name: &str, seed: u64) -> u64 {
    mix64(seed ^ mix64(name_hash(name)))
}

/// Mean and standard deviation of a tensor's values (see the module docs for why).
pub(super) fn init_for(name: &str, shape: &[usize]) -> (f32, f32) {
    if name.ends_with("layernorm.weight") || name.ends_with("norm.weight") {
        (1.0, 0.05)
    } else if name.ends_with(".bias") {
        (0.0, 0.5)
    } else if shape.len() >= 2 {
        let fan_in = shape.last().copied().unwrap_or(1).max(1);
        (0.0, 1.0 / (fan_in as f32).sqrt())
    } else {
        (0.0, 0.02)
    }
}

/// Fill `out` with elements `start..start + out.len()` of the tensor keyed `key`.
fn fill(out: &mut [f32], key: u64, start: u64, (mean, std): (f32, f32)) {
    // Sum of four U[0,1) has mean 2 and variance 1/3.
    let scale = std * 3f32.sqrt() / 65536.0;
    let offset = mean - 2.0 * std * 3f32.sqrt();
    let mut ctr = key.wrapping_add(start.wrapping_mul(GOLDEN_GAMMA));
    for x in out {
        ctr = ctr.wrapping_add(GOLDEN_GAMMA);
        let r = mix64(ctr);
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        *x = s as f32 * scale + offset;
    }
}

/// [`fill`] on the kernel threads; the result does not depend on how the work is split.
pub(super) fn fill_parallel(out: &mut [f32], key: u64, start: u64, init: (f32, f32)) {
    let per = out.len().div_ceil(pool::threads()).max(1 << 16);
    pool::run_chunks(out, per, |i, chunk| fill(chunk, key, start + (i * per) as u64, init));
}

/// The f32 weights of tensor `name` (a Hugging Face name) for `seed`, as [`synth`] writes them.
pub fn synth_tensor(name: &str, shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut data = vec![0f32; n];
    fill_parallel(&mut data, tensor_key(name, seed), 0, init_for(name, shape));
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synth_tensor_is_deterministic_and_scaled() {
        let shape = [256, 1024];
        let a = synth_tensor("model.layers.0.mlp.up_proj.weight", &shape, 7).unwrap();
        let b = synth_tensor("model.layers.0.mlp.up_proj.weight", &shape, 7).unwrap();
        let c = synth_tensor("model.layers.1.mlp.up_proj.weight", &shape, 7).unwrap();
        let d = synth_tensor("model.layers.0.mlp.up_proj.weight", &shape, 8).unwrap();
        let (a, b, c, d) = [a, b, c, d].map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).into();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 1e-3, "{mean}");
        assert!((std - 1.0 / 32.0).abs() < 1e-3, "{std}");
        // A slice generated on its own equals the same slice of the whole.
        let mut part = vec![0f32; 1000];
        fill(&mut part, tensor_key("model.layers.0.mlp.up_proj.weight", 7), 5000, init_for("x.weight", &shape));
        assert_eq!(part, a[5000..6000]);
        let norm = synth_tensor("model.norm.weight", &[64], 7).unwrap().to_vec1::<f32>().unwrap();
        assert!(norm.iter().all(|x| (x - 1.0).abs() < 0.2));
    }
}
