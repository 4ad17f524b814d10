//! Writing GGUF v3 files in llama.cpp's conventions for each family (`qwen2`, `qwen3`, `llama`:
//! names, metadata, Llama's permuted q/k rows and its `rope_freqs`), so what flint exports loads
//! in llama.cpp, gguf-py and flint's own reader alike.
//!
//! The writer streams: tensor sizes are known from shapes and types alone, so the header (with
//! every tensor's offset) is written first and each tensor is then produced, converted and written
//! one at a time. A 7B checkpoint is exported holding only its largest tensor in memory.
//!
//! `types` says which storage type each tensor gets, `metadata` what the header says about the
//! model and its tokenizer, `writer` writes the file.

use std::path::Path;

use candle_core::{DType, Device};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;
use crate::gguf::GgufTokenizerMeta;
use crate::weights::WeightSource;

mod metadata;
mod types;
mod writer;

pub use metadata::GgufValue;
pub use types::{storage_type, GgufType};
pub(crate) use writer::write_floats;

/// Tensor data alignment; 32 is GGUF's default and what llama.cpp writes.
pub const ALIGNMENT: u64 = 32;

/// The tensors of a checkpoint by Hugging Face name, with their shapes, in llama.cpp's order
/// (embedding, Llama 3's `rope_freqs`, blocks in layer order, final norm, output). Biases and
/// q/k norms are listed where the family has them; `lm_head` only when `with_lm_head`: tied
/// checkpoints normally ship without one. A mixture of experts' sparse layers list the router,
/// each projection's experts merged as GGUF holds them (`mlp.experts.gate_proj.weight`,
/// `[experts, out, in]`: see [`merged_experts`]) and Qwen2-MoE's shared expert;
/// [`checkpoint_tensors`] lists the experts one by one instead, as safetensors hold them.
pub fn model_tensors(cfg: &ModelConfig, with_lm_head: bool) -> Vec<(String, Vec<usize>)> {
    let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let nq = cfg.num_attention_heads * d;
    let nkv = cfg.num_key_value_heads * d;
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    if matches!(cfg.rope.scaling, RopeScaling::Llama3 { .. } | RopeScaling::FreqFactors(_)) {
        out.push((ROPE_FREQS.to_string(), vec![d / 2]));
    }
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let layer: [(&str, Vec<usize>, bool); 12] = [
            ("input_layernorm.weight", vec![h], true),
            ("self_attn.q_proj.weight", vec![nq, h], true),
            ("self_attn.q_proj.bias", vec![nq], cfg.qkv_bias),
            ("self_attn.k_proj.weight", vec![nkv, h], true),
            ("self_attn.k_proj.bias", vec![nkv], cfg.qkv_bias),
            ("self_attn.v_proj.weight", vec![nkv, h], true),
            ("self_attn.v_proj.bias", vec![nkv], cfg.qkv_bias),
            ("self_attn.o_proj.weight", vec![h, nq], true),
            ("self_attn.o_proj.bias", vec![h], cfg.o_bias),
            ("self_attn.q_norm.weight", vec![d], cfg.qk_norm),
            ("self_attn.k_norm.weight", vec![d], cfg.qk_norm),
            ("post_attention_layernorm.weight", vec![h], true),
        ];
        out.extend(layer.into_iter().filter(|(_, _, has)| *has).map(|(s, shape, _)| (format!("{p}.{s}"), shape)));
        match &cfg.moe {
            Some(moe) if moe.is_sparse(l) => {
                let (n, ie) = (moe.num_experts, moe.moe_intermediate_size);
                out.push((format!("{p}.mlp.gate.weight"), vec![n, h]));
                out.push((format!("{p}.mlp.experts.gate_proj.weight"), vec![n, ie, h]));
                out.push((format!("{p}.mlp.experts.up_proj.weight"), vec![n, ie, h]));
                out.push((format!("{p}.mlp.experts.down_proj.weight"), vec![n, h, ie]));
                if let Some(s) = moe.shared_expert_intermediate_size {
                    out.push((format!("{p}.mlp.shared_expert_gate.weight"), vec![1, h]));
                    out.push((format!("{p}.mlp.shared_expert.gate_proj.weight"), vec![s, h]));
                    out.push((format!("{p}.mlp.shared_expert.up_proj.weight"), vec![s, h]));
                    out.push((format!("{p}.mlp.shared_expert.down_proj.weight"), vec![h, s]));
                }
            }
            _ => {
                out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
                out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
                out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
            }
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if with_lm_head {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// [`model_tensors`] with each merged experts tensor replaced by its experts' own tensors
/// (`mlp.experts.{e}.gate_proj.weight`), as a Hugging Face checkpoint lists them.
pub fn checkpoint_tensors(cfg: &ModelConfig, with_lm_head: bool) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for (name, shape) in model_tensors(cfg, with_lm_head) {
        match merged_experts(&name) {
            Some((mlp, proj)) => {
                out.extend((0..shape[0]).map(|e| (format!("{mlp}.experts.{e}.{proj}.weight"), shape[1..].to_vec())))
            }
            None => out.push((name, shape)),
        }
    }
    out
}

/// For a merged experts tensor's name (`model.layers.N.mlp.experts.{proj}.weight`), its mixture
/// (`model.layers.N.mlp`) and projection; expert `e` of it is `{mlp}.experts.{e}.{proj}.weight`.
pub fn merged_experts(name: &str) -> Option<(&str, &str)> {
    let (mlp, rest) = name.split_once(".experts.")?;
    let proj = rest.strip_suffix(".weight")?;
    matches!(proj, "gate_proj" | "up_proj" | "down_proj").then_some((mlp, proj))
}

/// The tensor `name` of `shape` by its experts when it is a merged experts tensor: each expert
/// from `expert(name of expert e, its shape)`, stacked. `None` for every other tensor.
pub fn stack_experts(
    name: &str,
    shape: &[usize],
    mut expert: impl FnMut(&str, &[usize]) -> Result<candle_core::Tensor>,
) -> Option<Result<candle_core::Tensor>> {
    let (mlp, proj) = merged_experts(name)?;
    let n = *shape.first()?;
    Some((|| {
        let parts = (0..n)
            .map(|e| expert(&format!("{mlp}.experts.{e}.{proj}.weight"), &shape[1..]))
            .collect::<Result<Vec<_>>>()?;
        Ok(candle_core::Tensor::stack(&parts, 0)?)
    })())
}

/// The name [`model_tensors`] gives llama.cpp's `rope_freqs.weight`, which no Hugging Face
/// checkpoint holds: the writer computes it from the config.
pub const ROPE_FREQS: &str = "rope_freqs";

/// What to write besides the tensors: the model's config, its name, optionally its tokenizer,
/// and the requested storage type.
pub struct GgufExport<'a> {
    pub config: &'a ModelConfig,
    pub name: String,
    pub tokenizer: Option<&'a GgufTokenizerMeta>,
    pub ty: GgufType,
}

/// Convert an opened checkpoint to a GGUF file at `out`, tensor by tensor (each is loaded as
/// f32 only when it is written). A tied checkpoint that nevertheless ships `lm_head.weight`
/// keeps it as `output.weight`, matching what flint's loader would use. Returns the bytes written.
pub fn export_checkpoint(
    src: &WeightSource,
    cfg: &ModelConfig,
    out: &Path,
    ty: GgufType,
    tokenizer: Option<&GgufTokenizerMeta>,
    name: &str,
) -> Result<u64> {
    let with_head = !cfg.tie_word_embeddings || src.contains("lm_head.weight");
    let tensors = model_tensors(cfg, with_head);
    let export = GgufExport { config: cfg, name: name.to_string(), tokenizer, ty };
    let shapes: std::collections::HashMap<&str, &[usize]> =
        tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    let dense = |hf: &str, shape: &[usize]| src.get_dense(hf, shape, DType::F32, &Device::Cpu);
    export.write_file(out, &tensors, |hf| {
        let shape = shapes.get(hf).copied().unwrap_or(&[]);
        stack_experts(hf, shape, dense).unwrap_or_else(|| dense(hf, shape))
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gguf::{config_from_gguf, hf_to_gguf_name};
    use crate::source::Checkpoint;
    use crate::weights::Weight;
    use candle_core::quantized::GgmlDType;

    pub(crate) fn golden_small() -> String {
        format!("{}/../../fixtures/golden/small-f32", env!("CARGO_MANIFEST_DIR"))
    }

    /// flint's writer lays out a Llama 3 checkpoint as llama.cpp's converter does: exported and
    /// read back it is the same model, and its q/k rows and `rope_freqs` are those of the
    /// fixture's GGUF (written with gguf-py in the converter's layout).
    #[test]
    fn llama_export_matches_the_converters_layout() {
        let dir = format!("{}/../../fixtures/families/llama3", env!("CARGO_MANIFEST_DIR"));
        let ck = Checkpoint::open(&dir).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model-bf16.gguf");
        export_checkpoint(&ck.weights, &ck.config, &path, GgufType::BF16, None, "llama3").unwrap();
        let back = Checkpoint::open(path.to_str().unwrap()).unwrap();
        let theirs = Checkpoint::open(&format!("{dir}/model-bf16.gguf")).unwrap();
        assert_eq!(back.config.rope, theirs.config.rope, "rope_freqs as the converter computes them");
        let mut cfg = back.config.clone();
        cfg.rope = ck.config.rope.clone();
        cfg.torch_dtype = ck.config.torch_dtype.clone();
        cfg.rms_norm_eps = ck.config.rms_norm_eps;
        cfg.eos_token_ids = ck.config.eos_token_ids.clone();
        assert_eq!(cfg, ck.config);
        let (ours, gguf_py) = (back.gguf().unwrap(), theirs.gguf().unwrap());
        let raw = |g: &crate::weights::GgufWeights, n: &str| g.read_f32(n).unwrap().unwrap();
        for name in ["blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.attn_v.weight"] {
            assert_eq!(raw(ours, name), raw(gguf_py, name), "{name}: the stored rows");
        }
        for (name, shape) in model_tensors(&ck.config, true).into_iter().filter(|(n, _)| n != ROPE_FREQS) {
            let get = |w: &WeightSource| w.get_dense(&name, &shape, DType::F32, &Device::Cpu).unwrap();
            let (a, b) = (get(&ck.weights), get(&back.weights));
            let (a, b) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(a, b, "{name} reads back as the checkpoint's");
        }
    }

    /// Every export type of the golden small model reopens with the same geometry and the
    /// requested tensor types; F32 is bit-identical to the safetensors, F16/BF16 are its rounding.
    #[test]
    fn golden_small_round_trips_every_type() {
        let ck = Checkpoint::open(&golden_small()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let dev = Device::Cpu;
        for ty in GgufType::ALL {
            let path = dir.path().join(format!("model-{ty}.gguf"));
            let n = export_checkpoint(&ck.weights, &ck.config, &path, ty, None, "golden-small").unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), n);
            let g = Checkpoint::open(path.to_str().unwrap()).unwrap();
            let gw = g.gguf().unwrap();
            let mut got = config_from_gguf(&gw.content).unwrap();
            assert!((got.rms_norm_eps - ck.config.rms_norm_eps).abs() < 1e-12, "{}", got.rms_norm_eps);
            got.rms_norm_eps = ck.config.rms_norm_eps;
            got.torch_dtype = ck.config.torch_dtype.clone();
            assert_eq!(got, ck.config, "{ty}");

            for (name, shape) in model_tensors(&ck.config, true) {
                let info = &gw.content.tensor_infos[&hf_to_gguf_name(&name)];
                assert_eq!(info.shape.dims(), shape.as_slice(), "{name}");
                let want = if shape.len() == 1 { GgmlDType::F32 } else { ty.ggml() };
                assert_eq!(info.ggml_dtype, want, "{ty} {name}");
                let orig = ck.weights.get_dense(&name, &shape, DType::F32, &dev).unwrap();
                let orig = orig.flatten_all().unwrap();
                let back = match g.weights.get(&name, &shape, DType::F32, &dev).unwrap() {
                    Weight::Dense(t) => t,
                    Weight::Quantized(q) => q.dequantize(&dev).unwrap(),
                };
                let back = back.flatten_all().unwrap();
                let expect = match (ty, shape.len()) {
                    (_, 1) | (GgufType::F32, _) => orig.clone(),
                    (GgufType::F16, _) => orig.to_dtype(DType::F16).unwrap().to_dtype(DType::F32).unwrap(),
                    (GgufType::BF16, _) => orig.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap(),
                    _ => {
                        let err = (&back - &orig).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                        let scale = orig.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                        assert!(err <= 0.2 * scale, "{ty} {name}: max error {err} vs max {scale}");
                        continue;
                    }
                };
                let (a, b) = (expect.to_vec1::<f32>().unwrap(), back.to_vec1::<f32>().unwrap());
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{ty} {name} differs");
            }
        }
    }
}
