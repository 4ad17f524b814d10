//! Text in, tokens out, through the whole stack, against transformers: the real Qwen tokenizer and
//! chat template produce the same prompt ids as Hugging Face's, and `generate` on the full-vocab
//! bf16 golden model yields transformers' greedy tokens.

use std::path::{Path, PathBuf};

use candle_core::Device;
use flint_engine::chat_template::ChatTemplate;
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{generate, GenerateRequest, LoadedModel, RequestParams};
use safetensors::SafeTensors;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ids(st: &SafeTensors, name: &str) -> Vec<u32> {
    let v = st.tensor(name).unwrap();
    v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

/// The full-vocab fixture plus the repository's tokenizer files, as a user's download would be.
fn full_vocab_checkpoint(tmp: &Path) {
    let src = root().join("fixtures/golden/full-vocab-bf16");
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), tmp.join(f)).unwrap();
    }
    let json = Tokenizer::builtin_qwen_json().unwrap();
    std::fs::write(tmp.join("tokenizer.json"), json).unwrap();
    std::fs::copy(root().join("assets/qwen-tokenizer/tokenizer_config.json"), tmp.join("tokenizer_config.json"))
        .unwrap();
}

#[test]
fn prompts_and_greedy_tokens_match_transformers() {
    let bytes = std::fs::read(root().join("fixtures/golden/full-vocab-bf16/reference.safetensors")).unwrap();
    let reference = SafeTensors::deserialize(&bytes).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    full_vocab_checkpoint(tmp.path());
    let lm = LoadedModel::load(Some(tmp.path().to_str().unwrap()), &Device::Cpu, None).unwrap();
    assert!(lm.eos_token_ids.contains(&151645) && lm.eos_token_ids.contains(&151643), "{:?}", lm.eos_token_ids);
    assert_eq!(lm.valid_vocab(), lm.tokenizer.len(), "padded vocab rows must be excluded");

    let plain = lm.tokenizer.encode("Hello world", false).unwrap();
    assert_eq!(plain, ids(&reference, "prompt.0"));
    let template: &ChatTemplate = lm.chat_template.as_ref().unwrap();
    let messages = vec![
        serde_json::json!({"role": "system", "content": "You are a helpful assistant."}),
        serde_json::json!({"role": "user", "content": "Write a haiku about Rust."}),
    ];
    let text = template.render(&messages, None, true, &serde_json::Map::new()).unwrap();
    let chat = lm.tokenizer.encode(&text, false).unwrap();
    assert_eq!(chat, ids(&reference, "prompt.1"));

    for (k, prompt) in [plain, chat].into_iter().enumerate() {
        let want = ids(&reference, &format!("greedy.{k}"));
        let req = GenerateRequest {
            prompt_ids: prompt,
            params: RequestParams { max_tokens: want.len(), ignore_eos: true, ..Default::default() },
            kv_cache_dtype: None,
            speculative: None,
        };
        let out = generate(&lm, &req, |_| {}).unwrap();
        assert_eq!(out.token_ids, want, "prompt {k}: greedy tokens differ from transformers");
        // Streaming pieces concatenate to the full decode.
        assert_eq!(out.text, lm.tokenizer.decode(&out.token_ids, true).unwrap());
    }
}
