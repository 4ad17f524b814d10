//! A Qwen3 checkpoint through the real binary: `flint synth` writes one (safetensors and GGUF),
//! `flint inspect` names its family, and `flint serve` answers with Qwen3's chat template (the
//! built-in tokenizer's, with `enable_thinking` from `chat_template_kwargs`) and the `qwen3`
//! reasoning parser; the GGUF (arch `qwen3`, f32, the same synthesized numbers) gives the same
//! greedy text as the safetensors.

mod common;

use common::*;
use serde_json::{json, Value};

fn synth(dir: &std::path::Path, extra: &[&str]) {
    let o = flint().args(["synth", "--shape", "tiny-qwen3", "--out"]).arg(dir).args(extra).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn inspect(model: &std::path::Path) -> String {
    let o = flint().args(["inspect", "--model"]).arg(model).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

async fn greedy(s: &Server, kwargs: Value) -> Value {
    let body = json!({
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 12, "temperature": 0, "chat_template_kwargs": kwargs,
    });
    let (st, r) = post(s, "/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{r}");
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_serves_from_safetensors_and_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let (st_dir, gguf_dir) = (tmp.path().join("st"), tmp.path().join("gguf"));
    synth(&st_dir, &["--dtype", "f32"]);
    synth(&gguf_dir, &["--gguf", "f32"]);
    let gguf = gguf_dir.join("model-f32.gguf");
    for text in [inspect(&st_dir), inspect(&gguf)] {
        assert!(text.contains("architecture:    Qwen3ForCausalLM (qwen3)"), "{text}");
        assert!(text.contains("q/k head norm") && text.contains("head_dim 32"), "{text}");
    }
    let g = flint_model::weights::GgufWeights::open(&gguf).unwrap();
    let arch = g.metadata()["general.architecture"].to_string().unwrap().clone();
    assert_eq!(arch, "qwen3");
    assert!(g.content.tensor_infos.contains_key("blk.1.attn_k_norm.weight"));
    assert!(!g.content.tensor_infos.contains_key("blk.0.attn_q.bias"), "Qwen3 has no q/k/v bias");

    let mut answers = Vec::new();
    for model in [st_dir.clone(), gguf.clone()] {
        let s = start(&["--model", model.to_str().unwrap(), "--reasoning-parser", "qwen3"], None).await;
        // Qwen3's template closes an empty think block when thinking is off.
        let msgs = json!([{"role": "user", "content": "Hi"}]);
        let body = json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": false}});
        let (st, r) = post(&s, "/tokenize", body).await;
        assert_eq!(st, 200, "{r}");
        let prompt = r["prompt"].as_str().unwrap();
        assert!(prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{prompt:?}");
        let (_, r) = post(&s, "/tokenize", json!({"messages": msgs})).await;
        assert!(r["prompt"].as_str().unwrap().ends_with("<|im_start|>assistant\n"), "{r}");

        // Thinking off: the parser finds no <think>, so everything is the answer.
        let off = greedy(&s, json!({"enable_thinking": false})).await;
        let m = &off["choices"][0]["message"];
        assert!(m["reasoning"].is_null() || m["reasoning"] == "", "{off}");
        assert!(m["content"].as_str().is_some_and(|c| !c.is_empty()), "{off}");
        // Thinking on (the default): whatever the random model writes is reasoning until a
        // </think> it will not produce.
        let on = greedy(&s, json!({})).await;
        assert_eq!(on["usage"]["completion_tokens"], 12, "{on}");
        answers.push((off["choices"][0]["message"]["content"].clone(), on["choices"][0]["message"].clone()));
    }
    assert_eq!(answers[0], answers[1], "the f32 GGUF holds the safetensors' numbers");
}

/// The id of `<|begin_of_text|>` in [`llama_style_tokenizer`] (`<|eot_id|>` follows it).
const BOS: u32 = 45;

/// A tokenizer as a Llama 3 GGUF stores it, at the golden model's 512 ids: byte-level BPE named
/// `llama-bpe`, the special tokens after the ordinary ones, `<|begin_of_text|>` added in front
/// of a prompt, a template that writes it itself.
fn llama_style_tokenizer() -> flint_model::gguf::GgufTokenizerMeta {
    let merges = ["h i", "Ġ t", "h e", "Ġt he", "Ġthe r", "1 2", "12 3"].map(String::from).to_vec();
    let mut tokens: Vec<String> = "abcdefghijklmnopqrstuvwxyzĠĊ0123456789".chars().map(String::from).collect();
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    let mut types = vec![1; tokens.len()];
    // As in a real Llama 3 file: the special tokens right after the ordinary ones.
    assert_eq!(tokens.len(), BOS as usize);
    tokens.extend(["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"].map(String::from));
    types.extend([3, 3, 3, 3]);
    while tokens.len() < 512 {
        tokens.push(format!("[PAD{}]", tokens.len()));
        types.push(5);
    }
    flint_model::gguf::GgufTokenizerMeta {
        model: "gpt2".into(),
        pre: Some("llama-bpe".into()),
        tokens,
        token_types: types,
        merges,
        bos_token_id: Some(BOS),
        eos_token_id: Some(BOS + 1),
        padding_token_id: Some(BOS + 1),
        add_bos_token: Some(true),
        chat_template: Some(
            "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n\
             {{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant\
             <|end_header_id|>\n\n{% endif %}"
                .into(),
        ),
        ..Default::default()
    }
}

/// A Llama GGUF in llama.cpp's layout (q/k rows permuted, `rope_freqs`) with its own
/// `llama-bpe` tokenizer serves: a completion's prompt gets the BOS in front (as vLLM encodes
/// completions), a chat prompt only the template's, and generation runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_llama_gguf_with_its_own_tokenizer_serves() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/families/llama3");
    let ck = flint_model::source::Checkpoint::open(fixture.to_str().unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("llama.gguf");
    let meta = llama_style_tokenizer();
    let mut cfg = ck.config.clone();
    (cfg.bos_token_id, cfg.eos_token_ids) = (Some(BOS), vec![BOS + 1]);
    let ty = flint_model::gguf_export::GgufType::F32;
    flint_model::gguf_export::export_checkpoint(&ck.weights, &cfg, &gguf, ty, Some(&meta), "llama").unwrap();
    let text = inspect(&gguf);
    assert!(text.contains("LlamaForCausalLM") && text.contains("rope_freqs"), "{text}");

    // A load failure is one line on the CLI: show it rather than a server that never starts.
    let o = flint()
        .args(["generate", "--model"])
        .arg(&gguf)
        .args(["--prompt", "hi", "--max-tokens", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = start(&["--model", gguf.to_str().unwrap()], Some(tmp)).await;
    let (st, r) = post(&s, "/tokenize", json!({"prompt": "hi there 12345"})).await;
    assert_eq!(st, 200, "{r}");
    let ids: Vec<u64> = r["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(ids[0], BOS as u64, "BOS first: {ids:?}");
    assert_eq!(ids.iter().filter(|&&t| t == BOS as u64).count(), 1, "{ids:?}");
    // "12345": digits in runs of three, then merged ("123", "4", "5").
    let t123 = meta.tokens.iter().position(|t| t == "123").unwrap() as u64;
    assert!(ids.contains(&t123), "{ids:?}");

    let (st, r) = post(&s, "/v1/completions", json!({"prompt": "hi there", "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], 4, "BOS, hi, Ġther, e: {r}");
    assert_eq!(r["usage"]["completion_tokens"], 4, "{r}");

    let msgs = json!([{"role": "user", "content": "hi"}]);
    let (_, r) = post(&s, "/tokenize", json!({"messages": msgs})).await;
    let chat: Vec<u64> = r["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(chat.iter().filter(|&&t| t == BOS as u64).count(), 1, "only the template's BOS: {chat:?}");
    assert_eq!(chat[0], BOS as u64);
    let (st, r) = post(&s, "/v1/chat/completions", json!({"messages": msgs, "max_tokens": 3})).await;
    assert_eq!(st, 200, "{r}");
}

/// A mixture of experts through `flint serve` with the features dense models have: the Qwen3-MoE
/// golden checkpoint beside a tokenizer.json (the Llama-style stand-in above, written out),
/// served with the int8 cache and n-gram speculation. Greedy text is the same with and without
/// speculation and on a prefix-cache hit, and a `choice` constraint holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixture_of_experts_serves_with_cache_speculation_and_constraints() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/families/qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("moe");
    std::fs::create_dir(&dir).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    let tok = flint_engine::tokenizer::Tokenizer::from_gguf(&llama_style_tokenizer()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tok.to_json().unwrap()).unwrap();
    let text = inspect(&dir);
    assert!(text.contains("Qwen3MoeForCausalLM (qwen3_moe)"), "{text}");
    assert!(text.contains("8 of size 64, 2 per token (renormalised); 1 of 2 layers sparse"), "{text}");

    let model = dir.to_str().unwrap().to_string();
    let prompt = "the the hi there 123 the the hi there 123 the the hi there 123 the the hi".repeat(8);
    let body = json!({"prompt": prompt, "max_tokens": 24, "ignore_eos": true, "temperature": 0});
    let plain = start(&["--model", &model, "--kv-cache-dtype", "int8"], None).await;
    let (st, a) = post(&plain, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["usage"]["completion_tokens"], 24, "{a}");
    let (_, b) = post(&plain, "/v1/completions", body.clone()).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "greedy text changed on a prefix-cache hit");
    assert!(b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 0, "{b}");
    let choice = json!({"prompt": "hi", "max_tokens": 8, "structured_outputs": {"choice": ["the", "hi there"]}});
    let (st, c) = post(&plain, "/v1/completions", choice).await;
    assert_eq!(st, 200, "{c}");
    let text = c["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(text == "the" || text == "hi there", "{c}");
    drop(plain);

    let spec = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}"#;
    let fast = start(&["--model", &model, "--kv-cache-dtype", "int8", "--speculative-config", spec], Some(tmp)).await;
    let (st, d) = post(&fast, "/v1/completions", body).await;
    assert_eq!(st, 200, "{d}");
    assert_eq!(a["choices"][0]["text"], d["choices"][0]["text"], "speculation changed the greedy text");
}
