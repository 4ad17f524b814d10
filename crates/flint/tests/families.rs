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
