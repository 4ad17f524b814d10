//! The golden gate for the families beside Qwen2 (fixtures written by
//! `scripts/golden_families.py`): Qwen3 (per-head q/k norm, head_dim ≠ hidden / heads, tied),
//! Llama 3 (`llama3` RoPE scaling, transformers 5's `rope_parameters`) and Mistral (a sliding
//! window shorter than the longer prompts). Each is read twice: the safetensors checkpoint and
//! the same bf16 numbers as a GGUF in llama.cpp's layout (Llama's q/k rows permuted, its
//! scaling as `rope_freqs`). Both must give transformers' logits within 1e-4 and its greedy
//! tokens, over the contiguous and the paged cache.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use flint_model::config::Family;
use flint_model::kernels::matmul_f32::Bf16Compute;
use flint_model::linear::with_bf16_compute;
use flint_model::source::Checkpoint;
use flint_model::{ContiguousKvCache, DecoderModel, KvCache, KvCacheDtype, PagedKvCache, RopeScaling};

mod golden_common;

use golden_common::*;

fn family_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/families").join(name)
}

/// bf16 weights widened exactly as they are read, so both sides compute in f32 (the bf16
/// dot-product default is covered for Qwen2 by the full-vocab gate).
fn load(spec: &Path) -> (Checkpoint, DecoderModel) {
    let ck = Checkpoint::open(spec.to_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let model = with_bf16_compute(Bf16Compute::WidenF32, || {
        DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"))
    });
    (ck, model)
}

fn check(name: &str, model: &DecoderModel, reference: &Reference) {
    for paged in [false, true] {
        let cfg = model.config();
        let cache = || -> Box<dyn KvCache> {
            if paged {
                Box::new(PagedKvCache::new(cfg, KvCacheDtype::F32, 16, POOL_BLOCKS).unwrap())
            } else {
                Box::new(ContiguousKvCache::for_config(cfg, DType::F32, &Device::Cpu))
            }
        };
        let label = format!("{name}{}", if paged { " paged" } else { "" });
        assert_within(&label, &run_with_cache(model, reference, 0.0, paged, &cache), 1e-4);
    }
}

/// Both files of one family against its reference; returns the two configs.
fn gate(family: &str) -> (flint_model::ModelConfig, flint_model::ModelConfig) {
    let dir = family_dir(family);
    let reference = Reference::load(&dir.join("reference.safetensors"));
    let (st, model) = load(&dir);
    check(&format!("{family} safetensors"), &model, &reference);
    let (gguf, model) = load(&dir.join("model-bf16.gguf"));
    assert!(gguf.gguf().is_some());
    check(&format!("{family} gguf"), &model, &reference);
    (st.config, gguf.config)
}

#[test]
fn qwen3_matches_transformers() {
    let (st, gguf) = gate("qwen3");
    for c in [&st, &gguf] {
        assert_eq!(c.family, Family::Qwen3);
        assert!(c.qk_norm && !c.qkv_bias && c.tie_word_embeddings);
        assert_eq!((c.head_dim, c.hidden_size, c.num_attention_heads), (48, 128, 4));
    }
}

#[test]
fn llama3_matches_transformers() {
    let (st, gguf) = gate("llama3");
    assert_eq!(st.family, Family::Llama);
    assert!(matches!(st.rope.scaling, RopeScaling::Llama3 { factor: 8.0, original_max_position_embeddings: 64, .. }));
    // The GGUF carries the scaling as llama.cpp's per-frequency divisors; the gate above shows
    // both give transformers' numbers.
    assert!(matches!(&gguf.rope.scaling, RopeScaling::FreqFactors(f) if f.len() == 16 && f.iter().any(|x| *x > 1.0)));
    assert!(!st.qkv_bias && !st.qk_norm && !st.tie_word_embeddings);
}

#[test]
fn mistral_with_a_window_shorter_than_the_prompt_matches_transformers() {
    let (st, gguf) = gate("mistral");
    for c in [&st, &gguf] {
        assert_eq!(c.family, Family::Mistral);
        assert!(c.sliding_window_layers.iter().all(|w| *w == Some(64)), "{:?}", c.sliding_window_layers);
    }
    let r = Reference::load(&family_dir("mistral").join("reference.safetensors"));
    assert!(r.ids("prompt.4").len() > 64 * 4, "the window must bind");
}

/// The permutation is what makes the GGUF right: read without undoing it, the same file gives
/// other logits (so the gate above cannot pass by accident).
#[test]
fn llama_gguf_rows_really_are_permuted() {
    let dir = family_dir("llama3");
    let st = Checkpoint::open(dir.to_str().unwrap()).unwrap();
    let gguf = Checkpoint::open(dir.join("model-bf16.gguf").to_str().unwrap()).unwrap();
    let raw = flint_model::weights::GgufWeights::open(&dir.join("model-bf16.gguf")).unwrap();
    let raw = flint_model::weights::WeightSource::Gguf(raw);
    let name = "model.layers.0.self_attn.q_proj.weight";
    let shape = [128, 128];
    let get = |w: &flint_model::weights::WeightSource| {
        w.get_dense(name, &shape, DType::F32, &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert_eq!(get(&st.weights), get(&gguf.weights), "un-permuted GGUF rows are the checkpoint's");
    assert_ne!(get(&st.weights), get(&raw), "the file's own rows are permuted");
}

/// Embedding checkpoints (Qwen3-Embedding) are saved from the base model: the same tensors
/// without `model.` in their names. Such a copy of the Qwen3 fixture loads and matches.
#[test]
fn a_checkpoint_saved_from_the_base_model_loads() {
    let dir = family_dir("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).unwrap();
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let bare: std::collections::HashMap<String, candle_core::Tensor> =
        tensors.into_iter().map(|(k, v)| (k.strip_prefix("model.").map(str::to_string).unwrap_or(k), v)).collect();
    assert!(bare.contains_key("layers.0.self_attn.q_norm.weight") && !bare.keys().any(|k| k.starts_with("model.")));
    candle_core::safetensors::save(&bare, tmp.path().join("model.safetensors")).unwrap();
    let (_, model) = load(tmp.path());
    check("qwen3 base-model names", &model, &Reference::load(&dir.join("reference.safetensors")));
}

/// Mixtures of experts: Qwen3-MoE with a dense layer among the
/// sparse ones (`mlp_only_layers`) and renormalised routing, Qwen2-MoE with its sigmoid-gated
/// shared expert. Every routing decision of the fixtures is clear by 1e-5 (the script checks),
/// so a token reaches the same experts here as in transformers.
///
/// Each is read from safetensors (one tensor per expert) and from a GGUF in llama.cpp's
/// `qwen3moe`/`qwen2moe` layout (each projection's experts merged into one 3-D tensor, the router
/// in F32); both configs must agree.
#[test]
fn mixtures_of_experts_match_transformers() {
    for family in ["qwen3_moe", "qwen2_moe"] {
        let (st, gguf) = gate(family);
        let (_, model) = load(&family_dir(family).join("model-bf16.gguf"));
        assert!(model.is_batch_invariant());
        let mut from_gguf = gguf.clone();
        from_gguf.torch_dtype = st.torch_dtype.clone();
        from_gguf.rms_norm_eps = st.rms_norm_eps;
        from_gguf.eos_token_ids = st.eos_token_ids.clone();
        assert_eq!(from_gguf, st, "{family}: the GGUF's config is the checkpoint's");
        let moe = st.moe.as_ref().expect("a mixture of experts");
        assert_eq!((moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size), (8, 2, 64));
        if family == "qwen3_moe" {
            assert_eq!(st.family, Family::Qwen3);
            assert!(moe.norm_topk_prob && moe.shared_expert_intermediate_size.is_none());
            assert_eq!(moe.sparse_layers, vec![true, false]);
        } else {
            assert_eq!(st.family, Family::Qwen2);
            assert!(st.qkv_bias && !moe.norm_topk_prob);
            assert_eq!(moe.shared_expert_intermediate_size, Some(96));
            assert_eq!(moe.sparse_layers, vec![true, true]);
        }
    }
}
