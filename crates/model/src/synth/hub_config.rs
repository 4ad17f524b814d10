//! The JSON files of a hub checkpoint that `flint synth` writes beside the weights: config.json as
//! transformers' `save_pretrained` writes it for each family, and generation_config.json.

use serde_json::{json, Value};

use crate::config::{Family, ModelConfig, RopeScaling};

use super::HubExtras;

/// `config.json` in the classic hub layout (what `save_pretrained` of transformers 4.x writes for
/// the family: `rope_theta` + `rope_scaling`), readable by both flint and transformers. When `cfg` has sliding layers they override
/// `extras`; a pattern that is not "every layer from k on" is spelled out as `layer_types`.
pub fn config_json(cfg: &ModelConfig, extras: &HubExtras) -> Value {
    let first_sliding = cfg.sliding_window_layers.iter().position(Option::is_some);
    let window = cfg.sliding_window_layers.iter().flatten().next().copied();
    let mut v = json!({
        "architectures": [cfg.architecture().0],
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": match cfg.eos_token_ids.as_slice() {
            [one] => json!(one),
            many => json!(many),
        },
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": first_sliding.unwrap_or(extras.max_window_layers),
        "model_type": cfg.architecture().1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": rope_scaling_json(&cfg.rope.scaling),
        "rope_theta": cfg.rope.theta,
        "sliding_window": window.unwrap_or(extras.sliding_window),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.torch_dtype.as_deref().unwrap_or("float32"),
        "use_cache": true,
        "use_sliding_window": window.is_some(),
        "vocab_size": cfg.vocab_size,
    });
    if let Value::Object(m) = &mut v {
        if cfg.family != Family::Qwen2 {
            // Neither Llama nor Mistral has Qwen's window switch; Qwen3 shares Qwen2's keys.
            m.insert("attention_bias".into(), json!(cfg.qkv_bias));
            m.insert("head_dim".into(), json!(cfg.head_dim));
        }
        match cfg.family {
            Family::Llama => {
                for k in ["max_window_layers", "sliding_window", "use_sliding_window"] {
                    m.remove(k);
                }
                m.insert("mlp_bias".into(), json!(false));
                m.insert("pretraining_tp".into(), json!(1));
                return v;
            }
            Family::Mistral => {
                m.remove("max_window_layers");
                m.remove("use_sliding_window");
                m.insert("sliding_window".into(), json!(window));
                return v;
            }
            Family::Qwen2 | Family::Qwen3 => {}
        }
        if let Some(moe) = &cfg.moe {
            let dense: Vec<usize> = (0..cfg.num_hidden_layers).filter(|&l| !moe.is_sparse(l)).collect();
            m.insert("num_experts".into(), json!(moe.num_experts));
            m.insert("num_experts_per_tok".into(), json!(moe.num_experts_per_tok));
            m.insert("moe_intermediate_size".into(), json!(moe.moe_intermediate_size));
            m.insert("norm_topk_prob".into(), json!(moe.norm_topk_prob));
            m.insert("decoder_sparse_step".into(), json!(1));
            m.insert("mlp_only_layers".into(), json!(dense));
            m.insert("output_router_logits".into(), json!(false));
            m.insert("router_aux_loss_coef".into(), json!(0.001));
            if let Some(s) = moe.shared_expert_intermediate_size {
                m.insert("shared_expert_intermediate_size".into(), json!(s));
            }
        }
        if cfg.num_attention_heads == 0 || cfg.hidden_size / cfg.num_attention_heads != cfg.head_dim {
            m.insert("head_dim".into(), json!(cfg.head_dim));
        }
        let is_suffix = first_sliding.is_some_and(|k| cfg.sliding_window_layers[k..].iter().all(|l| *l == window));
        if window.is_some() && !is_suffix {
            let types: Vec<&str> = cfg
                .sliding_window_layers
                .iter()
                .map(|l| if l.is_some() { "sliding_attention" } else { "full_attention" })
                .collect();
            m.insert("layer_types".into(), json!(types));
        }
    }
    v
}

/// `FreqFactors` (only ever read from a GGUF) has no config.json form: it is written as none.
fn rope_scaling_json(s: &RopeScaling) -> Value {
    match s {
        RopeScaling::None | RopeScaling::FreqFactors(_) => Value::Null,
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
        RopeScaling::Linear { factor } => json!({"type": "linear", "rope_type": "linear", "factor": factor}),
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
            let mut v = json!({
                "type": "yarn",
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": original_max_position_embeddings,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
            });
            if let Value::Object(m) = &mut v {
                let optional =
                    [("attention_factor", attention_factor), ("mscale", mscale), ("mscale_all_dim", mscale_all_dim)];
                for (k, x) in optional {
                    if let Some(x) = x {
                        m.insert(k.into(), json!(x));
                    }
                }
                if !truncate {
                    m.insert("truncate".into(), json!(false));
                }
            }
            v
        }
    }
}

pub(super) fn generation_config_json(cfg: &ModelConfig, eos: &[u32]) -> Value {
    json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.eos_token_ids.last().copied().or(cfg.bos_token_id),
    })
}

/// `v` pretty-printed, with a final newline.
pub(super) fn pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{shape_config, shape_extras, SHAPES};

    #[test]
    fn shapes_round_trip_through_config_json() {
        for name in SHAPES {
            let cfg = shape_config(name).unwrap();
            let text = config_json(&cfg, &shape_extras(name).unwrap()).to_string();
            assert_eq!(ModelConfig::from_json_str(&text).unwrap(), cfg, "{name}");
        }
        let mut cfg = shape_config("qwen2.5-7b").unwrap();
        let extras = shape_extras("qwen2.5-7b").unwrap();
        cfg.rope.scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: Some(1.1),
            mscale: None,
            mscale_all_dim: None,
            truncate: false,
        };
        cfg.sliding_window_layers = (0..28).map(|l| (l >= 20).then_some(4096)).collect();
        let text = config_json(&cfg, &extras).to_string();
        assert_eq!(ModelConfig::from_json_str(&text).unwrap(), cfg);
        cfg.rope.scaling = RopeScaling::Linear { factor: 2.0 };
        cfg.sliding_window_layers = (0..28).map(|l| (l % 2 == 0).then_some(512)).collect();
        cfg.head_dim = 64;
        let text = config_json(&cfg, &extras).to_string();
        assert_eq!(ModelConfig::from_json_str(&text).unwrap(), cfg);
    }

    #[test]
    fn r1_distill_keeps_its_unused_window() {
        let cfg = shape_config("DeepSeek-R1-Distill-Qwen-1.5B").unwrap();
        let v = config_json(&cfg, &shape_extras("deepseek-r1-distill-qwen-1.5b").unwrap());
        assert_eq!(v["sliding_window"], 4096);
        assert_eq!(v["max_window_layers"], 21);
        assert_eq!(v["use_sliding_window"], false);
        assert_eq!(v["rope_theta"], 10000.0);
    }
}
