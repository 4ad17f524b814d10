//! The metadata section: its value types and how they are written, and the key/values llama.cpp's
//! Qwen2 converter writes for a config and a tokenizer.

use std::io::Write;

use crate::config::RopeScaling;
use crate::error::{ModelError, Result};

use super::{GgufExport, ALIGNMENT};

/// A metadata value, limited to the types llama.cpp's Qwen2 converter writes.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    I32Array(Vec<i32>),
    StrArray(Vec<String>),
}

const GGUF_TYPE_U32: u32 = 4;
const GGUF_TYPE_I32: u32 = 5;
const GGUF_TYPE_F32: u32 = 6;
const GGUF_TYPE_BOOL: u32 = 7;
const GGUF_TYPE_STRING: u32 = 8;
const GGUF_TYPE_ARRAY: u32 = 9;

impl GgufValue {
    pub(super) fn type_id(&self) -> u32 {
        match self {
            GgufValue::U32(_) => GGUF_TYPE_U32,
            GgufValue::F32(_) => GGUF_TYPE_F32,
            GgufValue::Bool(_) => GGUF_TYPE_BOOL,
            GgufValue::Str(_) => GGUF_TYPE_STRING,
            GgufValue::I32Array(_) | GgufValue::StrArray(_) => GGUF_TYPE_ARRAY,
        }
    }

    pub(super) fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        match self {
            GgufValue::U32(v) => w.write_all(&v.to_le_bytes()),
            GgufValue::F32(v) => w.write_all(&v.to_le_bytes()),
            GgufValue::Bool(v) => w.write_all(&[u8::from(*v)]),
            GgufValue::Str(s) => write_str(w, s),
            GgufValue::I32Array(v) => {
                w.write_all(&GGUF_TYPE_I32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
            }
            GgufValue::StrArray(v) => {
                w.write_all(&GGUF_TYPE_STRING.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|s| write_str(w, s))
            }
        }
    }
}

/// A GGUF string: its length, then its bytes.
pub(super) fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

impl GgufExport<'_> {
    /// The metadata key/values in the order llama.cpp's `convert_hf_to_gguf.py` writes them.
    pub fn metadata(&self) -> Result<Vec<(String, GgufValue)>> {
        let c = self.config;
        let u32_of = |what: &str, v: usize| {
            u32::try_from(v).map_err(|_| ModelError::Config(format!("{what} {v} does not fit GGUF's u32")))
        };
        let mut m: Vec<(String, GgufValue)> = Vec::new();
        let mut put = |k: &str, v: GgufValue| m.push((k.to_string(), v));
        let arch = c.gguf_architecture();
        let k = |key: &str| format!("{arch}.{key}");
        put("general.architecture", GgufValue::Str(arch.into()));
        put("general.name", GgufValue::Str(self.name.clone()));
        put("general.alignment", GgufValue::U32(ALIGNMENT as u32));
        put(&k("block_count"), GgufValue::U32(u32_of("num_hidden_layers", c.num_hidden_layers)?));
        put(&k("context_length"), GgufValue::U32(u32_of("max_position_embeddings", c.max_position_embeddings)?));
        put(&k("embedding_length"), GgufValue::U32(u32_of("hidden_size", c.hidden_size)?));
        put(&k("feed_forward_length"), GgufValue::U32(u32_of("intermediate_size", c.intermediate_size)?));
        if let Some(moe) = &c.moe {
            put(&k("expert_count"), GgufValue::U32(u32_of("num_experts", moe.num_experts)?));
            put(&k("expert_used_count"), GgufValue::U32(u32_of("num_experts_per_tok", moe.num_experts_per_tok)?));
            let size = u32_of("moe_intermediate_size", moe.moe_intermediate_size)?;
            put(&k("expert_feed_forward_length"), GgufValue::U32(size));
            if let Some(s) = moe.shared_expert_intermediate_size {
                let s = u32_of("shared_expert_intermediate_size", s)?;
                put(&k("expert_shared_feed_forward_length"), GgufValue::U32(s));
            }
            // llama.cpp fixes the renormalisation per architecture; say it only when it differs.
            if moe.norm_topk_prob != crate::gguf::llama_cpp_expert_norm(c.family) {
                put(&k("expert_weights_norm"), GgufValue::Bool(moe.norm_topk_prob));
            }
        }
        put(&k("attention.head_count"), GgufValue::U32(u32_of("num_attention_heads", c.num_attention_heads)?));
        put(&k("attention.head_count_kv"), GgufValue::U32(u32_of("num_key_value_heads", c.num_key_value_heads)?));
        // Readers derive head_dim as hidden / heads; say it only when that would be wrong, as
        // llama.cpp does.
        if c.num_attention_heads == 0 || c.hidden_size / c.num_attention_heads != c.head_dim {
            let hd = GgufValue::U32(u32_of("head_dim", c.head_dim)?);
            put(&k("attention.key_length"), hd.clone());
            put(&k("attention.value_length"), hd);
        }
        put(&k("rope.freq_base"), GgufValue::F32(c.rope.theta as f32));
        put(&k("attention.layer_norm_rms_epsilon"), GgufValue::F32(c.rms_norm_eps as f32));
        match &c.rope.scaling {
            // llama.cpp keeps Llama 3's scaling in the `rope_freqs` tensor (see `writer`).
            RopeScaling::None | RopeScaling::Llama3 { .. } | RopeScaling::FreqFactors(_) => {}
            RopeScaling::Linear { factor } => {
                put(&k("rope.scaling.type"), GgufValue::Str("linear".into()));
                put(&k("rope.scaling.factor"), GgufValue::F32(*factor as f32));
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                put(&k("rope.scaling.type"), GgufValue::Str("yarn".into()));
                put(&k("rope.scaling.factor"), GgufValue::F32(*factor as f32));
                put(
                    &k("rope.scaling.original_context_length"),
                    GgufValue::U32(u32_of("original_max_position_embeddings", *original_max_position_embeddings)?),
                );
                // Only non-default betas are written, so readers that predate the keys agree.
                if *beta_fast != 32.0 {
                    put(&k("rope.scaling.yarn_beta_fast"), GgufValue::F32(*beta_fast as f32));
                }
                if *beta_slow != 1.0 {
                    put(&k("rope.scaling.yarn_beta_slow"), GgufValue::F32(*beta_slow as f32));
                }
                if let Some(a) = attention_factor {
                    put(&k("rope.scaling.attn_factor"), GgufValue::F32(*a as f32));
                }
            }
        }
        // GGUF has one window for all layers; a per-layer pattern cannot be expressed, and
        // silently dropping or widening it would change the model.
        match c.sliding_window_layers.first().copied().flatten() {
            _ if c.sliding_window_layers.iter().all(Option::is_none) => {}
            Some(w) if c.sliding_window_layers.iter().all(|l| *l == Some(w)) => {
                put(&k("attention.sliding_window"), GgufValue::U32(u32_of("sliding_window", w)?));
            }
            _ => {
                return Err(ModelError::Config(
                    "GGUF cannot express a sliding window on only some layers (max_window_layers); \
                     export with use_sliding_window false or on every layer"
                        .into(),
                ))
            }
        }
        put("general.file_type", GgufValue::U32(self.ty.file_type()));
        put("general.quantization_version", GgufValue::U32(2));

        let bos = self.tokenizer.and_then(|t| t.bos_token_id).or(c.bos_token_id);
        let eos = self.tokenizer.and_then(|t| t.eos_token_id).or_else(|| c.eos_token_ids.first().copied());
        if let Some(t) = self.tokenizer {
            if t.token_types.len() != t.tokens.len() {
                return Err(ModelError::Config(format!(
                    "tokenizer has {} tokens but {} token types",
                    t.tokens.len(),
                    t.token_types.len()
                )));
            }
            put("tokenizer.ggml.model", GgufValue::Str(t.model.clone()));
            if let Some(pre) = &t.pre {
                put("tokenizer.ggml.pre", GgufValue::Str(pre.clone()));
            }
            put("tokenizer.ggml.tokens", GgufValue::StrArray(t.tokens.clone()));
            put("tokenizer.ggml.token_type", GgufValue::I32Array(t.token_types.clone()));
            put("tokenizer.ggml.merges", GgufValue::StrArray(t.merges.clone()));
        }
        // Written even without a tokenizer: they are the only place GGUF keeps the stop ids, and
        // flint reads its eos from here.
        if let Some(b) = bos {
            put("tokenizer.ggml.bos_token_id", GgufValue::U32(b));
        }
        if let Some(e) = eos {
            put("tokenizer.ggml.eos_token_id", GgufValue::U32(e));
        }
        if let Some(t) = self.tokenizer {
            // tokenizer_config.json's pad token when known (Qwen: <|endoftext|>), else eos.
            if let Some(p) = t.padding_token_id.or(eos) {
                put("tokenizer.ggml.padding_token_id", GgufValue::U32(p));
            }
            put("tokenizer.ggml.add_bos_token", GgufValue::Bool(t.add_bos_token.unwrap_or(false)));
            if let Some(tpl) = &t.chat_template {
                put("tokenizer.chat_template", GgufValue::Str(tpl.clone()));
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufTokenizerMeta;
    use crate::gguf_export::tests::golden_small;
    use crate::gguf_export::GgufType;
    use crate::source::Checkpoint;

    #[test]
    fn metadata_for_yarn_and_tokenizer() {
        let mut cfg = Checkpoint::open(&golden_small()).unwrap().config;
        cfg.rope.scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 256,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let tok = GgufTokenizerMeta {
            model: "gpt2".into(),
            pre: Some("qwen2".into()),
            tokens: vec!["a".into(), "b".into()],
            token_types: vec![1, 3],
            merges: vec!["a b".into()],
            bos_token_id: None,
            eos_token_id: Some(1),
            padding_token_id: None,
            add_bos_token: None,
            chat_template: Some("{{ x }}".into()),
            ..Default::default()
        };
        let export = GgufExport { config: &cfg, name: "t".into(), tokenizer: Some(&tok), ty: GgufType::Q8_0 };
        let m: std::collections::HashMap<String, GgufValue> = export.metadata().unwrap().into_iter().collect();
        assert_eq!(m["qwen2.rope.scaling.type"], GgufValue::Str("yarn".into()));
        assert_eq!(m["qwen2.rope.scaling.original_context_length"], GgufValue::U32(256));
        assert_eq!(m["general.file_type"], GgufValue::U32(7));
        assert_eq!(m["tokenizer.ggml.eos_token_id"], GgufValue::U32(1));
        assert_eq!(m["tokenizer.ggml.padding_token_id"], GgufValue::U32(1));
        assert_eq!(m["tokenizer.ggml.bos_token_id"], GgufValue::U32(1), "falls back to config.json's bos");
        assert_eq!(m["tokenizer.ggml.add_bos_token"], GgufValue::Bool(false));
        assert!(!m.contains_key("qwen2.attention.key_length"));

        cfg.sliding_window_layers[1] = Some(64);
        let export = GgufExport { config: &cfg, name: "t".into(), tokenizer: None, ty: GgufType::F32 };
        assert!(export.metadata().is_err(), "a per-layer window cannot be expressed");
    }
}
