//! The real models `flint synth` can imitate: each one's geometry, and what its hub files say
//! beyond [`ModelConfig`].

use crate::config::{Family, ModelConfig, MoeConfig, RopeConfig, RopeScaling};
use crate::error::{ModelError, Result};

/// The shapes [`shape_config`] knows.
pub const SHAPES: &[&str] = &[
    "tiny",
    "tiny-qwen3",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-7b",
    "deepseek-r1-distill-qwen-1.5b",
    "qwen3-0.6b",
    "qwen3-4b",
    "qwen3-8b",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "mistral-7b",
    "tiny-qwen3-moe",
    "qwen2-moe-small",
    "qwen3-30b-a3b",
];

/// One real model's geometry, plus what its hub files say beyond [`ModelConfig`].
pub(super) struct ShapeSpec {
    pub(super) name: &'static str,
    family: Family,
    rms_norm_eps: f64,
    /// Llama 3.1's `llama3` RoPE scaling: (factor, low_freq_factor, high_freq_factor, original).
    llama3_rope: Option<(f64, f64, f64, usize)>,
    /// Mistral's window over every layer.
    window: Option<usize>,
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
    /// A mixture of experts on every layer.
    experts: Option<ExpertsSpec>,
}

/// A shape's experts: how many, how many per token, each one's size, whether the chosen weights
/// are renormalised, and Qwen2-MoE's shared expert.
struct ExpertsSpec {
    count: usize,
    per_token: usize,
    size: usize,
    norm: bool,
    shared: Option<usize>,
}

const QWEN25_GEN_EOS: &[u32] = &[151645, 151643];
const LLAMA3_GEN_EOS: &[u32] = &[128001, 128008, 128009];
/// Qwen's window keys, as every Qwen3 checkpoint writes them (unused: `use_sliding_window` false).
const QWEN3_EXTRAS: HubExtras = HubExtras { sliding_window: 32768, max_window_layers: 28 };
/// Not written for Llama and Mistral (they have no such keys).
const NO_EXTRAS: HubExtras = HubExtras { sliding_window: 0, max_window_layers: 0 };

const SPECS: &[ShapeSpec] = &[
    ShapeSpec {
        family: Family::Qwen2,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
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
        experts: None,
    },
    ShapeSpec {
        family: Family::Qwen2,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
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
        experts: None,
    },
    ShapeSpec {
        family: Family::Qwen2,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
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
        experts: None,
    },
    ShapeSpec {
        family: Family::Qwen2,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
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
        experts: None,
    },
    ShapeSpec {
        family: Family::Qwen2,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
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
        experts: None,
    },
    ShapeSpec {
        // Qwen3's switches at test size: head_dim 32 with hidden 64 and 4 heads (not 16).
        name: "tiny-qwen3",
        family: Family::Qwen3,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        ffn: 128,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 4096,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: QWEN3_EXTRAS,
        experts: None,
    },
    ShapeSpec {
        name: "qwen3-0.6b",
        family: Family::Qwen3,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
        layers: 28,
        hidden: 1024,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        ffn: 3072,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 40960,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: QWEN3_EXTRAS,
        experts: None,
    },
    ShapeSpec {
        name: "qwen3-4b",
        family: Family::Qwen3,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
        layers: 36,
        hidden: 2560,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 9728,
        vocab: 151936,
        tied: true,
        theta: 1e6,
        max_position: 40960,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: QWEN3_EXTRAS,
        experts: None,
    },
    ShapeSpec {
        name: "qwen3-8b",
        family: Family::Qwen3,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
        layers: 36,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 12288,
        vocab: 151936,
        tied: false,
        theta: 1e6,
        max_position: 40960,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: QWEN3_EXTRAS,
        experts: None,
    },
    ShapeSpec {
        name: "llama-3.2-1b",
        family: Family::Llama,
        rms_norm_eps: 1e-5,
        llama3_rope: Some((32.0, 1.0, 4.0, 8192)),
        window: None,
        layers: 16,
        hidden: 2048,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        ffn: 8192,
        vocab: 128256,
        tied: true,
        theta: 500000.0,
        max_position: 131072,
        bos: 128000,
        eos: 128009,
        generation_eos: LLAMA3_GEN_EOS,
        extras: NO_EXTRAS,
        experts: None,
    },
    ShapeSpec {
        name: "llama-3.1-8b",
        family: Family::Llama,
        rms_norm_eps: 1e-5,
        llama3_rope: Some((8.0, 1.0, 4.0, 8192)),
        window: None,
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        vocab: 128256,
        tied: false,
        theta: 500000.0,
        max_position: 131072,
        bos: 128000,
        eos: 128009,
        generation_eos: LLAMA3_GEN_EOS,
        extras: NO_EXTRAS,
        experts: None,
    },
    ShapeSpec {
        // Mistral 7B v0.1: the one with a 4096-token window on every layer.
        name: "mistral-7b",
        family: Family::Mistral,
        rms_norm_eps: 1e-5,
        llama3_rope: None,
        window: Some(4096),
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        vocab: 32000,
        tied: false,
        theta: 10000.0,
        max_position: 32768,
        bos: 1,
        eos: 2,
        generation_eos: &[2],
        extras: NO_EXTRAS,
        experts: None,
    },
    ShapeSpec {
        // A mixture of experts at test size: Qwen3 attention, 8 experts of 32, 2 per token.
        name: "tiny-qwen3-moe",
        family: Family::Qwen3,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        ffn: 128,
        vocab: 151936,
        tied: false,
        theta: 1e6,
        max_position: 4096,
        bos: 151643,
        eos: 151645,
        generation_eos: QWEN25_GEN_EOS,
        extras: QWEN3_EXTRAS,
        experts: Some(ExpertsSpec { count: 8, per_token: 2, size: 32, norm: true, shared: None }),
    },
    ShapeSpec {
        // Qwen1.5-MoE-A2.7B's layout (60 experts, 4 per token, a gated shared expert of 4× an
        // expert, no renormalisation) scaled down to ~0.5B parameters, for quick MoE runs.
        name: "qwen2-moe-small",
        family: Family::Qwen2,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
        layers: 12,
        hidden: 1024,
        heads: 16,
        kv_heads: 16,
        head_dim: 64,
        ffn: 2816,
        vocab: 151936,
        tied: false,
        theta: 1e6,
        max_position: 8192,
        bos: 151643,
        eos: 151643,
        generation_eos: &[151643],
        extras: HubExtras { sliding_window: 8192, max_window_layers: 12 },
        experts: Some(ExpertsSpec { count: 60, per_token: 4, size: 256, norm: false, shared: Some(1024) }),
    },
    ShapeSpec {
        // Qwen3-30B-A3B: 30.5B parameters, 3.3B read per token.
        name: "qwen3-30b-a3b",
        family: Family::Qwen3,
        rms_norm_eps: 1e-6,
        llama3_rope: None,
        window: None,
        layers: 48,
        hidden: 2048,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        ffn: 6144,
        vocab: 151936,
        tied: false,
        theta: 1e6,
        max_position: 40960,
        bos: 151643,
        eos: 151645,
        generation_eos: &[151645, 151643],
        extras: HubExtras { sliding_window: 32768, max_window_layers: 48 },
        experts: Some(ExpertsSpec { count: 128, per_token: 8, size: 768, norm: true, shared: None }),
    },
];

pub(super) fn spec(name: &str) -> Result<&'static ShapeSpec> {
    SPECS
        .iter()
        .find(|s| s.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| ModelError::Config(format!("unknown model shape {name:?} (known: {})", SHAPES.join(", "))))
}

/// The config of a known shape (see [`SHAPES`]); `torch_dtype` is "bfloat16" as the real ones.
pub fn shape_config(name: &str) -> Result<ModelConfig> {
    let s = spec(name)?;
    let scaling = match s.llama3_rope {
        Some((factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)) => {
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }
        }
        None => RopeScaling::None,
    };
    Ok(ModelConfig {
        family: s.family,
        qkv_bias: s.family == Family::Qwen2,
        o_bias: false,
        qk_norm: s.family == Family::Qwen3,
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.ffn,
        num_hidden_layers: s.layers,
        num_attention_heads: s.heads,
        num_key_value_heads: s.kv_heads,
        head_dim: s.head_dim,
        max_position_embeddings: s.max_position,
        rms_norm_eps: s.rms_norm_eps,
        rope: RopeConfig { theta: s.theta, scaling },
        tie_word_embeddings: s.tied,
        // Every Qwen shape ships `use_sliding_window: false`: no layer slides; Mistral 7B's all do.
        sliding_window_layers: vec![s.window; s.layers],
        bos_token_id: Some(s.bos),
        eos_token_ids: vec![s.eos],
        torch_dtype: Some("bfloat16".into()),
        moe: s.experts.as_ref().map(|e| MoeConfig {
            num_experts: e.count,
            num_experts_per_tok: e.per_token,
            moe_intermediate_size: e.size,
            norm_topk_prob: e.norm,
            shared_expert_intermediate_size: e.shared,
            sparse_layers: vec![true; s.layers],
        }),
    })
}

/// What a hub config.json carries that [`ModelConfig`] normalises away: the window a model
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
        let e = shape_config("gemma-7b").unwrap_err().to_string();
        assert!(e.contains("gemma-7b") && SHAPES.iter().all(|s| e.contains(s)), "{e}");
    }
}
