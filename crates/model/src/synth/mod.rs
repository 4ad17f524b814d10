//! Random-weight checkpoints with the exact geometry of real Qwen2 models, for load, memory and
//! throughput testing without downloading gigabytes (and for machines that cannot reach the hub).
//!
//! The weights are a pure function of (seed, tensor name, element index) (`weights`), so the
//! safetensors and GGUF outputs of one shape and seed hold the same numbers. Checkpoints are
//! streamed to disk; memory stays around one generation block (safetensors, `shards`) or one
//! tensor (GGUF, whose quantizer needs whole rows). `shapes` holds the real models' geometry,
//! `hub_config` the JSON files written beside safetensors weights.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::DType;

use crate::error::{ModelError, Result};
use crate::gguf::GgufTokenizerMeta;
use crate::gguf_export::{checkpoint_tensors, model_tensors, stack_experts, GgufExport, GgufType};

mod hub_config;
mod shapes;
mod shards;
mod weights;

pub use hub_config::config_json;
use hub_config::{generation_config_json, pretty};
use shapes::spec;
pub use shapes::{shape_config, shape_extras, HubExtras, SHAPES};
pub use shards::SHARD_BYTES;
use shards::{torch_dtype_name, write_safetensors};
pub use weights::synth_tensor;

/// What to synthesise and where.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// One of [`SHAPES`].
    pub shape: String,
    /// Output directory; must be absent or empty.
    pub out: PathBuf,
    /// Safetensors dtype: F32, BF16 or F16 (ignored for GGUF).
    pub dtype: DType,
    /// Write `out/model-<type>.gguf` instead of a safetensors checkpoint.
    pub gguf: Option<GgufType>,
    pub seed: u64,
    /// Copied verbatim beside a safetensors checkpoint.
    pub tokenizer_json: Option<Vec<u8>>,
    pub tokenizer_config_json: Option<Vec<u8>>,
    /// Tokenizer metadata embedded in a GGUF output.
    pub gguf_tokenizer: Option<GgufTokenizerMeta>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthReport {
    pub files: Vec<PathBuf>,
    pub total_bytes: u64,
    pub parameters: u64,
}

/// Write a random-weight checkpoint of `opts.shape` into `opts.out`.
///
/// Safetensors output is a hub-style directory (config.json, generation_config.json, the
/// tokenizer files when given, and `model.safetensors` or ~4 GB shards plus an index). GGUF
/// output is a directory holding only `model-<type>.gguf`: a config.json beside it would make the
/// loader treat the directory as safetensors.
///
/// `out` must be absent or empty, so leftovers of an earlier run (stale shards, a config.json
/// beside a GGUF) can never mix into what the loader then reads.
pub fn synth(opts: &SynthOptions) -> Result<SynthReport> {
    let mut cfg = shape_config(&opts.shape)?;
    let s = spec(&opts.shape)?;
    let out = opts.out.as_path();
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    if std::fs::read_dir(out).map_err(|e| ModelError::io(out, e))?.next().is_some() {
        return Err(ModelError::Config(format!("{}: output directory is not empty", out.display())));
    }
    // GGUF holds a mixture's experts merged, safetensors one tensor per expert: the same numbers
    // (a merged tensor is its experts' tensors stacked).
    let tensors = if opts.gguf.is_some() {
        model_tensors(&cfg, !cfg.tie_word_embeddings)
    } else {
        checkpoint_tensors(&cfg, !cfg.tie_word_embeddings)
    };
    let parameters: u64 = tensors.iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
    let progress = crate::progress::task("writing weights", "tensors", tensors.len() as u64);

    if let Some(ty) = opts.gguf {
        let path = out.join(format!("model-{ty}.gguf"));
        let export = GgufExport { config: &cfg, name: s.name.to_string(), tokenizer: opts.gguf_tokenizer.as_ref(), ty };
        let shapes: HashMap<&str, &[usize]> = tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
        let bytes = export.write_file(&path, &tensors, |name| {
            let shape = shapes.get(name).copied().unwrap_or(&[]);
            let one = |name: &str, shape: &[usize]| synth_tensor(name, shape, opts.seed);
            let t = stack_experts(name, shape, one).unwrap_or_else(|| one(name, shape));
            progress.inc(1);
            t
        })?;
        return Ok(SynthReport { files: vec![path], total_bytes: bytes, parameters });
    }

    cfg.torch_dtype = Some(torch_dtype_name(opts.dtype)?.to_string());
    let mut files = Vec::new();
    let mut total_bytes = 0;
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        let path = out.join(name);
        std::fs::write(&path, bytes).map_err(|e| ModelError::io(&path, e))?;
        total_bytes += bytes.len() as u64;
        files.push(path);
        Ok(())
    };
    put("config.json", pretty(&config_json(&cfg, &s.extras)).as_bytes())?;
    put("generation_config.json", pretty(&generation_config_json(&cfg, s.generation_eos)).as_bytes())?;
    if let Some(t) = &opts.tokenizer_json {
        put("tokenizer.json", t)?;
    }
    if let Some(t) = &opts.tokenizer_config_json {
        put("tokenizer_config.json", t)?;
    }
    let (weight_files, weight_bytes) = write_safetensors(out, &tensors, opts.dtype, opts.seed, SHARD_BYTES, &progress)?;
    files.extend(weight_files);
    Ok(SynthReport { files, total_bytes: total_bytes + weight_bytes, parameters })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::batch::{ForwardBatch, LogitsRows};
    use crate::config::ModelConfig;
    use crate::decoder::DecoderModel;
    use crate::kv_cache::ContiguousKvCache;
    use crate::source::Checkpoint;
    use candle_core::quantized::gguf_file;
    use candle_core::Device;

    fn opts(out: &Path, dtype: DType, gguf: Option<GgufType>, seed: u64) -> SynthOptions {
        SynthOptions {
            shape: "tiny".into(),
            out: out.to_path_buf(),
            dtype,
            gguf,
            seed,
            tokenizer_json: None,
            tokenizer_config_json: None,
            gguf_tokenizer: None,
        }
    }

    /// Load and run one 3-token prefill; logits must be finite and `[3, vocab]`.
    fn forward_is_finite(spec: &str) -> ModelConfig {
        let ck = Checkpoint::open(spec).unwrap();
        let cfg = ck.config.clone();
        let model = DecoderModel::load(&cfg, &ck.weights, DType::F32, &Device::Cpu).unwrap();
        let mut cache = ContiguousKvCache::for_config(&cfg, DType::F32, &Device::Cpu);
        let mut batch = ForwardBatch::new();
        batch.push(0, 0, &[9707, 11, 151643], LogitsRows::All);
        let logits = model.forward(&batch, &mut cache).unwrap().unwrap();
        assert_eq!(logits.dims(), &[3, cfg.vocab_size]);
        let v = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{spec}: non-finite logits");
        let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!(std > 0.1 && std < 20.0, "{spec}: logit rms {std}");
        cfg
    }

    #[test]
    fn tiny_safetensors_load_and_run() {
        let dir = tempfile::tempdir().unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let out = dir.path().join(format!("{dtype:?}"));
            let mut o = opts(&out, dtype, None, 1);
            o.tokenizer_json = Some(b"{}".to_vec());
            let report = synth(&o).unwrap();
            let names: Vec<String> =
                report.files.iter().filter_map(|p| p.file_name()?.to_str().map(String::from)).collect();
            assert_eq!(names, ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"]);
            let on_disk: u64 = report.files.iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
            assert_eq!(on_disk, report.total_bytes);
            // tiny: tied embedding 151936×64 + 2 layers + final norm.
            assert_eq!(
                report.parameters,
                151936 * 64 + 2 * (2 * 64 + 64 * 64 + 64 + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 128) + 64
            );

            let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let emb = st.tensor("model.embed_tokens.weight").unwrap();
            assert_eq!(emb.shape(), &[151936, 64]);
            let want = if dtype == DType::F32 { safetensors::Dtype::F32 } else { safetensors::Dtype::BF16 };
            assert_eq!(emb.dtype(), want);
            assert!(st.tensor("lm_head.weight").is_err(), "tied shapes ship no lm_head");
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));

            let cfg = forward_is_finite(out.to_str().unwrap());
            let mut want_cfg = shape_config("tiny").unwrap();
            want_cfg.torch_dtype = cfg.torch_dtype.clone();
            assert_eq!(cfg, want_cfg);
            let ck = Checkpoint::open(out.to_str().unwrap()).unwrap();
            assert_eq!(ck.eos_token_ids(), &[151645, 151643]);
        }
    }

    #[test]
    fn tiny_gguf_loads_runs_and_matches_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let q8 = dir.path().join("q8");
        let report = synth(&opts(&q8, DType::F32, Some(GgufType::Q8_0), 1)).unwrap();
        assert_eq!(report.files, vec![q8.join("model-q8_0.gguf")]);
        let cfg = forward_is_finite(q8.to_str().unwrap());
        assert_eq!(cfg.num_hidden_layers, 2);
        assert!(cfg.tie_word_embeddings);
        assert_eq!(cfg.eos_token_ids, vec![151645]);

        // An F32 GGUF holds exactly the safetensors weights of the same seed.
        let (f32_gguf, st) = (dir.path().join("f32"), dir.path().join("st"));
        synth(&opts(&f32_gguf, DType::F32, Some(GgufType::F32), 1)).unwrap();
        synth(&opts(&st, DType::F32, None, 1)).unwrap();
        let (g, s) =
            (Checkpoint::open(f32_gguf.to_str().unwrap()).unwrap(), Checkpoint::open(st.to_str().unwrap()).unwrap());
        for (name, shape) in model_tensors(&g.config, false) {
            let a = g.weights.get_dense(&name, &shape, DType::F32, &Device::Cpu).unwrap();
            let b = s.weights.get_dense(&name, &shape, DType::F32, &Device::Cpu).unwrap();
            let diff =
                (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(diff, 0.0, "{name}");
        }
    }

    /// A mixture of experts: safetensors hold one tensor per expert, the GGUF merged 3-D ones
    /// (llama.cpp's `qwen3moe` layout, routers in F32); both load to the same model, whose
    /// logits are bit-identical in f32, and a Q8_0 GGUF splits its merged experts as it loads.
    #[test]
    fn tiny_moe_safetensors_and_gguf_are_the_same_model() {
        let dir = tempfile::tempdir().unwrap();
        let (st, gguf, q8) = (dir.path().join("st"), dir.path().join("gguf"), dir.path().join("q8"));
        let moe_opts =
            |out: &Path, gguf| SynthOptions { shape: "tiny-qwen3-moe".into(), ..opts(out, DType::F32, gguf, 5) };
        synth(&moe_opts(&st, None)).unwrap();
        synth(&moe_opts(&gguf, Some(GgufType::F32))).unwrap();
        synth(&moe_opts(&q8, Some(GgufType::Q8_0))).unwrap();
        let names = |d: &Path| {
            let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            st.names().into_iter().map(String::from).collect::<Vec<_>>()
        };
        let st_names = names(&st);
        assert!(st_names.iter().any(|n| n == "model.layers.1.mlp.experts.7.down_proj.weight"));
        assert!(!st_names.iter().any(|n| n == "model.layers.1.mlp.experts.down_proj.weight"));
        let g = Checkpoint::open(gguf.to_str().unwrap()).unwrap();
        let info = &g.gguf().unwrap().content.tensor_infos;
        assert_eq!(info["blk.1.ffn_down_exps.weight"].shape.dims(), &[8, 64, 32]);
        assert_eq!(info["blk.0.ffn_gate_inp.weight"].ggml_dtype, candle_core::quantized::GgmlDType::F32);
        let q = Checkpoint::open(q8.to_str().unwrap()).unwrap();
        let qi = &q.gguf().unwrap().content.tensor_infos;
        assert_eq!(qi["blk.0.ffn_up_exps.weight"].ggml_dtype, candle_core::quantized::GgmlDType::Q8_0);
        assert_eq!(qi["blk.0.ffn_gate_inp.weight"].ggml_dtype, candle_core::quantized::GgmlDType::F32);

        // Bad expert keys are one-line errors naming the key.
        let mut content = crate::weights::GgufWeights::open(&gguf.join("model-f32.gguf")).unwrap().content;
        content.metadata.insert("qwen3moe.expert_used_count".into(), gguf_file::Value::U32(9));
        let e = crate::gguf::config_from_gguf(&content).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok 9"), "{e}");
        content.metadata.remove("qwen3moe.expert_count");
        let e = crate::gguf::config_from_gguf(&content).unwrap_err().to_string();
        assert!(e.contains("qwen3moe.expert_count"), "{e}");

        let s = Checkpoint::open(st.to_str().unwrap()).unwrap();
        assert_eq!(s.config.architecture(), ("Qwen3MoeForCausalLM", "qwen3_moe"));
        assert_eq!(g.config.moe, s.config.moe);
        assert_eq!(g.config.gguf_architecture(), "qwen3moe");
        let logits = |ck: &Checkpoint| {
            let model = DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).unwrap();
            let mut cache = ContiguousKvCache::for_config(&ck.config, DType::F32, &Device::Cpu);
            let mut batch = ForwardBatch::new();
            batch.push(0, 0, &[9707, 11, 151643, 40, 1000, 77], LogitsRows::All);
            model.forward(&batch, &mut cache).unwrap().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let (a, b, c) = (logits(&s), logits(&g), logits(&q));
        assert!(a.iter().all(|x| x.is_finite()));
        assert_eq!(a, b, "safetensors and the F32 GGUF compute the same logits");
        let err = a.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(err > 0.0 && err < 0.2, "Q8_0 experts: max logit error {err}");
        forward_is_finite(q8.to_str().unwrap());
    }

    /// GGUF's merged experts in an int8 type run as one grouped kernel call per projection:
    /// the logits have exactly the bits of the same experts held apart (one kernel call per
    /// expert), and a sequence's logits do not change when other sequences share the batch.
    #[test]
    fn merged_experts_match_separate_ones_and_are_batch_invariant() {
        use crate::decoder::with_separate_experts;
        let dir = tempfile::tempdir().unwrap();
        for ty in [GgufType::Q8_0, GgufType::Q4_0] {
            let out = dir.path().join(ty.as_str());
            synth(&SynthOptions { shape: "tiny-qwen3-moe".into(), ..opts(&out, DType::F32, Some(ty), 9) }).unwrap();
            let ck = Checkpoint::open(out.to_str().unwrap()).unwrap();
            let load = || DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).unwrap();
            let (merged, separate) = (load(), with_separate_experts(load));
            assert_eq!((merged.merged_expert_layers(), separate.merged_expert_layers()), (2, 0));
            let prompts: [&[u32]; 3] = [&[9707, 11, 151643, 40, 1000, 77, 5], &[17, 4000], &[300, 301, 302, 303, 9]];
            let run = |model: &DecoderModel, seqs: &[usize]| -> Vec<Vec<f32>> {
                let mut cache = ContiguousKvCache::for_config(&ck.config, DType::F32, &Device::Cpu);
                let mut batch = ForwardBatch::new();
                for &s in seqs {
                    batch.push(s, 0, prompts[s], LogitsRows::All);
                }
                let v = model.forward(&batch, &mut cache).unwrap().unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let vocab = ck.config.vocab_size;
                let mut at = 0;
                seqs.iter()
                    .map(|&s| {
                        let part = v[at..at + prompts[s].len() * vocab].to_vec();
                        at += prompts[s].len() * vocab;
                        part
                    })
                    .collect()
            };
            let together = run(&merged, &[0, 1, 2]);
            assert_eq!(together, run(&separate, &[0, 1, 2]), "{ty}: merged and separate experts");
            for (s, logits) in together.iter().enumerate() {
                assert_eq!(logits, &run(&merged, &[s])[0], "{ty}: sequence {s} alone and batched");
            }
        }
    }

    #[test]
    fn same_seed_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let read_all = |d: &Path| -> Vec<(String, Vec<u8>)> {
            let mut v: Vec<_> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| {
                    let p = e.unwrap().path();
                    (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
                })
                .collect();
            v.sort();
            v
        };
        let [a, b, c] = ["a", "b", "c"].map(|n| dir.path().join(n));
        synth(&opts(&a, DType::BF16, None, 42)).unwrap();
        synth(&opts(&b, DType::BF16, None, 42)).unwrap();
        synth(&opts(&c, DType::BF16, None, 43)).unwrap();
        assert_eq!(read_all(&a), read_all(&b));
        assert_ne!(read_all(&a), read_all(&c));
        // A non-empty output directory is refused.
        let e = synth(&opts(&a, DType::BF16, None, 42)).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
    }

    /// Manual: `FLINT_SYNTH_OUT=/tmp/q05 cargo test --release -p flint-model synth_qwen05_timed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn synth_qwen05_timed() {
        let out = std::env::var("FLINT_SYNTH_OUT").unwrap_or_else(|_| "/tmp/flint-synth-qwen2.5-0.5b".into());
        let shape = std::env::var("FLINT_SYNTH_SHAPE").unwrap_or_else(|_| "qwen2.5-0.5b".into());
        let gguf = std::env::var("FLINT_SYNTH_GGUF").ok().map(|t| t.parse::<GgufType>().unwrap());
        let t0 = std::time::Instant::now();
        let mut o = opts(Path::new(&out), DType::F32, gguf, 0);
        o.shape = shape;
        let r = synth(&o).unwrap();
        eprintln!("{} params, {} bytes, {:.1}s", r.parameters, r.total_bytes, t0.elapsed().as_secs_f64());
    }
}
