//! The real models `flint synth` can imitate: each one's geometry, and what its hub files say
//! beyond [`Qwen2Config`].

use crate::config::{Qwen2Config, RopeConfig, RopeScaling};
use crate::error::{ModelError, Result};

/// The shapes [`shape_config`] knows.
pub const SHAPES: &[&str] = &["tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "deepseek-r1-distill-qwen-1.5b"];

/// One real model's geometry, plus what its hub files say beyond [`Qwen2Config`].
pub(super) struct ShapeSpec {
    pub(super) name: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    tied: bool,
    theta: f64,
    max_position: usize,
    bos: u32,
    eos: u32,
    /// generation_config.json's `eos_token_id` list.
    pub(super) generation_eos: &'static [u32],
    pub(super) extras: HubExtras,
}

const QWEN25_GEN_EOS: &[u32] = &[151645, 151643];

const SPECS: &[ShapeSpec] = &[
    ShapeSpec {
        name: "tiny",
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 4096,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 4096, max_window_layers: 2 },
    },
    ShapeSpec {
        name: "qwen2.5-0.5b",
        layers: 24,
        hidden: 896,
        heads: 14,
        kv_heads: 2,
        head_dim: 64,
        ffn: 4864,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 32768,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 32768, max_window_layers: 21 },
    },
    ShapeSpec {
        name: "qwen2.5-1.5b",
        layers: 28,
        hidden: 1536,
        heads: 12,
        kv_heads: 2,
        head_dim: 128,
        ffn: 8960,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 32768,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 32768, max_window_layers: 21 },
    },
    ShapeSpec {
        name: "qwen2.5-7b",
        layers: 28,
        hidden: 3584,
        heads: 28,
        kv_heads: 4,
        head_dim: 128,
        ffn: 18944,
        vocab: 152064,
        tied: false,
        theta: 1e6,
        max_position: 32768,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: HubExtras { sliding_window: 131072, max_window_layers: 28 },
    },
    ShapeSpec {
        name: "deepseek-r1-distill-qwen-1.5b",
        layers: 28,
        hidden: 1536,
        heads: 12,
        kv_heads: 2,
        head_dim: 128,
        ffn: 8960,
        vocab: 151936,
        tied: false,
        theta: 1e4,
        max_position: 131072,
        bos: 151646,
        eos: 151643,
        generation_eos: &[151643],
        extras: HubExtras { sliding_window: 4096, max_window_layers: 21 },
    },
];

pub(super) fn spec(name: &str) -> Result<&'static ShapeSpec> {
    SPECS
        .iter()
        .find(|s| s.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| ModelError::Config(format!("unknown model shape {name:?} (known: {})", SHAPES.join(", "))))
}

/// The config of a known shape (see [`SHAPES`]); `torch_dtype` is "bfloat16" as the real ones.
pub fn shape_config(name: &str) -> Result<Qwen2Config> {
    let s = spec(name)?;
    Ok(Qwen2Config {
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.ffn,
        num_hidden_layers: s.layers,
        num_attention_heads: s.heads,
        num_key_value_heads: s.kv_heads,
        head_dim: s.head_dim,
        max_position_embeddings: s.max_position,
        rms_norm_eps: 1e-6,
        rope: RopeConfig { theta: s.theta, scaling: RopeScaling::None },
        tie_word_embeddings: s.tied,
        // Every shape ships `use_sliding_window: false`: no layer slides.
        sliding_window_layers: vec![None; s.layers],
        bos_token_id: Some(s.bos),
        eos_token_ids: vec![s.eos],
        torch_dtype: Some("bfloat16".into()),
    })
}

/// What a hub config.json carries that [`Qwen2Config`] normalises away: the window a model
/// declares even when `use_sliding_window` is false (DeepSeek-R1-Distill's 4096, for instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HubExtras {
    pub sliding_window: usize,
    pub max_window_layers: usize,
}

/// The [`HubExtras`] of a known shape.
pub fn shape_extras(name: &str) -> Result<HubExtras> {
    Ok(spec(name)?.extras)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_shape_lists_the_known_ones() {
        let e = shape_config("llama-7b").unwrap_err().to_string();
        assert!(e.contains("llama-7b") && SHAPES.iter().all(|s| e.contains(s)), "{e}");
    }
}
