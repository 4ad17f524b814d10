//! A scripted checkpoint: a genuine Qwen2 model whose weights are set by hand so that, decoding
//! greedily, it answers any prompt ending in a trigger token with a fixed token sequence.
//!
//! Random-weight models produce gibberish, which cannot exercise what depends on the *content*
//! of an answer (tool-call parsing, stop strings) end to end. Here every attention and MLP
//! weight is zero, so the residual stream is the token's embedding; the final RMSNorm maps it to
//! a unit direction; the (untied) lm_head row of the token that should come next points the
//! same way, with a large margin. It is a bigram table expressed as a transformer: each script
//! token must always be followed by the same token.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;

use crate::config::{ModelConfig, RopeConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::synth::{config_json, HubExtras};

const HIDDEN: usize = 64;
/// Logit of the scripted next token; every other token scores 0.
const MARGIN: f32 = 30.0;

/// Write `config.json`, `generation_config.json` and `model.safetensors` into `out` for a model of
/// `vocab_size` rows that, after `trigger`, emits `script` and then `end`.
pub fn write_scripted(out: &Path, vocab_size: usize, trigger: u32, script: &[u32], end: u32) -> Result<()> {
    let mut chain = vec![trigger];
    chain.extend_from_slice(script);
    chain.push(end);
    // Each token that has a successor gets its own direction of the residual stream.
    let mut direction: HashMap<u32, usize> = HashMap::new();
    let mut next: HashMap<u32, u32> = HashMap::new();
    for w in chain.windows(2) {
        if let Some(&prev) = next.get(&w[0]) {
            if prev != w[1] {
                return Err(ModelError::Config(format!(
                    "the script needs token {} to be followed by both {prev} and {}; a scripted model can only \
                     follow each token with one other (rephrase the script)",
                    w[0], w[1]
                )));
            }
        }
        next.insert(w[0], w[1]);
        let n = direction.len();
        direction.entry(w[0]).or_insert(n);
    }
    if direction.len() > HIDDEN {
        return Err(ModelError::Config(format!("the script has more than {HIDDEN} distinct tokens")));
    }
    if let Some(&t) = chain.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(ModelError::Config(format!("script token {t} is outside the vocabulary ({vocab_size})")));
    }
    let mut embed = vec![0f32; vocab_size * HIDDEN];
    let mut head = vec![0f32; vocab_size * HIDDEN];
    for (&tok, &d) in &direction {
        embed[tok as usize * HIDDEN + d] = 1.0;
        let succ = next[&tok] as usize;
        head[succ * HIDDEN + d] = MARGIN;
    }
    let cfg = ModelConfig {
        family: crate::config::Family::Qwen2,
        qkv_bias: true,
        o_bias: false,
        qk_norm: false,
        vocab_size,
        hidden_size: HIDDEN,
        intermediate_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: HIDDEN / 2,
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-6,
        rope: RopeConfig { theta: 1e6, scaling: RopeScaling::None },
        tie_word_embeddings: false,
        sliding_window_layers: vec![None],
        bos_token_id: Some(end),
        eos_token_ids: vec![end],
        torch_dtype: Some("float32".into()),
        moe: None,
    };
    let zeros = |n: usize| vec![0f32; n];
    let ones = |n: usize| vec![1f32; n];
    let (h, kv) = (HIDDEN, HIDDEN / 2);
    let p = "model.layers.0";
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab_size, h], embed),
        ("lm_head.weight".into(), vec![vocab_size, h], head),
        ("model.norm.weight".into(), vec![h], ones(h)),
        (format!("{p}.input_layernorm.weight"), vec![h], ones(h)),
        (format!("{p}.post_attention_layernorm.weight"), vec![h], ones(h)),
        (format!("{p}.self_attn.q_proj.weight"), vec![h, h], zeros(h * h)),
        (format!("{p}.self_attn.q_proj.bias"), vec![h], zeros(h)),
        (format!("{p}.self_attn.k_proj.weight"), vec![kv, h], zeros(kv * h)),
        (format!("{p}.self_attn.k_proj.bias"), vec![kv], zeros(kv)),
        (format!("{p}.self_attn.v_proj.weight"), vec![kv, h], zeros(kv * h)),
        (format!("{p}.self_attn.v_proj.bias"), vec![kv], zeros(kv)),
        (format!("{p}.self_attn.o_proj.weight"), vec![h, h], zeros(h * h)),
        (format!("{p}.mlp.gate_proj.weight"), vec![64, h], zeros(64 * h)),
        (format!("{p}.mlp.up_proj.weight"), vec![64, h], zeros(64 * h)),
        (format!("{p}.mlp.down_proj.weight"), vec![h, 64], zeros(64 * h)),
    ];
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.into_iter().map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| ModelError::Config(format!("scripted checkpoint: {e}")))?;
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    let st = out.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st)
        .map_err(|e| ModelError::Config(format!("{}: {e}", st.display())))?;
    let extras = HubExtras { sliding_window: 4096, max_window_layers: 1 };
    let write_json = |name: &str, v: serde_json::Value| -> Result<()> {
        let path = out.join(name);
        let text = serde_json::to_string_pretty(&v).map_err(|e| ModelError::Config(e.to_string()))?;
        std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))
    };
    write_json("config.json", config_json(&cfg, &extras))?;
    write_json("generation_config.json", json!({"bos_token_id": end, "eos_token_id": [end], "do_sample": false}))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::ContiguousKvCache;
    use crate::source::Checkpoint;
    use crate::{DecoderModel, ForwardBatch, LogitsRows};
    use candle_core::{DType, Device};

    #[test]
    fn greedy_decoding_follows_the_script() {
        let dir = tempfile::tempdir().unwrap();
        let script = [7u32, 3, 9, 4];
        write_scripted(dir.path(), 50, 11, &script, 2).unwrap();
        let ck = Checkpoint::open(dir.path().to_str().unwrap()).unwrap();
        let model = DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).unwrap();
        let mut cache = ContiguousKvCache::for_config(&ck.config, DType::F32, &Device::Cpu);
        let mut tokens = vec![5u32, 6, 11];
        let mut batch = ForwardBatch::new();
        batch.push(0, 0, &tokens, LogitsRows::Last);
        let mut out = Vec::new();
        for _ in 0..5 {
            let row = model.forward(&batch, &mut cache).unwrap().unwrap().get(0).unwrap().to_vec1::<f32>().unwrap();
            let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
            out.push(best);
            batch = ForwardBatch::new();
            batch.push(0, tokens.len(), &[best], LogitsRows::Last);
            tokens.push(best);
        }
        assert_eq!(out, vec![7, 3, 9, 4, 2]);
    }

    #[test]
    fn conflicting_successors_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_scripted(dir.path(), 50, 11, &[7, 3, 7, 4], 2).unwrap_err().to_string();
        assert!(err.contains("followed by both"), "{err}");
    }
}
