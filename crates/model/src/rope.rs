//! Rotary position embeddings, NeoX layout (Qwen2 rotates the two halves of each head), with
//! linear and YaRN scaling computed exactly as transformers does.
//!
//! Everything here is f32 whatever the weight dtype: bf16 angles lose whole radians past a few
//! hundred positions. Angles are computed per batch for the positions in it (`pos × inv_freq`,
//! one f32 product like transformers' `inv_freq @ position_ids`), so no table sized by the
//! context length is kept.

use candle_core::{DType, Device, Tensor};

use crate::config::{RopeConfig, RopeScaling};
use crate::error::Result;

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Multiplies both cos and sin (YaRN's attention factor); 1 otherwise.
    attention_scaling: f32,
}

impl Rope {
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> Self {
        let dim = head_dim;
        let base = cfg.theta as f32;
        // pos_freqs = base ^ (2i / d), in f32 like torch.
        let pos_freqs: Vec<f32> = (0..dim / 2).map(|i| base.powf((2 * i) as f32 / dim as f32)).collect();
        match &cfg.scaling {
            RopeScaling::None => Self { inv_freq: pos_freqs.iter().map(|p| 1.0 / p).collect(), attention_scaling: 1.0 },
            RopeScaling::Linear { factor } => {
                Self { inv_freq: pos_freqs.iter().map(|p| 1.0 / p / *factor as f32).collect(), attention_scaling: 1.0 }
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let inv_freq = llama3_inv_freq(
                    &pos_freqs,
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *original_max_position_embeddings as f32,
                );
                Self { inv_freq, attention_scaling: 1.0 }
            }
            RopeScaling::FreqFactors(factors) => Self {
                // As llama.cpp applies `rope_freqs`: theta_i = pos · base^(-2i/d) / factor_i.
                inv_freq: pos_freqs.iter().zip(factors).map(|(p, f)| 1.0 / p / f).collect(),
                attention_scaling: 1.0,
            },
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                let attention_factor = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(a)) if *m != 0.0 && *a != 0.0 => yarn_mscale(*factor, *m) / yarn_mscale(*factor, *a),
                    _ => yarn_mscale(*factor, 1.0),
                });
                let (low, high) = yarn_correction_range(
                    *beta_fast,
                    *beta_slow,
                    dim,
                    cfg.theta,
                    *original_max_position_embeddings as f64,
                    *truncate,
                );
                let (low, mut high) = (low as f32, high as f32);
                if low == high {
                    high += 0.001; // as transformers: avoid a zero-width ramp
                }
                let factor = *factor as f32;
                let inv_freq = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (factor * p);
                        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                    })
                    .collect();
                Self { inv_freq, attention_scaling: attention_factor as f32 }
            }
        }
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn attention_scaling(&self) -> f32 {
        self.attention_scaling
    }

    /// cos and sin for the given positions, each `[n, head_dim / 2]` f32 on `device`.
    pub fn cos_sin(&self, positions: &[u32], device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos() * self.attention_scaling);
                sin.push(angle.sin() * self.attention_scaling);
            }
        }
        let n = positions.len();
        Ok((Tensor::from_vec(cos, (n, half), device)?, Tensor::from_vec(sin, (n, half), device)?))
    }
}

/// The per-frequency divisors llama.cpp's converter stores as `rope_freqs.weight` for a Llama 3
/// checkpoint (`FreqFactors` read back from a file pass through); `None` without such scaling.
/// As the converter: from the f32 default frequencies, in f64, stored as f32.
pub fn gguf_freq_factors(cfg: &RopeConfig, head_dim: usize) -> Option<Vec<f32>> {
    match &cfg.scaling {
        RopeScaling::FreqFactors(f) => Some(f.clone()),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let original = *original_max_position_embeddings as f64;
            let (low_wavelen, high_wavelen) = (original / low_freq_factor, original / high_freq_factor);
            let base = cfg.theta as f32;
            let factors = (0..head_dim / 2)
                .map(|i| {
                    let freq = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
                    let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
                    if wavelen < high_wavelen {
                        1.0
                    } else if wavelen > low_wavelen {
                        *factor as f32
                    } else {
                        let smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
                    }
                })
                .collect();
            Some(factors)
        }
        _ => None,
    }
}

/// transformers' `_compute_llama3_parameters`, in f32 as its tensors are: wavelengths longer
/// than `original / low_freq_factor` are interpolated by `factor`, shorter than
/// `original / high_freq_factor` kept, and those between blended by a linear ramp.
fn llama3_inv_freq(pos_freqs: &[f32], factor: f32, low: f32, high: f32, original: f32) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    pos_freqs
        .iter()
        .map(|p| {
            let inv = 1.0 / p;
            let wavelen = 2.0 * std::f32::consts::PI / inv;
            let scaled = if wavelen > low_wavelen { inv / factor } else { inv };
            // transformers: `~(wavelen < high) * ~(wavelen > low)`; the same for finite wavelengths.
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            if medium {
                let smooth = (original / wavelen - low) / (high - low);
                (1.0 - smooth) * scaled / factor + smooth * scaled
            } else {
                scaled
            }
        })
        .collect()
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The dimension band over which YaRN ramps from extrapolation to interpolation.
fn yarn_correction_range(
    beta_fast: f64,
    beta_slow: f64,
    dim: usize,
    base: f64,
    original_max: f64,
    truncate: bool,
) -> (f64, f64) {
    let correction_dim = |rotations: f64| {
        (dim as f64 * (original_max / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

/// Rotate `x` (`[n, heads, head_dim]`, f32) by per-token `cos`/`sin` (`[n, head_dim / 2]`).
/// First half: x1·cos − x2·sin; second half: x2·cos + x1·sin — transformers' `rotate_half` form.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (n, _heads, d) = x.dims3()?;
    let half = d / 2;
    let dtype = x.dtype();
    let x = if dtype == DType::F32 { x.clone() } else { x.to_dtype(DType::F32)? };
    let cos = cos.reshape((n, 1, half))?;
    let sin = sin.reshape((n, 1, half))?;
    let x1 = x.narrow(2, 0, half)?;
    let x2 = x.narrow(2, half, half)?;
    let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    let out = Tensor::cat(&[&r1, &r2], 2)?;
    Ok(if dtype == DType::F32 { out } else { out.to_dtype(dtype)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_inv_freq() {
        let r = Rope::new(&RopeConfig { theta: 10000.0, scaling: RopeScaling::None }, 8);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in r.inv_freq().iter().zip(want) {
            assert!((a - b).abs() < 1e-6 * b.max(1e-3), "{a} vs {b}");
        }
        assert_eq!(r.attention_scaling(), 1.0);
    }

    #[test]
    fn yarn_attention_factor_and_band() {
        let cfg = RopeConfig {
            theta: 10000.0,
            scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 128,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: None,
                mscale: None,
                mscale_all_dim: None,
                truncate: true,
            },
        };
        let r = Rope::new(&cfg, 32);
        assert!((r.attention_scaling() - 1.138_629_4).abs() < 1e-6);
        let plain = Rope::new(&RopeConfig { theta: 10000.0, scaling: RopeScaling::None }, 32);
        // Highest frequencies extrapolate (unchanged), lowest interpolate (divided by factor).
        assert_eq!(r.inv_freq()[0], plain.inv_freq()[0]);
        let last = r.inv_freq().len() - 1;
        assert!((r.inv_freq()[last] * 4.0 - plain.inv_freq()[last]).abs() < 1e-9);
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let dev = Device::Cpu;
        let r = Rope::new(&RopeConfig { theta: 10000.0, scaling: RopeScaling::None }, 4);
        let x = Tensor::new(&[[[1f32, 2.0, 3.0, 4.0]], [[1.0, 2.0, 3.0, 4.0]]], &dev).unwrap();
        let (c, s) = r.cos_sin(&[0, 5], &dev).unwrap();
        let y = apply_rope(&x, &c, &s).unwrap().to_vec3::<f32>().unwrap();
        assert_eq!(y[0][0], vec![1.0, 2.0, 3.0, 4.0]);
        let n0: f32 = [1f32, 2., 3., 4.].iter().map(|v| v * v).sum();
        let n1: f32 = y[1][0].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
    }
}
