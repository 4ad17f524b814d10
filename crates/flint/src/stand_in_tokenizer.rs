//! A stand-in for Llama 3's tokenizer in synthesized Llama GGUF files, so that `flint bench`
//! and llama.cpp can both load a random-weight Llama shape (Llama 3's own tokenizer is not in
//! any package flint may ship).
//!
//! It is laid out as Llama 3's is — byte-level BPE named `llama-bpe`, the ordinary tokens first,
//! then 256 special tokens in Llama 3's order (`<|begin_of_text|>`, `<|end_of_text|>`, …,
//! `<|eot_id|>` at +9), BOS added — but its ordinary tokens and merges are Qwen's first ids, so
//! it splits text as Llama 3 would and merges it as Qwen would. Benchmarks feed token ids and
//! do not care; text through it is not Llama 3's.

use anyhow::{bail, Result};
use flint_engine::tokenizer::{GgufTokenizerMeta, Tokenizer};

/// Llama 3's special tokens, by offset from the first one; the rest are reserved.
const NAMED_SPECIALS: &[(usize, &str)] = &[
    (0, "<|begin_of_text|>"),
    (1, "<|end_of_text|>"),
    (4, "<|finetune_right_pad_id|>"),
    (6, "<|start_header_id|>"),
    (7, "<|end_header_id|>"),
    (8, "<|eom_id|>"),
    (9, "<|eot_id|>"),
    (10, "<|python_tag|>"),
];
const SPECIALS: usize = 256;

/// The stand-in for a vocabulary of `vocab` ids (128,256 for Llama 3), from `qwen`'s tokens.
pub fn llama3_stand_in(qwen: &Tokenizer, vocab: usize) -> Result<GgufTokenizerMeta> {
    let Some(normal) = vocab.checked_sub(SPECIALS).filter(|&n| n >= 256) else {
        bail!("a vocabulary of {vocab} ids has no room for Llama 3's {SPECIALS} special tokens");
    };
    let source = qwen.to_gguf_meta(qwen.len())?;
    if source.tokens.len() < normal || source.token_types[..normal].iter().any(|&t| t != 1) {
        bail!("the built-in tokenizer has fewer than {normal} ordinary tokens");
    }
    let mut tokens = source.tokens[..normal].to_vec();
    let kept: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
    // A merge survives when both parts and their join are kept tokens.
    let merges: Vec<String> = source
        .merges
        .iter()
        .filter(|m| {
            m.split_once(' ')
                .is_some_and(|(a, b)| kept.contains(a) && kept.contains(b) && kept.contains(&*format!("{a}{b}")))
        })
        .cloned()
        .collect();
    let mut reserved = 0;
    for i in 0..SPECIALS {
        match NAMED_SPECIALS.iter().find(|(at, _)| *at == i) {
            Some((_, name)) => tokens.push(name.to_string()),
            None => {
                tokens.push(format!("<|reserved_special_token_{reserved}|>"));
                reserved += 1;
            }
        }
    }
    let mut token_types = vec![1; normal];
    token_types.extend(std::iter::repeat_n(3, SPECIALS));
    let id = |offset: usize| u32::try_from(normal + offset).ok();
    Ok(GgufTokenizerMeta {
        model: "gpt2".into(),
        pre: Some("llama-bpe".into()),
        tokens,
        token_types,
        merges,
        bos_token_id: id(0),
        eos_token_id: id(9),
        padding_token_id: id(4),
        add_bos_token: Some(true),
        chat_template: None,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_layout_and_it_loads() {
        let qwen = Tokenizer::builtin_qwen().unwrap();
        let meta = llama3_stand_in(&qwen, 128_256).unwrap();
        assert_eq!(meta.tokens.len(), 128_256);
        assert_eq!(meta.tokens[128_000], "<|begin_of_text|>");
        assert_eq!(meta.tokens[128_009], "<|eot_id|>");
        assert_eq!(meta.tokens[128_255], "<|reserved_special_token_247|>");
        assert_eq!((meta.bos_token_id, meta.eos_token_id), (Some(128_000), Some(128_009)));
        let tok = Tokenizer::from_gguf(&meta).unwrap();
        let ids = tok.encode("Hello world, 12345", true).unwrap();
        assert_eq!(ids[0], 128_000, "BOS first");
        assert!(ids.iter().all(|&t| t < 128_256), "{ids:?}");
        assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world, 12345");
        assert!(llama3_stand_in(&qwen, 200).is_err());
    }
}
