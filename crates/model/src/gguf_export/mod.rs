//! Writing GGUF v3 files in llama.cpp's Qwen2 conventions, so what flint exports loads in
//! llama.cpp, gguf-py and flint's own reader alike.
//!
//! The writer streams: tensor sizes are known from shapes and types alone, so the header (with
//! every tensor's offset) is written first and each tensor is then produced, converted and written
//! one at a time. A 7B checkpoint is exported holding only its largest tensor in memory.
//!
//! `types` says which storage type each tensor gets, `metadata` what the header says about the
//! model and its tokenizer, `writer` writes the file.

use std::path::Path;

use candle_core::{DType, Device};

use crate::config::Qwen2Config;
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

/// The tensors of a Qwen2 checkpoint by Hugging Face name, with their shapes, in llama.cpp's
/// order (embedding, blocks in layer order, final norm, output). `lm_head` is listed only when
/// `with_lm_head`: tied checkpoints normally ship without one.
pub fn qwen2_tensors(cfg: &Qwen2Config, with_lm_head: bool) -> Vec<(String, Vec<usize>)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let nq = cfg.num_attention_heads * cfg.head_dim;
    let nkv = cfg.num_key_value_heads * cfg.head_dim;
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let layer: [(&str, Vec<usize>); 12] = [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![nq, h]),
            ("self_attn.q_proj.bias", vec![nq]),
            ("self_attn.k_proj.weight", vec![nkv, h]),
            ("self_attn.k_proj.bias", vec![nkv]),
            ("self_attn.v_proj.weight", vec![nkv, h]),
            ("self_attn.v_proj.bias", vec![nkv]),
            ("self_attn.o_proj.weight", vec![h, nq]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ];
        out.extend(layer.into_iter().map(|(s, shape)| (format!("{p}.{s}"), shape)));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if with_lm_head {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// What to write besides the tensors: the model's config, its name, optionally its tokenizer,
/// and the requested storage type.
pub struct GgufExport<'a> {
    pub config: &'a Qwen2Config,
    pub name: String,
    pub tokenizer: Option<&'a GgufTokenizerMeta>,
    pub ty: GgufType,
}

/// Convert an opened checkpoint to a GGUF file at `out`, tensor by tensor (each is loaded as
/// f32 only when it is written). A tied checkpoint that nevertheless ships `lm_head.weight`
/// keeps it as `output.weight`, matching what flint's loader would use. Returns the bytes written.
pub fn export_checkpoint(
    src: &WeightSource,
    cfg: &Qwen2Config,
    out: &Path,
    ty: GgufType,
    tokenizer: Option<&GgufTokenizerMeta>,
    name: &str,
) -> Result<u64> {
    let with_head = !cfg.tie_word_embeddings || src.contains("lm_head.weight");
    let tensors = qwen2_tensors(cfg, with_head);
    let export = GgufExport { config: cfg, name: name.to_string(), tokenizer, ty };
    let shapes: std::collections::HashMap<&str, &[usize]> =
        tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    export.write_file(out, &tensors, |hf| {
        let shape = shapes.get(hf).copied().unwrap_or(&[]);
        src.get_dense(hf, shape, DType::F32, &Device::Cpu)
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

            for (name, shape) in qwen2_tensors(&ck.config, true) {
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
