//! `config.json` of a Llama-like checkpoint (Qwen2, Qwen3, Llama, Mistral), read the way real
//! checkpoints write it. The families differ in a few switches ([`Family`], the biases, the
//! per-head q/k norm, the RoPE scaling kind, the sliding window), all normalised here so the
//! forward pass (`decoder`) reads one [`ModelConfig`].
//!
//! Three RoPE layouts exist in the wild: top-level `rope_theta` + `rope_scaling` with `type`
//! (most hub checkpoints), the same with `rope_type` (transformers ≥ 4.45), and transformers 5's
//! `rope_parameters` object that carries `rope_theta` itself. All three normalise to [`RopeConfig`].

use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

use crate::error::{ModelError, Result};
use crate::gguf_scan::{shown, shown_up_to};

/// The architectures flint runs: one decoder, these switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Biased q/k/v, sliding window only with `use_sliding_window`.
    Qwen2,
    /// No biases (unless `attention_bias`), RMSNorm over each q and k head before RoPE,
    /// `head_dim` from the config (128 when absent, as transformers' default).
    Qwen3,
    /// No biases (unless `attention_bias`), `llama3` RoPE scaling; no sliding window.
    Llama,
    /// Llama's layers with a sliding window over every layer when `sliding_window` is set.
    Mistral,
}

impl Family {
    pub const ALL: [Family; 4] = [Family::Qwen2, Family::Qwen3, Family::Llama, Family::Mistral];

    /// The `architectures` entry of config.json.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
        }
    }

    /// config.json's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Llama => "llama",
            Family::Mistral => "mistral",
        }
    }

    /// GGUF's `general.architecture`: llama.cpp writes Mistral checkpoints as `llama`.
    pub fn gguf_architecture(self) -> &'static str {
        match self {
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Llama | Family::Mistral => "llama",
        }
    }

    fn from_architecture(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.architecture() == name)
    }

    fn from_model_type(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model_type() == name)
    }

    /// Whether llama.cpp's converter permuted the rows of `attn_q`/`attn_k` (interleaved RoPE
    /// pairs instead of halves) when it wrote this family's GGUF.
    pub fn gguf_permutes_qk(self) -> bool {
        matches!(self, Family::Llama | Family::Mistral)
    }
}

/// Mixture-of-experts architectures: the attention of a family, sparse feed-forward layers.
/// (config.json's `architectures`, its `model_type`, the family, GGUF's `general.architecture`)
const MOE_ARCHITECTURES: [(&str, &str, Family, &str); 2] = [
    ("Qwen3MoeForCausalLM", "qwen3_moe", Family::Qwen3, "qwen3moe"),
    ("Qwen2MoeForCausalLM", "qwen2_moe", Family::Qwen2, "qwen2moe"),
];

/// The family of a mixture-of-experts GGUF `general.architecture` (`qwen3moe`, `qwen2moe`).
pub fn moe_family_of_gguf_architecture(arch: &str) -> Option<Family> {
    MOE_ARCHITECTURES.iter().find(|m| m.3 == arch).map(|m| m.2)
}

/// Every architecture flint accepts, for the error that refuses another.
pub fn supported_architectures() -> String {
    let moe = MOE_ARCHITECTURES.map(|m| m.0);
    Family::ALL.map(Family::architecture).into_iter().chain(moe).collect::<Vec<_>>().join(", ")
}

/// The family and whether it is a mixture of experts, from config.json's `architectures`.
fn from_architecture(name: &str) -> Option<(Family, bool)> {
    Family::from_architecture(name)
        .map(|f| (f, false))
        .or_else(|| MOE_ARCHITECTURES.iter().find(|m| m.0 == name).map(|m| (m.2, true)))
}

/// The same from `model_type`, for a config.json without `architectures`.
fn from_model_type(name: &str) -> Option<(Family, bool)> {
    Family::from_model_type(name)
        .map(|f| (f, false))
        .or_else(|| MOE_ARCHITECTURES.iter().find(|m| m.1 == name).map(|m| (m.2, true)))
}

/// Geometry and numerics of one model, whatever file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    /// Biases on q_proj, k_proj and v_proj.
    pub qkv_bias: bool,
    /// A bias on o_proj (Llama and Qwen3 with `attention_bias: true`).
    pub o_bias: bool,
    /// Qwen3's RMSNorm over each query and key head (`q_norm`, `k_norm`) before RoPE.
    pub qk_norm: bool,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    pub tie_word_embeddings: bool,
    /// Per layer: `Some(window)` where sliding-window attention applies. Only ever set when the
    /// checkpoint says `use_sliding_window: true` (DeepSeek-R1-Distill ships a window it must not use).
    pub sliding_window_layers: Vec<Option<usize>>,
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` from config.json; generation_config.json may add more (see `GenerationConfig`).
    pub eos_token_ids: Vec<u32>,
    /// `torch_dtype` / `dtype` as written, informational.
    pub torch_dtype: Option<String>,
    /// Mixture-of-experts feed-forward layers (Qwen3-MoE, Qwen2-MoE); `None` for dense models.
    pub moe: Option<MoeConfig>,
}

/// The sparse feed-forward of a mixture-of-experts checkpoint: each token goes to the top
/// `num_experts_per_tok` of `num_experts` SwiGLU experts by the softmax of the router's logits.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    /// Each expert's intermediate size.
    pub moe_intermediate_size: usize,
    /// Renormalise the chosen experts' probabilities to sum to 1.
    pub norm_topk_prob: bool,
    /// Qwen2-MoE's shared expert (always on, gated by a sigmoid of `shared_expert_gate`).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Per layer: whether its MLP is the sparse one (`decoder_sparse_step`, `mlp_only_layers`);
    /// the others are dense MLPs of `intermediate_size`.
    pub sparse_layers: Vec<bool>,
}

impl ModelConfig {
    /// config.json's `architectures` entry and `model_type` for this config: the family's, or
    /// its mixture of experts'.
    pub fn architecture(&self) -> (&'static str, &'static str) {
        self.moe_architecture().map_or((self.family.architecture(), self.family.model_type()), |m| (m.0, m.1))
    }

    /// GGUF's `general.architecture` for this config: the family's, or its mixture of experts'.
    pub fn gguf_architecture(&self) -> &'static str {
        self.moe_architecture().map_or(self.family.gguf_architecture(), |m| m.3)
    }

    fn moe_architecture(&self) -> Option<&'static (&'static str, &'static str, Family, &'static str)> {
        MOE_ARCHITECTURES.iter().find(|m| m.2 == self.family).filter(|_| self.moe.is_some())
    }
}

impl MoeConfig {
    /// Whether layer `l` routes its tokens to experts.
    pub fn is_sparse(&self, l: usize) -> bool {
        self.sparse_layers.get(l).copied().unwrap_or(false)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Per-frequency divisors as llama.cpp stores Llama 3's scaling in a GGUF (`rope_freqs`).
    FreqFactors(Vec<f32>),
    /// YaRN as transformers computes it ("static": the same tables at every length).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        /// Explicit `attention_factor`, or the one derived from `mscale`/`mscale_all_dim`.
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        /// transformers rounds the correction range to integers unless `truncate: false`.
        truncate: bool,
    },
}

/// The raw JSON, lenient about which optional keys exist.
#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    original_max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    use_sliding_window: bool,
    /// `None` when absent, `Some(None)` when null: Mistral's default window applies only when absent.
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<Option<usize>>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: bool,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    hidden_act: Option<String>,
    /// Mixture of experts (transformers 5 writes `num_local_experts`).
    #[serde(alias = "num_local_experts")]
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    norm_topk_prob: bool,
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    shared_expert_intermediate_size: Option<usize>,
    /// Qwen2-MoE's switch for the q/k/v biases (true when absent, as transformers).
    qkv_bias: Option<bool>,
}

/// A key that is present (possibly null), as distinct from one that is absent.
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> std::result::Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

fn default_max_pos() -> usize {
    32768
}
fn default_eps() -> f64 {
    1e-6
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json_str(&text).map_err(|e| e.in_file(path))
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("invalid config.json: {}", shown_up_to(&e.to_string(), 400))))?;
        let (family, sparse) = match raw.architectures.iter().find_map(|a| from_architecture(a)) {
            Some(f) => f,
            None if raw.architectures.is_empty() => {
                raw.model_type.as_deref().and_then(from_model_type).ok_or_else(|| {
                    ModelError::UnsupportedArchitecture(format!(
                        "model_type \"{}\"; flint supports {}",
                        shown(raw.model_type.as_deref().unwrap_or_default()),
                        supported_architectures()
                    ))
                })?
            }
            None => {
                let names: Vec<String> =
                    raw.architectures.iter().take(8).map(|a| format!("\"{}\"", shown(a))).collect();
                return Err(ModelError::UnsupportedArchitecture(format!(
                    "architectures [{}]; flint supports {}",
                    names.join(", "),
                    supported_architectures()
                )));
            }
        };
        if raw.mlp_bias {
            return Err(ModelError::Config("mlp_bias true is not supported (no published Llama uses it)".into()));
        }
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(ModelError::Config(format!(
                    "hidden_act \"{}\" is not supported (only \"silu\")",
                    shown(act)
                )));
            }
        }
        if raw.num_attention_heads == 0
            || (!raw.hidden_size.is_multiple_of(raw.num_attention_heads)
                && raw.head_dim.is_none()
                && family != Family::Qwen3)
        {
            return Err(ModelError::Config(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                raw.hidden_size, raw.num_attention_heads
            )));
        }
        let num_kv = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv == 0 || !raw.num_attention_heads.is_multiple_of(num_kv) {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv}",
                raw.num_attention_heads
            )));
        }
        // transformers' Qwen3Config defaults head_dim to 128, not hidden / heads.
        let default_head_dim = match family {
            Family::Qwen3 => 128,
            _ => raw.hidden_size / raw.num_attention_heads,
        };
        let head_dim = raw.head_dim.unwrap_or(default_head_dim);
        check_geometry(
            raw.num_hidden_layers,
            raw.hidden_size,
            raw.num_attention_heads,
            num_kv,
            head_dim,
            raw.intermediate_size,
            raw.vocab_size,
        )?;
        let rope = parse_rope(
            raw.rope_theta,
            raw.rope_scaling.as_ref(),
            raw.rope_parameters.as_ref(),
            raw.original_max_position_embeddings.unwrap_or(raw.max_position_embeddings),
            raw.max_position_embeddings,
        )?;

        let n = raw.num_hidden_layers;
        let sliding_window_layers = sliding_layers(&raw, family, n)?;
        let attention_bias = raw.attention_bias.unwrap_or(false);
        let cfg = Self {
            family,
            qkv_bias: (family == Family::Qwen2 && raw.qkv_bias != Some(false))
                || (attention_bias && family != Family::Mistral),
            o_bias: attention_bias && matches!(family, Family::Llama | Family::Qwen3),
            qk_norm: family == Family::Qwen3,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: n,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: num_kv,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            rope,
            tie_word_embeddings: raw.tie_word_embeddings,
            sliding_window_layers,
            bos_token_id: raw.bos_token_id.as_ref().and_then(|v| token_ids(v).first().copied()),
            eos_token_ids: raw.eos_token_id.as_ref().map(token_ids).unwrap_or_default(),
            moe: if sparse { Some(moe_config(&raw, family)?) } else { None },
            torch_dtype: raw.torch_dtype.or(raw.dtype),
        };
        cfg.check_numbers()?;
        Ok(cfg)
    }

    /// The numbers geometry checks do not cover: RoPE and norm parameters must be finite and
    /// positive (a NaN or zero would turn every logit into NaN rather than fail), the context
    /// and any sliding window at least one token.
    pub fn check_numbers(&self) -> Result<()> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ModelError::Config(format!("{name} {v} must be a finite number > 0")))
            }
        };
        let finite = |name: &str, v: Option<f64>| match v {
            Some(x) if !x.is_finite() => Err(ModelError::Config(format!("{name} {x} must be finite"))),
            _ => Ok(()),
        };
        positive("rope_theta", self.rope.theta)?;
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(ModelError::Config(format!("rms_norm_eps {} must be a finite number >= 0", self.rms_norm_eps)));
        }
        if self.max_position_embeddings == 0 {
            return Err(ModelError::Config("max_position_embeddings must be at least 1".into()));
        }
        if self.sliding_window_layers.contains(&Some(0)) {
            return Err(ModelError::Config("sliding_window must be at least 1".into()));
        }
        match &self.rope.scaling {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("rope_scaling.factor", *factor),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                positive("rope_scaling.factor", *factor)?;
                positive("rope_scaling.low_freq_factor", *low_freq_factor)?;
                positive("rope_scaling.high_freq_factor", *high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(ModelError::Config(format!(
                        "rope_scaling.high_freq_factor {high_freq_factor} must exceed low_freq_factor {low_freq_factor}"
                    )));
                }
                positive("rope_scaling.original_max_position_embeddings", *original_max_position_embeddings as f64)
            }
            RopeScaling::FreqFactors(f) => {
                if f.len() * 2 != self.head_dim {
                    return Err(ModelError::Config(format!(
                        "rope_freqs has {} entries for head_dim {}",
                        f.len(),
                        self.head_dim
                    )));
                }
                match f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                    Some(x) => Err(ModelError::Config(format!("rope_freqs entry {x} must be a finite number > 0"))),
                    None => Ok(()),
                }
            }
            RopeScaling::Yarn { factor, beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, .. } => {
                positive("rope_scaling.factor", *factor)?;
                finite("rope_scaling.beta_fast", Some(*beta_fast))?;
                finite("rope_scaling.beta_slow", Some(*beta_slow))?;
                finite("rope_scaling.attention_factor", *attention_factor)?;
                finite("rope_scaling.mscale", *mscale)?;
                finite("rope_scaling.mscale_all_dim", *mscale_all_dim)
            }
        }
    }

    /// The longest sequence the model serves. Qwen2.5 enables 128K by adding YaRN ×4 over
    /// `original_max_position_embeddings` 32768 while leaving `max_position_embeddings` at 32768,
    /// so with YaRN the scaled length counts (as vLLM derives it).
    pub fn max_context_len(&self) -> usize {
        match &self.rope.scaling {
            RopeScaling::Yarn { factor, original_max_position_embeddings, .. } => {
                let scaled = (*original_max_position_embeddings as f64 * factor.max(1.0)) as usize;
                self.max_position_embeddings.max(scaled)
            }
            _ => self.max_position_embeddings,
        }
    }

    /// Bytes of K and V per token for the whole model at `bytes_per_elem`.
    pub fn kv_bytes_per_token(&self, bytes_per_elem: usize) -> usize {
        2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_elem
    }
}

/// transformers' rules. Qwen2 and Qwen3 (4.45+ and 5.x): a layer slides only when
/// `use_sliding_window` is true, a window is given, and the layer index is at least
/// `max_window_layers`, unless `layer_types` spells it out per layer. Mistral: every layer
/// slides when `sliding_window` is a number (Mistral 7B v0.1's 4096; later ones write null).
/// Llama: no window.
fn sliding_layers(raw: &RawConfig, family: Family, n: usize) -> Result<Vec<Option<usize>>> {
    // transformers' Qwen2Config defaults: sliding_window 4096, max_window_layers 28.
    let window = match family {
        Family::Qwen2 | Family::Qwen3 if raw.use_sliding_window => Some(raw.sliding_window.flatten().unwrap_or(4096)),
        // transformers' MistralConfig: 4096 when the key is absent, none when it is null.
        Family::Mistral => raw.sliding_window.unwrap_or(Some(4096)),
        _ => None,
    };
    let Some(window) = window else {
        return Ok(vec![None; n]);
    };
    if window == 0 {
        return Err(ModelError::Config("sliding_window must be at least 1 when use_sliding_window is true".into()));
    }
    if let Some(types) = &raw.layer_types {
        if types.len() != n {
            return Err(ModelError::Config(format!(
                "layer_types has {} entries but num_hidden_layers is {n}",
                types.len()
            )));
        }
        return Ok(types.iter().map(|t| (t == "sliding_attention").then_some(window)).collect());
    }
    if family == Family::Mistral {
        return Ok(vec![Some(window); n]);
    }
    let first = raw.max_window_layers.unwrap_or(28);
    Ok((0..n).map(|i| (i >= first).then_some(window)).collect())
}

/// The experts of a Qwen3-MoE / Qwen2-MoE config.json, bounded like the rest of the geometry.
/// transformers' defaults: Qwen3-MoE 128 experts of 768, 8 per token, sparse step 1; Qwen2-MoE
/// 60 of 1408, 4 per token, a shared expert of 5632.
fn moe_config(raw: &RawConfig, family: Family) -> Result<MoeConfig> {
    let qwen3 = family == Family::Qwen3;
    let step = raw.decoder_sparse_step.unwrap_or(1);
    bounded("decoder_sparse_step", step, raw.num_hidden_layers.max(1))?;
    MoeConfig {
        num_experts: raw.num_experts.unwrap_or(if qwen3 { 128 } else { 60 }),
        num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(if qwen3 { 8 } else { 4 }),
        moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(if qwen3 { 768 } else { 1408 }),
        norm_topk_prob: raw.norm_topk_prob,
        shared_expert_intermediate_size: if qwen3 {
            None
        } else {
            Some(raw.shared_expert_intermediate_size.unwrap_or(5632))
        },
        sparse_layers: (0..raw.num_hidden_layers)
            .map(|l| !raw.mlp_only_layers.contains(&l) && (l + 1) % step == 0)
            .collect(),
    }
    .checked()
}

impl MoeConfig {
    /// `self` when its numbers are in range (from config.json or a GGUF alike).
    pub(crate) fn checked(self) -> Result<Self> {
        bounded("num_experts", self.num_experts, 4096)?;
        bounded("num_experts_per_tok", self.num_experts_per_tok, self.num_experts)?;
        bounded("moe_intermediate_size", self.moe_intermediate_size, 1 << 20)?;
        if let Some(s) = self.shared_expert_intermediate_size {
            bounded("shared_expert_intermediate_size", s, 1 << 20)?;
        }
        Ok(self)
    }
}

/// `v` in `1..=max`, or an error naming the key.
fn bounded(name: &str, v: usize, max: usize) -> Result<()> {
    if v == 0 || v > max {
        Err(ModelError::Config(format!("{name} {v} is out of range (1..={max})")))
    } else {
        Ok(())
    }
}

/// Token ids as written (a number or a list); ids that do not fit u32 are dropped rather
/// than truncated into some other token.
fn token_ids(v: &Value) -> Vec<u32> {
    let one = |x: &Value| x.as_u64().and_then(|u| u32::try_from(u).ok());
    match v {
        Value::Array(items) => items.iter().filter_map(one).collect(),
        other => one(other).into_iter().collect(),
    }
}

/// Geometry a real checkpoint can have, checked before anything is sized from it, so a corrupt
/// or hostile config is an error line rather than an allocation failure or an overflow.
pub(crate) fn check_geometry(
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
) -> Result<()> {
    bounded("num_hidden_layers", layers, 1024)?;
    bounded("hidden_size", hidden, 1 << 17)?;
    bounded("num_attention_heads", heads, 1024)?;
    bounded("num_key_value_heads", kv_heads, heads)?;
    bounded("head_dim", head_dim, 1024)?;
    bounded("intermediate_size", intermediate, 1 << 20)?;
    bounded("vocab_size", vocab, 1 << 24)?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(ModelError::Config(format!(
            "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )));
    }
    if !head_dim.is_multiple_of(2) {
        return Err(ModelError::Config(format!("head_dim {head_dim} must be even for RoPE")));
    }
    Ok(())
}

/// `default_original`: what transformers falls back to when `rope_scaling` has no
/// `original_max_position_embeddings` (the top-level key, else `max_position_embeddings`).
fn parse_rope(
    theta: Option<f64>,
    scaling: Option<&Value>,
    parameters: Option<&Value>,
    default_original: usize,
    max_position_embeddings: usize,
) -> Result<RopeConfig> {
    // transformers 5 puts everything (theta included) in `rope_parameters`.
    let (theta, scaling) = match parameters {
        Some(p @ Value::Object(obj)) => {
            let t = obj.get("rope_theta").and_then(Value::as_f64).or(theta);
            (t, Some(p))
        }
        _ => (theta, scaling),
    };
    let theta = theta.unwrap_or(10000.0);
    let scaling = match scaling {
        None | Some(Value::Null) => RopeScaling::None,
        Some(Value::Object(obj)) => {
            let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("default");
            let f = |k: &str| obj.get(k).and_then(Value::as_f64);
            match kind {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: need(f("factor"), "factor")? },
                "yarn" => {
                    let original =
                        f("original_max_position_embeddings").map(|x| x as usize).unwrap_or(default_original);
                    if original == 0 {
                        return Err(ModelError::Config(
                            "rope_scaling.original_max_position_embeddings must be > 0".into(),
                        ));
                    }
                    // transformers: a missing factor is the ratio of the two context lengths.
                    let factor = f("factor").unwrap_or(max_position_embeddings as f64 / original as f64);
                    yarn(obj, factor, original)
                }
                "llama3" => RopeScaling::Llama3 {
                    factor: need(f("factor"), "factor")?,
                    low_freq_factor: need(f("low_freq_factor"), "low_freq_factor")?,
                    high_freq_factor: need(f("high_freq_factor"), "high_freq_factor")?,
                    original_max_position_embeddings: need(
                        f("original_max_position_embeddings"),
                        "original_max_position_embeddings",
                    )? as usize,
                },
                other => {
                    return Err(ModelError::Config(format!(
                        "rope_scaling type \"{}\" is not supported (supported: default, linear, yarn, llama3)",
                        shown(other)
                    )))
                }
            }
        }
        Some(other) => {
            return Err(ModelError::Config(format!(
                "rope_scaling must be an object, got {}",
                shown(&other.to_string())
            )))
        }
    };
    Ok(RopeConfig { theta, scaling })
}

fn yarn(obj: &serde_json::Map<String, Value>, factor: f64, original: usize) -> RopeScaling {
    let f = |k: &str| obj.get(k).and_then(Value::as_f64);
    RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        // transformers uses `or`: a null or 0 beta falls back to the paper's defaults.
        beta_fast: f("beta_fast").filter(|b| *b != 0.0).unwrap_or(32.0),
        beta_slow: f("beta_slow").filter(|b| *b != 0.0).unwrap_or(1.0),
        attention_factor: f("attention_factor"),
        mscale: f("mscale"),
        mscale_all_dim: f("mscale_all_dim"),
        truncate: obj.get("truncate").and_then(Value::as_bool).unwrap_or(true),
    }
}

fn need(v: Option<f64>, key: &str) -> Result<f64> {
    v.ok_or_else(|| ModelError::Config(format!("rope_scaling.{key} is missing")))
}

/// `generation_config.json`: the stop ids that matter for serving.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f64>,
}

impl GenerationConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: invalid JSON: {e}", path.display())))?;
        Ok(Self {
            eos_token_ids: v.get("eos_token_id").map(token_ids).unwrap_or_default(),
            bos_token_id: v.get("bos_token_id").and_then(|x| token_ids(x).first().copied()),
            temperature: v.get("temperature").and_then(Value::as_f64),
            top_p: v.get("top_p").and_then(Value::as_f64),
            top_k: v.get("top_k").and_then(Value::as_u64).map(|k| k as usize),
            repetition_penalty: v.get("repetition_penalty").and_then(Value::as_f64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Map<String, Value> {
        serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
            "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
            "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096, "max_window_layers": 21,
            "use_sliding_window": false, "tie_word_embeddings": false, "bos_token_id": 151643,
            "eos_token_id": 151643, "torch_dtype": "bfloat16", "hidden_act": "silu"
        })
        .as_object()
        .cloned()
        .unwrap_or_default()
    }

    fn parse(m: &serde_json::Map<String, Value>) -> Result<ModelConfig> {
        ModelConfig::from_json_str(&Value::Object(m.clone()).to_string())
    }

    /// Qwen3-30B-A3B's config (`num_experts`), transformers 5's spelling (`num_local_experts`),
    /// Qwen2-MoE's defaults and shared expert, which layers are sparse, and what is refused.
    #[test]
    fn mixtures_of_experts_parse() {
        let mut m = base();
        m.insert("architectures".into(), serde_json::json!(["Qwen3MoeForCausalLM"]));
        for (k, v) in [
            ("model_type", serde_json::json!("qwen3_moe")),
            ("num_hidden_layers", serde_json::json!(48)),
            ("num_experts", serde_json::json!(128)),
            ("num_experts_per_tok", serde_json::json!(8)),
            ("moe_intermediate_size", serde_json::json!(768)),
            ("norm_topk_prob", serde_json::json!(true)),
            ("decoder_sparse_step", serde_json::json!(1)),
            ("mlp_only_layers", serde_json::json!([])),
        ] {
            m.insert(k.into(), v);
        }
        let c = parse(&m).unwrap();
        assert_eq!(c.family, Family::Qwen3);
        assert!(c.qk_norm && !c.qkv_bias);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size), (128, 8, 768));
        assert!(moe.norm_topk_prob && moe.shared_expert_intermediate_size.is_none());
        assert!(moe.sparse_layers.len() == 48 && moe.sparse_layers.iter().all(|&s| s));

        let mut v5 = m.clone();
        v5.remove("num_experts");
        v5.insert("num_local_experts".into(), serde_json::json!(16));
        v5.insert("decoder_sparse_step".into(), serde_json::json!(2));
        v5.insert("mlp_only_layers".into(), serde_json::json!([3]));
        let moe = parse(&v5).unwrap().moe.unwrap();
        assert_eq!(moe.num_experts, 16);
        assert_eq!(&moe.sparse_layers[..6], &[false, true, false, false, false, true]);

        let mut q2 = base();
        q2.insert("architectures".into(), serde_json::json!(["Qwen2MoeForCausalLM"]));
        let c = parse(&q2).unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!((c.family, c.qkv_bias), (Family::Qwen2, true));
        assert_eq!(
            (moe.num_experts, moe.num_experts_per_tok, moe.shared_expert_intermediate_size),
            (60, 4, Some(5632))
        );
        q2.insert("qkv_bias".into(), serde_json::json!(false));
        assert!(!parse(&q2).unwrap().qkv_bias);
        assert!(parse(&base()).unwrap().moe.is_none(), "dense stays dense");

        for (k, v, says) in [
            ("num_experts_per_tok", 129, "num_experts_per_tok 129"),
            ("num_experts", 0, "num_experts 0"),
            ("decoder_sparse_step", 0, "decoder_sparse_step 0"),
        ] {
            let mut bad = m.clone();
            bad.insert(k.into(), serde_json::json!(v));
            let e = parse(&bad).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let mut other = m.clone();
        other.insert("architectures".into(), serde_json::json!(["MixtralForCausalLM"]));
        let e = parse(&other).unwrap_err().to_string();
        assert!(e.contains("Qwen3MoeForCausalLM") && e.contains("MixtralForCausalLM"), "{e}");
    }

    #[test]
    fn r1_distill_geometry_and_no_window() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.kv_bytes_per_token(2), 28_672);
        assert!(
            c.sliding_window_layers.iter().all(Option::is_none),
            "use_sliding_window false must disable the window"
        );
        assert_eq!(c.eos_token_ids, vec![151643]);
    }

    #[test]
    fn sliding_window_from_max_window_layers() {
        let mut m = base();
        m.insert("use_sliding_window".into(), Value::Bool(true));
        let c = parse(&m).unwrap();
        assert_eq!(c.sliding_window_layers[20], None);
        assert_eq!(c.sliding_window_layers[21], Some(4096));
    }

    #[test]
    fn three_yarn_layouts_agree() {
        let mut a = base();
        a.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        );
        let mut b = base();
        b.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        );
        let mut c = base();
        c.remove("rope_theta");
        c.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32768}),
        );
        let (a, b, c) = (parse(&a).unwrap(), parse(&b).unwrap(), parse(&c).unwrap());
        let mut q = base();
        q.insert("max_position_embeddings".into(), serde_json::json!(32768));
        q.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        );
        assert_eq!(parse(&q).unwrap().max_context_len(), 131072, "Qwen2.5's 128K recipe: YaRN x4 over 32768");
        q.remove("rope_scaling");
        assert_eq!(parse(&q).unwrap().max_context_len(), 32768);
        assert!(matches!(a.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
        assert_eq!(a.rope, b.rope);
        assert_eq!(a.rope, c.rope);
    }

    #[test]
    fn default_rope_parameters_means_no_scaling() {
        let mut m = base();
        m.remove("rope_theta");
        m.insert("rope_parameters".into(), serde_json::json!({"rope_type": "default", "rope_theta": 1e6}));
        let c = parse(&m).unwrap();
        assert_eq!(c.rope, RopeConfig { theta: 1e6, scaling: RopeScaling::None });
    }

    #[test]
    fn unknown_architecture_is_named() {
        let mut m = base();
        m.insert("architectures".into(), serde_json::json!(["GemmaForCausalLM"]));
        let e = parse(&m).unwrap_err().to_string();
        assert!(
            e.contains("GemmaForCausalLM") && e.contains("Qwen3ForCausalLM") && e.contains("LlamaForCausalLM"),
            "{e}"
        );
    }

    fn family(arch: &str, model_type: &str, extra: Value) -> serde_json::Map<String, Value> {
        let mut m = base();
        m.insert("architectures".into(), serde_json::json!([arch]));
        m.insert("model_type".into(), serde_json::json!(model_type));
        for k in ["sliding_window", "max_window_layers", "use_sliding_window"] {
            m.remove(k);
        }
        if let Value::Object(extra) = extra {
            m.extend(extra);
        }
        m
    }

    #[test]
    fn llama3_scaling_reads_the_same_from_both_layouts() {
        let scaling = serde_json::json!({"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let mut classic = scaling.clone();
        classic["rope_type"] = "llama3".into();
        let mut v5 = scaling;
        v5["rope_type"] = "llama3".into();
        v5["rope_theta"] = 500000.0.into();
        let a =
            family("LlamaForCausalLM", "llama", serde_json::json!({"rope_theta": 500000.0, "rope_scaling": classic}));
        let mut b = family("LlamaForCausalLM", "llama", serde_json::json!({"rope_parameters": v5}));
        b.remove("rope_theta");
        let (a, b) = (parse(&a).unwrap(), parse(&b).unwrap());
        assert_eq!(a, b);
        assert_eq!(a.family, Family::Llama);
        assert!(!a.qkv_bias && !a.o_bias && !a.qk_norm);
        assert!(a.sliding_window_layers.iter().all(Option::is_none));
        assert!(matches!(
            a.rope.scaling,
            RopeScaling::Llama3 { factor: 32.0, original_max_position_embeddings: 8192, .. }
        ));
        assert_eq!(a.rope.theta, 500000.0);
        // attention_bias puts a bias on all four projections, as transformers' LlamaAttention.
        let biased = parse(&family("LlamaForCausalLM", "llama", serde_json::json!({"attention_bias": true}))).unwrap();
        assert!(biased.qkv_bias && biased.o_bias);
        let mut bad = family("LlamaForCausalLM", "llama", serde_json::json!({}));
        bad.insert("rope_scaling".into(), serde_json::json!({"rope_type": "llama3", "factor": 8.0}));
        assert!(parse(&bad).unwrap_err().to_string().contains("low_freq_factor"));
        let mlp = parse(&family("LlamaForCausalLM", "llama", serde_json::json!({"mlp_bias": true}))).unwrap_err();
        assert!(mlp.to_string().contains("mlp_bias"), "{mlp}");
    }

    #[test]
    fn mistral_window_follows_transformers_defaults() {
        let absent = parse(&family("MistralForCausalLM", "mistral", serde_json::json!({}))).unwrap();
        assert!(absent.sliding_window_layers.iter().all(|w| *w == Some(4096)), "absent key: 4096");
        let null =
            parse(&family("MistralForCausalLM", "mistral", serde_json::json!({"sliding_window": null}))).unwrap();
        assert!(null.sliding_window_layers.iter().all(Option::is_none), "null: no window");
        let set = parse(&family("MistralForCausalLM", "mistral", serde_json::json!({"sliding_window": 128}))).unwrap();
        assert!(set.sliding_window_layers.iter().all(|w| *w == Some(128)));
        assert_eq!(set.family, Family::Mistral);
        assert!(!set.qkv_bias);
    }

    #[test]
    fn qwen3_defaults_and_window() {
        let mut m = family("Qwen3ForCausalLM", "qwen3", serde_json::json!({}));
        m.remove("architectures");
        let c = parse(&m).unwrap();
        assert_eq!(c.family, Family::Qwen3, "model_type alone names the family");
        assert_eq!(c.head_dim, 128, "transformers' Qwen3 default, not hidden / heads (128 here too)");
        m.insert("hidden_size".into(), serde_json::json!(1024));
        m.insert("num_attention_heads".into(), serde_json::json!(16));
        assert_eq!(parse(&m).unwrap().head_dim, 128, "Qwen3-0.6B: 1024 / 16 would be 64");
        m.insert("num_attention_heads".into(), serde_json::json!(24));
        assert_eq!(parse(&m).unwrap().head_dim, 128, "hidden need not divide by the heads when head_dim is 128");
        m.insert("num_attention_heads".into(), serde_json::json!(16));
        assert!(c.qk_norm && !c.qkv_bias);
        m.insert("use_sliding_window".into(), serde_json::json!(true));
        m.insert("sliding_window".into(), serde_json::json!(512));
        m.insert("max_window_layers".into(), serde_json::json!(20));
        let c = parse(&m).unwrap();
        assert_eq!((c.sliding_window_layers[19], c.sliding_window_layers[20]), (None, Some(512)));
    }

    #[test]
    fn unsupported_rope_type_is_an_error() {
        let mut m = base();
        m.insert("rope_scaling".into(), serde_json::json!({"type": "longrope", "factor": 2.0}));
        assert!(parse(&m).unwrap_err().to_string().contains("longrope"));
    }
}
