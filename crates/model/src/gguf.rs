//! GGUF as llama.cpp writes it for the `qwen2`, `qwen3` and `llama` architectures and the
//! `qwen3moe`/`qwen2moe` mixtures: tensor names (`blk.N.attn_q.weight` for
//! `model.layers.N.self_attn.q_proj.weight`, `blk.N.ffn_up_exps.weight` for a layer's experts
//! merged) and the `<arch>.*` metadata keys that carry the config. llama.cpp keeps Qwen's q/k rows as they are (NeoX RoPE,
//! halves), but its converter permutes Llama's so that RoPE pairs are adjacent
//! ([`llama_cpp_row`]); the loader puts them back, so one forward pass serves both files.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{self, Value};

use crate::config::{Family, ModelConfig, MoeConfig, RopeConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::gguf_scan::shown;

/// (Hugging Face suffix inside `model.layers.N.`, GGUF suffix inside `blk.N.`)
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    // Mixtures of experts: the router, the experts merged into one 3-D tensor per projection
    // (llama.cpp's converter stacks `experts.{e}.*` under these names), Qwen2-MoE's shared expert.
    ("mlp.gate.weight", "ffn_gate_inp.weight"),
    ("mlp.experts.gate_proj.weight", "ffn_gate_exps.weight"),
    ("mlp.experts.up_proj.weight", "ffn_up_exps.weight"),
    ("mlp.experts.down_proj.weight", "ffn_down_exps.weight"),
    ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
];

/// Whether llama.cpp renormalises the chosen experts' weights for a family's mixture of experts
/// when the file does not say (`<arch>.expert_weights_norm`): its `qwen3moe` graph does, its
/// `qwen2moe` graph does not, as the two families' checkpoints are configured.
pub fn llama_cpp_expert_norm(family: Family) -> bool {
    family == Family::Qwen3
}

const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    (crate::gguf_export::ROPE_FREQS, "rope_freqs.weight"),
];

pub fn hf_to_gguf_name(hf: &str) -> String {
    if let Some((_, g)) = GLOBAL_NAMES.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        if let Some((idx, suffix)) = rest.split_once('.') {
            if let Some((_, g)) = LAYER_NAMES.iter().find(|(h, _)| *h == suffix) {
                return format!("blk.{idx}.{g}");
            }
        }
    }
    hf.to_string()
}

/// The GGUF row that holds row `row` of a checkpoint's q or k projection, for heads of
/// `head_dim` rows. llama.cpp's converter reshapes each head to (2, head_dim/2) and swaps the
/// axes, so the checkpoint's row `half·d/2 + i` of a head becomes its row `2i + half`.
pub fn llama_cpp_row(row: usize, head_dim: usize) -> usize {
    let (head, within) = (row / head_dim, row % head_dim);
    let (half, i) = (within / (head_dim / 2), within % (head_dim / 2));
    head * head_dim + 2 * i + half
}

/// Typed access to GGUF metadata with errors that name the key.
pub struct Meta<'a>(pub &'a HashMap<String, Value>);

impl Meta<'_> {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }
    pub fn string(&self, key: &str) -> Option<String> {
        self.0.get(key).and_then(|v| v.to_string().ok()).cloned()
    }
    pub fn u64(&self, key: &str) -> Option<u64> {
        self.0.get(key).and_then(value_as_u64)
    }
    pub fn f64(&self, key: &str) -> Option<f64> {
        self.0.get(key).and_then(|v| match v {
            Value::F32(x) => Some(*x as f64),
            Value::F64(x) => Some(*x),
            other => value_as_u64(other).map(|x| x as f64),
        })
    }
    /// A token id; one that does not fit u32 is dropped rather than truncated into another id.
    pub fn token_id(&self, key: &str) -> Option<u32> {
        self.u64(key).and_then(|x| u32::try_from(x).ok())
    }
    pub fn need_u64(&self, key: &str) -> Result<u64> {
        self.u64(key)
            .ok_or_else(|| ModelError::Config(format!("GGUF metadata key `{key}` is missing or not an integer")))
    }
    pub fn strings(&self, key: &str) -> Option<Vec<String>> {
        let v = self.0.get(key)?.to_vec().ok()?;
        v.iter().map(|x| x.to_string().ok().cloned()).collect()
    }
    pub fn floats(&self, key: &str) -> Option<Vec<f32>> {
        let v = self.0.get(key)?.to_vec().ok()?;
        v.iter()
            .map(|x| match x {
                Value::F32(f) => Some(*f),
                Value::F64(f) => Some(*f as f32),
                _ => None,
            })
            .collect()
    }
    pub fn ints(&self, key: &str) -> Option<Vec<i64>> {
        let v = self.0.get(key)?.to_vec().ok()?;
        v.iter().map(|x| value_as_u64(x).map(|u| u as i64).or_else(|| x.to_i32().ok().map(i64::from))).collect()
    }
}

fn value_as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

/// The tokenizer as llama.cpp stores it in GGUF metadata (`tokenizer.ggml.*`): byte-level BPE
/// (`model` "gpt2", `pre` "qwen2") with tokens in id order, their types (1 normal, 3 control,
/// 4 user-defined, …) and merges as "a b" strings. Padding ids past the tokenizer's length appear
/// as `[PAD<id>]` entries so the list is as long as the embedding.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufTokenizerMeta {
    pub model: String,
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// `pad_token` of tokenizer_config.json (Qwen: `<|endoftext|>`); the exporter falls back to eos.
    pub padding_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`: whether encoding with special tokens puts the BOS id
    /// first (Llama 3: true; Qwen: false or absent).
    pub add_bos_token: Option<bool>,
    pub chat_template: Option<String>,
    /// `tokenizer.ggml.scores`: SentencePiece's piece scores (model "llama"), which rank its merges.
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.add_space_prefix`: SentencePiece's dummy prefix, a `▁` before the text
    /// (absent: true, as llama.cpp assumes for model "llama").
    pub add_space_prefix: Option<bool>,
}

impl GgufTokenizerMeta {
    /// `None` when the file carries no tokenizer.
    pub fn from_metadata(meta: &HashMap<String, Value>) -> Option<Self> {
        let m = Meta(meta);
        let tokens = m.strings("tokenizer.ggml.tokens")?;
        Some(Self {
            model: m.string("tokenizer.ggml.model").unwrap_or_default(),
            pre: m.string("tokenizer.ggml.pre"),
            token_types: m
                .ints("tokenizer.ggml.token_type")
                .map(|v| v.into_iter().map(|x| x as i32).collect())
                .unwrap_or_else(|| vec![1; tokens.len()]),
            tokens,
            merges: m.strings("tokenizer.ggml.merges").unwrap_or_default(),
            bos_token_id: m.token_id("tokenizer.ggml.bos_token_id"),
            eos_token_id: m.token_id("tokenizer.ggml.eos_token_id"),
            padding_token_id: m.token_id("tokenizer.ggml.padding_token_id"),
            add_bos_token: match m.get("tokenizer.ggml.add_bos_token") {
                Some(Value::Bool(b)) => Some(*b),
                _ => None,
            },
            chat_template: m.string("tokenizer.chat_template"),
            scores: m.floats("tokenizer.ggml.scores").unwrap_or_default(),
            add_space_prefix: match m.get("tokenizer.ggml.add_space_prefix") {
                Some(Value::Bool(b)) => Some(*b),
                _ => None,
            },
        })
    }
}

/// Build the config from the `<arch>.*` keys; the vocabulary size comes from `token_embd.weight`.
/// Llama 3's RoPE scaling lives in the `rope_freqs.weight` tensor, which the caller reads
/// (see `source::Checkpoint::open_gguf`).
pub fn config_from_gguf(content: &gguf_file::Content) -> Result<ModelConfig> {
    let m = Meta(&content.metadata);
    let arch = m.string("general.architecture").unwrap_or_default();
    let family = match arch.as_str() {
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "llama" => Family::Llama,
        other => match crate::config::moe_family_of_gguf_architecture(other) {
            Some(family) => family,
            None => {
                return Err(ModelError::UnsupportedArchitecture(format!(
                    "general.architecture \"{}\"; flint supports \"qwen2\", \"qwen3\", \"llama\" (Llama, Mistral), \
                     \"qwen3moe\" and \"qwen2moe\"",
                    shown(other)
                )))
            }
        },
    };
    let is_moe = crate::config::moe_family_of_gguf_architecture(&arch).is_some();
    let k = |s: &str| format!("{arch}.{s}");
    let hidden = m.need_u64(&k("embedding_length"))? as usize;
    let heads = m.need_u64(&k("attention.head_count"))? as usize;
    let kv_heads = m.u64(&k("attention.head_count_kv")).map_or(heads, |x| x as usize);
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(ModelError::Config(format!("GGUF head counts {heads}/{kv_heads} are inconsistent")));
    }
    let head_dim = m.u64(&k("attention.key_length")).map_or(hidden / heads, |x| x as usize);
    let layers = m.need_u64(&k("block_count"))? as usize;
    let moe = if is_moe { Some(moe_from_gguf(content, &m, &k, family, layers)?) } else { None };
    // A mixture of experts whose every layer is sparse has no use for a dense size.
    let intermediate = match (&moe, m.u64(&k("feed_forward_length"))) {
        (_, Some(x)) => x as usize,
        (Some(moe), None) => moe.moe_intermediate_size,
        (None, None) => m.need_u64(&k("feed_forward_length"))? as usize,
    };
    let embd = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| ModelError::Config("GGUF has no token_embd.weight".into()))?;
    let vocab_size = embd.shape.dims().first().copied().unwrap_or(0);
    crate::config::check_geometry(layers, hidden, heads, kv_heads, head_dim, intermediate, vocab_size)?;
    let theta = m.f64(&k("rope.freq_base")).unwrap_or(10000.0);
    let scaling = match m.string(&k("rope.scaling.type")).as_deref() {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear { factor: m.f64(&k("rope.scaling.factor")).unwrap_or(1.0) },
        Some("yarn") => {
            let ctx = m.u64(&k("context_length")).unwrap_or(32768) as usize;
            let original = m.u64(&k("rope.scaling.original_context_length")).map_or(ctx, |x| x as usize);
            RopeScaling::Yarn {
                factor: m.f64(&k("rope.scaling.factor")).unwrap_or(ctx as f64 / original.max(1) as f64),
                original_max_position_embeddings: original,
                beta_fast: m.f64(&k("rope.scaling.yarn_beta_fast")).unwrap_or(32.0),
                beta_slow: m.f64(&k("rope.scaling.yarn_beta_slow")).unwrap_or(1.0),
                attention_factor: m.f64(&k("rope.scaling.attn_factor")),
                mscale: None,
                mscale_all_dim: None,
                truncate: true,
            }
        }
        Some(other) => {
            return Err(ModelError::Config(format!("GGUF rope scaling \"{}\" is not supported", shown(other))))
        }
    };
    let window = m.u64(&k("attention.sliding_window")).map(|x| x as usize);
    // A `llama` file with a window is a Mistral (the two differ in nothing else flint computes).
    let family = if family == Family::Llama && window.is_some() { Family::Mistral } else { family };
    let layer = |suffix: &str| content.tensor_infos.contains_key(&format!("blk.0.{suffix}"));
    let cfg = ModelConfig {
        family,
        qkv_bias: layer("attn_q.bias"),
        o_bias: layer("attn_output.bias"),
        qk_norm: layer("attn_q_norm.weight"),
        vocab_size,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        max_position_embeddings: m.u64(&k("context_length")).unwrap_or(32768) as usize,
        rms_norm_eps: m.f64(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
        rope: RopeConfig { theta, scaling },
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        // llama.cpp's converters write a window only when the model uses one.
        sliding_window_layers: vec![window; layers],
        bos_token_id: m.token_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: m.token_id("tokenizer.ggml.eos_token_id").into_iter().collect(),
        torch_dtype: None,
        moe,
    };
    cfg.check_numbers()?;
    Ok(cfg)
}

/// The experts of a `qwen3moe`/`qwen2moe` file: counts and sizes from the `<arch>.expert_*` keys
/// (sizes fall back to the merged tensors' shapes, as some early converters wrote no size);
/// a layer is sparse when it holds a router (`ffn_gate_inp`), so dense layers
/// (`mlp_only_layers`) load too.
fn moe_from_gguf(
    content: &gguf_file::Content,
    m: &Meta,
    k: &dyn Fn(&str) -> String,
    family: Family,
    layers: usize,
) -> Result<MoeConfig> {
    let dims = |name: &str| -> Option<Vec<usize>> {
        (0..layers).find_map(|l| content.tensor_infos.get(&format!("blk.{l}.{name}")).map(|t| t.shape.dims().to_vec()))
    };
    let num_experts = m.need_u64(&k("expert_count"))? as usize;
    let per_tok = m.need_u64(&k("expert_used_count"))? as usize;
    let size = match m.u64(&k("expert_feed_forward_length")) {
        Some(x) => x as usize,
        None => dims("ffn_gate_exps.weight").and_then(|d| d.get(1).copied()).ok_or_else(|| {
            ModelError::Config(format!(
                "GGUF has neither {} nor an ffn_gate_exps tensor",
                k("expert_feed_forward_length")
            ))
        })?,
    };
    let shared = match family {
        Family::Qwen2 => Some(match m.u64(&k("expert_shared_feed_forward_length")) {
            Some(x) => x as usize,
            None => dims("ffn_gate_shexp.weight").and_then(|d| d.first().copied()).ok_or_else(|| {
                ModelError::Config(format!(
                    "GGUF has neither {} nor an ffn_gate_shexp tensor",
                    k("expert_shared_feed_forward_length")
                ))
            })?,
        }),
        _ => None,
    };
    let norm_topk_prob = match m.get(&k("expert_weights_norm")) {
        Some(Value::Bool(b)) => *b,
        _ => llama_cpp_expert_norm(family),
    };
    let sparse_layers: Vec<bool> =
        (0..layers).map(|l| content.tensor_infos.contains_key(&format!("blk.{l}.ffn_gate_inp.weight"))).collect();
    if !sparse_layers.contains(&true) {
        return Err(ModelError::Config("a mixture-of-experts GGUF without any ffn_gate_inp (router) tensor".into()));
    }
    MoeConfig {
        num_experts,
        num_experts_per_tok: per_tok,
        moe_intermediate_size: size,
        norm_topk_prob,
        shared_expert_intermediate_size: shared,
        sparse_layers,
    }
    .checked()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_llama_cpp_ones() {
        for (hf, gguf) in [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("lm_head.weight", "output.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("model.layers.17.self_attn.k_proj.bias", "blk.17.attn_k.bias"),
            ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
            ("model.layers.3.self_attn.o_proj.weight", "blk.3.attn_output.weight"),
        ] {
            assert_eq!(hf_to_gguf_name(hf), gguf);
        }
        assert_eq!(hf_to_gguf_name("model.rotary_emb.inv_freq"), "model.rotary_emb.inv_freq", "unknown names pass");
        assert_eq!(hf_to_gguf_name("model.layers.2.self_attn.k_norm.weight"), "blk.2.attn_k_norm.weight");
    }

    /// llama.cpp's converter: `w.reshape(heads, 2, d/2, in).swapaxes(1, 2).reshape(w.shape)`,
    /// written here as index arithmetic on a numbered matrix; `llama_cpp_row` must invert it.
    #[test]
    fn row_order_inverts_the_converters_permutation() {
        for (heads, d) in [(1, 2), (2, 8), (3, 64)] {
            let rows = heads * d;
            // converted[h][i][half] = original[h][half][i]
            let mut converted = vec![usize::MAX; rows];
            for h in 0..heads {
                for half in 0..2 {
                    for i in 0..d / 2 {
                        converted[h * d + i * 2 + half] = h * d + half * (d / 2) + i;
                    }
                }
            }
            let back: Vec<usize> = (0..rows).map(|r| converted[llama_cpp_row(r, d)]).collect();
            assert_eq!(back, (0..rows).collect::<Vec<_>>(), "{heads} heads of {d}");
        }
    }
}
