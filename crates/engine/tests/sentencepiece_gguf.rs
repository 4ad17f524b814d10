//! A SentencePiece tokenizer as llama.cpp stores it in GGUF (`tokenizer.ggml.model = "llama"`,
//! Mistral 7B's, taken from the `mistral-common` package by scripts/spm_tokenizer_fixture.py)
//! against the sentencepiece library itself: the same ids for every case (spaces, newlines, code,
//! accents, CJK, emoji, byte fallback), the same decoded text, the BOS in front with special
//! tokens, and token bytes that spell the text (what structured outputs' token trie reads).

use std::path::{Path, PathBuf};

use flint_engine::tokenizer::Tokenizer;
use flint_model::gguf::GgufTokenizerMeta;
use flint_model::weights::GgufWeights;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tokenizers")
}

fn tokenizer() -> (Tokenizer, GgufTokenizerMeta) {
    let g = GgufWeights::open(&fixtures().join("mistral-v1-spm.gguf")).unwrap();
    let meta = GgufTokenizerMeta::from_metadata(&g.content.metadata).expect("tokenizer metadata");
    assert_eq!(meta.model, "llama");
    (Tokenizer::from_gguf(&meta).unwrap_or_else(|e| panic!("{e}")), meta)
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("mistral-v1-spm-cases.json")).unwrap();
    serde_json::from_str::<Value>(&text).unwrap().as_array().unwrap().clone()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn sentencepiece_from_gguf_matches_sentencepiece() {
    let (tok, meta) = tokenizer();
    let bos = meta.bos_token_id.unwrap();
    let mut checked = 0;
    for case in cases() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        // Control pieces written as text are matched as control tokens here, as Hugging Face's
        // tokenizers and vLLM do; sentencepiece reads them as text.
        if ["<s>", "</s>", "<unk>"].iter().any(|c| text.contains(c)) {
            assert!(tok.encode(text, false).unwrap().contains(&bos) == text.contains("<s>"), "{text:?}");
            continue;
        }
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "{text:?}: pieces {:?}", case["pieces"]);
        assert_eq!(tok.decode(&got, false).unwrap(), case["decoded"].as_str().unwrap(), "{text:?}");
        if !text.is_empty() {
            assert_eq!(tok.encode(text, true).unwrap(), [vec![bos], want.clone()].concat(), "{text:?}: BOS first");
            let bytes: Vec<u8> = got.iter().flat_map(|&i| tok.token_bytes(i).unwrap()).collect();
            // What sentencepiece decodes (a `▁` typed in the text reads back as a space).
            let decoded = case["decoded"].as_str().unwrap();
            assert_eq!(String::from_utf8_lossy(&bytes), format!(" {decoded}"), "token bytes");
        }
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} cases compared");
}

/// The same tokenizer written as a `tokenizer.json` (the form Llama 2 and Mistral checkpoints
/// ship) and read back: the same ids, and its token bytes still read as SentencePiece's.
#[test]
fn as_tokenizer_json_it_encodes_and_spells_the_same() {
    let (tok, _) = tokenizer();
    let json = Tokenizer::from_json_bytes(tok.to_json().unwrap().as_bytes()).unwrap();
    for case in cases() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(json.encode(text, true).unwrap(), ids, "{text:?}");
        for &i in &ids {
            assert_eq!(json.token_bytes(i), tok.token_bytes(i), "{text:?}: token {i}");
        }
    }
}

#[test]
fn a_sentencepiece_gguf_without_scores_is_refused_naming_the_field() {
    let (_, mut meta) = tokenizer();
    meta.scores.pop();
    let e = Tokenizer::from_gguf(&meta).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.scores"), "{e}");
}
