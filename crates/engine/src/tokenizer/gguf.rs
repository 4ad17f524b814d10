//! The tokenizer as llama.cpp stores it in GGUF metadata (`tokenizer.ggml.*`), both ways:
//! building a [`Tokenizer`] from a GGUF file's vocabulary and merges, and exporting one for the
//! GGUF writer. Kept apart from the `tokenizer.json` path because GGUF carries no pre-tokenizer,
//! normaliser or decoder: they are rebuilt here for the two byte-level BPE families llama.cpp
//! names in `tokenizer.ggml.pre`, Qwen2's and Llama 3's.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::sequence::Sequence as PostSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    SplitDelimiterBehavior, TokenizerBuilder,
};

use super::{GgufTokenizerMeta, Result, Tokenizer, TokenizerError};

/// Qwen2's pre-tokenizer split regex, exactly as it appears in Qwen's `tokenizer.json`
/// (and as llama.cpp hard-codes it for `tokenizer.ggml.pre = "qwen2"`). GGUF files do not
/// carry the regex, so it has to live here.
const QWEN2_SPLIT_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split regex, as in its `tokenizer.json` (llama.cpp's `LLAMA3` pre-type): Qwen2's
/// but with digits in runs of up to three.
const LLAMA3_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenization a GGUF's `tokenizer.ggml.pre` names, by llama.cpp's names for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreTokenizerKind {
    /// `qwen2`, `deepseek-r1-qwen`: Qwen2's regex after NFC normalisation.
    Qwen2,
    /// `llama3`, `llama-v3`, `llama-bpe`: Llama 3's regex, no normaliser.
    Llama3,
}

impl PreTokenizerKind {
    fn from_gguf(pre: Option<&str>) -> Option<Self> {
        match pre? {
            "qwen2" | "deepseek-r1-qwen" => Some(Self::Qwen2),
            "llama3" | "llama-v3" | "llama-bpe" => Some(Self::Llama3),
            _ => None,
        }
    }

    fn regex(self) -> &'static str {
        match self {
            Self::Qwen2 => QWEN2_SPLIT_REGEX,
            Self::Llama3 => LLAMA3_SPLIT_REGEX,
        }
    }
}

/// GGUF token types as defined by llama.cpp (`llama_token_type`).
pub mod gguf_token_type {
    /// An ordinary vocabulary entry produced by BPE merges.
    pub const NORMAL: i32 = 1;
    /// The unknown token.
    pub const UNKNOWN: i32 = 2;
    /// A special/control token (HF `special: true` added token).
    pub const CONTROL: i32 = 3;
    /// A user-defined added token (HF `special: false` added token).
    pub const USER_DEFINED: i32 = 4;
    /// Padding entry that only exists to make the vocabulary match the embedding size.
    pub const UNUSED: i32 = 5;
    /// A raw byte token (SentencePiece byte fallback).
    pub const BYTE: i32 = 6;
}

/// True for llama.cpp's `[PAD<id>]` vocabulary padding entries.
fn is_pad_entry(token: &str, id: usize) -> bool {
    token
        .strip_prefix("[PAD")
        .and_then(|rest| rest.strip_suffix(']'))
        .is_some_and(|digits| digits.parse::<usize>().ok() == Some(id))
}

/// Byte-level offsets, then (`tokenizer.ggml.add_bos_token`) the BOS id in front of a text
/// encoded with special tokens, as Llama 3's `tokenizer.json` does. A chat prompt is encoded
/// without them: its template writes the BOS itself.
fn post_processor(meta: &GgufTokenizerMeta, byte_level: ByteLevel) -> Result<PostProcessorWrapper> {
    let bos = match (meta.add_bos_token, meta.bos_token_id) {
        (Some(true), Some(id)) => meta.tokens.get(id as usize).map(|t| (t.clone(), id)),
        (Some(true), None) => {
            return Err(TokenizerError::Gguf {
                field: "tokenizer.ggml.bos_token_id",
                reason: "add_bos_token is true but no BOS id is given".into(),
            })
        }
        _ => None,
    };
    let Some((token, id)) = bos else { return Ok(PostProcessorWrapper::ByteLevel(byte_level)) };
    Ok(PostProcessorWrapper::Sequence(PostSequence::new(vec![
        PostProcessorWrapper::ByteLevel(byte_level),
        PostProcessorWrapper::Template(bos_template(&token, id)?),
    ])))
}

/// The BOS `token` (id `id`) in front of a text, and of each text of a pair.
pub(super) fn bos_template(token: &str, id: u32) -> Result<TemplateProcessing> {
    let err = |e: String| TokenizerError::Gguf { field: "tokenizer.ggml.add_bos_token", reason: e };
    TemplateProcessing::builder()
        .try_single(format!("{token} $A"))
        .and_then(|b| b.try_pair(format!("{token} $A {token} $B:1")))
        .map_err(err)?
        .special_tokens(vec![(token.to_string(), id)])
        .build()
        .map_err(|e| err(e.to_string()))
}

impl Tokenizer {
    /// Builds the tokenizer described by llama.cpp GGUF metadata: byte-level BPE with Qwen2's
    /// split regex and NFC normalisation, or Llama 3's regex and no normaliser, BOS added when
    /// the file says so. Control (type 3) and
    /// user-defined (type 4) tokens become added tokens, `special` for control tokens only
    /// so that `skip_special_tokens` behaves as with the original `tokenizer.json`
    /// (where e.g. `<think>` is an added but non-special token). `[PAD<id>]`/unused
    /// padding entries are skipped.
    pub fn from_gguf(meta: &GgufTokenizerMeta) -> Result<Self> {
        use gguf_token_type::{CONTROL, UNUSED, USER_DEFINED};

        if meta.model == "llama" {
            return Self::from_gguf_sentencepiece(meta);
        }
        if meta.model != "gpt2" {
            return Err(TokenizerError::Gguf {
                field: "tokenizer.ggml.model",
                reason: format!(
                    "unsupported tokenizer model {:?} (supported: byte-level BPE \"gpt2\", SentencePiece \"llama\")",
                    meta.model
                ),
            });
        }
        let Some(kind) = PreTokenizerKind::from_gguf(meta.pre.as_deref()) else {
            return Err(TokenizerError::Gguf {
                field: "tokenizer.ggml.pre",
                reason: format!(
                    "unsupported pre-tokenizer {:?} (supported: qwen2, deepseek-r1-qwen, llama3, llama-v3, llama-bpe)",
                    meta.pre
                ),
            });
        };
        if meta.token_types.len() != meta.tokens.len() {
            return Err(TokenizerError::Gguf {
                field: "tokenizer.ggml.token_type",
                reason: format!(
                    "has {} entries but tokenizer.ggml.tokens has {}",
                    meta.token_types.len(),
                    meta.tokens.len()
                ),
            });
        }

        // `Vocab` is the ahash map type the BPE builder wants.
        let mut vocab = Vocab::default();
        let mut added: Vec<(u32, AddedToken)> = Vec::new();
        for (id, (token, &ty)) in meta.tokens.iter().zip(&meta.token_types).enumerate() {
            let id32 = u32::try_from(id).map_err(|_| TokenizerError::Gguf {
                field: "tokenizer.ggml.tokens",
                reason: "more than 2^32 tokens".to_string(),
            })?;
            if ty == UNUSED || is_pad_entry(token, id) {
                continue;
            }
            if ty == CONTROL || ty == USER_DEFINED {
                // Matches HF's added-token flags for Qwen: no stripping, not normalised.
                let tok = AddedToken::from(token.clone(), ty == CONTROL)
                    .single_word(false)
                    .lstrip(false)
                    .rstrip(false)
                    .normalized(false);
                added.push((id32, tok));
            } else if vocab.insert(token.clone(), id32).is_some() {
                return Err(TokenizerError::Gguf {
                    field: "tokenizer.ggml.tokens",
                    reason: format!("token {token:?} appears more than once"),
                });
            }
        }

        let mut merges = Vec::with_capacity(meta.merges.len());
        for (rank, merge) in meta.merges.iter().enumerate() {
            // Byte-level tokens never contain a literal space (it is encoded as 'Ġ'), so
            // the first space is the separator.
            let (a, b) = merge.split_once(' ').ok_or_else(|| TokenizerError::Gguf {
                field: "tokenizer.ggml.merges",
                reason: format!("merge #{rank} {merge:?} is not of the form \"left right\""),
            })?;
            merges.push((a.to_string(), b.to_string()));
        }

        let gguf_err =
            |field: &'static str| move |e: tokenizers::Error| TokenizerError::Gguf { field, reason: e.to_string() };
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(gguf_err("tokenizer.ggml.merges"))?;
        let split = Split::new(SplitPattern::Regex(kind.regex().to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(gguf_err("tokenizer.ggml.pre"))?;
        let byte_level = ByteLevel::new(false, false, false);
        let pre = Sequence::new(vec![PreTokenizerWrapper::Split(split), PreTokenizerWrapper::ByteLevel(byte_level)]);
        let built = TokenizerBuilder::<
            ModelWrapper,
            NormalizerWrapper,
            PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        >::new()
        .with_model(ModelWrapper::BPE(bpe))
        .with_normalizer((kind == PreTokenizerKind::Qwen2).then_some(NormalizerWrapper::NFC(NFC)))
        .with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(pre)))
        .with_post_processor(Some(post_processor(meta, byte_level)?))
        .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::new(false, false, false))))
        .build()
        .map_err(gguf_err("tokenizer.ggml.tokens"))?;
        let mut inner = tokenizers::Tokenizer::from(built);

        // `tokenizers` assigns added-token ids sequentially after the model vocabulary, so
        // add them in id order and then check each landed on its GGUF id.
        added.sort_by_key(|(id, _)| *id);
        inner.add_tokens(added.iter().map(|(_, t)| t.clone())).map_err(gguf_err("tokenizer.ggml.tokens"))?;
        for (id, tok) in &added {
            let got = inner.token_to_id(&tok.content);
            if got != Some(*id) {
                return Err(TokenizerError::Gguf {
                    field: "tokenizer.ggml.tokens",
                    reason: format!(
                        "added token {:?} has id {id} but would be assigned {got:?}; \
                         control/user-defined tokens must follow the normal vocabulary",
                        tok.content
                    ),
                });
            }
        }
        Ok(Self::from_inner(inner, "<gguf metadata>".to_string()))
    }

    /// Exports this tokenizer as GGUF metadata the way llama.cpp's converter does: tokens
    /// in id order padded with `[PAD<id>]` (type unused) up to `vocab_size` (the model's
    /// embedding rows), special added tokens as control, other added tokens as
    /// user-defined, merges as `"left right"`. `bos_token_id`, `eos_token_id` and
    /// `chat_template` are left `None`: they live in `tokenizer_config.json`, not in the
    /// tokenizer, and the GGUF writer fills them in.
    pub fn to_gguf_meta(&self, vocab_size: usize) -> Result<GgufTokenizerMeta> {
        use gguf_token_type::{CONTROL, NORMAL, UNUSED, USER_DEFINED};

        let export_err = |reason: String| TokenizerError::Gguf { field: "tokenizer.ggml.tokens", reason };
        let model = match self.inner.get_model() {
            ModelWrapper::BPE(bpe) => bpe,
            _ => {
                return Err(TokenizerError::Gguf {
                    field: "tokenizer.ggml.model",
                    reason: format!("{} is not a BPE tokenizer", self.source_name),
                })
            }
        };
        let len = self.len();
        if vocab_size < len {
            return Err(export_err(format!("vocab_size {vocab_size} is smaller than the tokenizer's {len} tokens")));
        }
        let added = self.inner.get_added_tokens_decoder();
        let mut tokens = Vec::with_capacity(vocab_size);
        let mut token_types = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size {
            let id32 = u32::try_from(id).map_err(|_| export_err("vocab too large".into()))?;
            if let Some(tok) = added.get(&id32) {
                tokens.push(tok.content.clone());
                token_types.push(if tok.special { CONTROL } else { USER_DEFINED });
            } else if let Some(tok) = self.inner.id_to_token(id32) {
                tokens.push(tok);
                token_types.push(NORMAL);
            } else {
                tokens.push(format!("[PAD{id}]"));
                token_types.push(UNUSED);
            }
        }

        // The BPE model does not expose its merge list directly; its serialised form
        // lists merges in rank order, which is exactly what GGUF wants.
        let model_json = serde_json::to_value(model)
            .map_err(|e| TokenizerError::Gguf { field: "tokenizer.ggml.merges", reason: e.to_string() })?;
        let merges = model_json
            .get("merges")
            .and_then(|m| m.as_array())
            .ok_or_else(|| TokenizerError::Gguf {
                field: "tokenizer.ggml.merges",
                reason: "BPE model serialised without a merges list".into(),
            })?
            .iter()
            .map(|m| match m {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Array(pair) => match pair.as_slice() {
                    [serde_json::Value::String(a), serde_json::Value::String(b)] => Some(format!("{a} {b}")),
                    _ => None,
                },
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| TokenizerError::Gguf {
                field: "tokenizer.ggml.merges",
                reason: "unexpected merge entry in serialised BPE model".into(),
            })?;

        Ok(GgufTokenizerMeta {
            model: "gpt2".to_string(),
            pre: Some("qwen2".to_string()),
            tokens,
            token_types,
            merges,
            bos_token_id: None,
            eos_token_id: None,
            padding_token_id: None,
            add_bos_token: None,
            chat_template: None,
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{encode_cases, qwen};

    #[test]
    fn gguf_round_trip_preserves_encodings() {
        let t = qwen();
        let meta = t.to_gguf_meta(151_936).unwrap();
        assert_eq!(meta.tokens.len(), 151_936);
        assert_eq!(meta.token_types.len(), 151_936);
        assert_eq!(meta.tokens[151_669], "[PAD151669]");
        assert_eq!(meta.token_types[151_669], gguf_token_type::UNUSED);
        assert_eq!(meta.token_types[151_644], gguf_token_type::CONTROL);
        assert_eq!(meta.token_types[151_667], gguf_token_type::USER_DEFINED);
        assert_eq!(meta.token_types[0], gguf_token_type::NORMAL);
        assert_eq!(meta.merges.len(), 151_387);
        assert!(meta.merges[0].contains(' '));

        let g = Tokenizer::from_gguf(&meta).unwrap();
        assert_eq!(g.len(), t.len());
        for (text, ids) in encode_cases() {
            assert_eq!(g.encode(&text, true).unwrap(), ids, "text {text:?}");
            assert_eq!(g.decode(&ids, true).unwrap(), t.decode(&ids, true).unwrap(), "text {text:?}");
        }
        for id in 151_643..151_669 {
            assert_eq!(g.is_special(id), t.is_special(id), "id {id}");
            assert_eq!(g.id_to_token(id), t.id_to_token(id));
        }
        // And exporting again yields the same metadata.
        assert_eq!(g.to_gguf_meta(151_936).unwrap(), meta);
    }

    fn pieces(t: &Tokenizer, text: &str) -> Vec<String> {
        use tokenizers::PreTokenizer;
        let mut s = tokenizers::PreTokenizedString::from(text);
        t.inner.get_pre_tokenizer().unwrap().pre_tokenize(&mut s).unwrap();
        s.get_splits(tokenizers::OffsetReferential::Original, tokenizers::OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    /// A Llama 3 GGUF (`pre` "llama-bpe", `add_bos_token`): its regex groups digits by three
    /// (Qwen2's splits each), it does not NFC-normalise, and encoding with special tokens puts
    /// the BOS first, once, while a chat prompt (encoded without them) keeps only its own.
    #[test]
    fn llama3_pre_tokenizer_and_bos() {
        let qwen_meta = qwen().to_gguf_meta(qwen().len()).unwrap();
        let mut meta = qwen_meta.clone();
        meta.pre = Some("llama-bpe".into());
        meta.add_bos_token = Some(true);
        meta.bos_token_id = Some(151_643);
        let llama = Tokenizer::from_gguf(&meta).unwrap();
        let qwen2 = Tokenizer::from_gguf(&qwen_meta).unwrap();
        let text = "In 2024, 1234567 DON'T";
        let got = pieces(&llama, text);
        assert!(got.iter().any(|p| p == "202") && got.iter().any(|p| p == "123"), "{got:?}");
        assert!(got.iter().any(|p| p == "'T"), "contractions are case-insensitive: {got:?}");
        let got = pieces(&qwen2, text);
        assert!(got.iter().any(|p| p == "2") && !got.iter().any(|p| p == "202"), "{got:?}");

        let plain = llama.encode("Hi there", false).unwrap();
        let with_bos = llama.encode("Hi there", true).unwrap();
        assert_eq!(with_bos[0], 151_643);
        assert_eq!(&with_bos[1..], plain.as_slice());
        assert_eq!(qwen2.encode("Hi there", true).unwrap(), qwen2.encode("Hi there", false).unwrap(), "Qwen: no BOS");
        let chat = llama.encode("<|endoftext|>Hi", false).unwrap();
        assert_eq!(chat.iter().filter(|&&t| t == 151_643).count(), 1, "the template's BOS only");

        // "é" decomposed: Qwen2 composes it (NFC), Llama 3 keeps the two code points.
        let decomposed = "e\u{301}";
        assert_ne!(llama.encode(decomposed, false).unwrap(), qwen2.encode(decomposed, false).unwrap());
        assert_eq!(qwen2.encode(decomposed, false).unwrap(), qwen2.encode("\u{e9}", false).unwrap());

        meta.bos_token_id = None;
        let err = Tokenizer::from_gguf(&meta).unwrap_err().to_string();
        assert!(err.contains("bos_token_id"), "{err}");
        let mut deepseek = qwen_meta;
        deepseek.pre = Some("deepseek-r1-qwen".into());
        assert_eq!(
            Tokenizer::from_gguf(&deepseek).unwrap().encode(text, true).unwrap(),
            qwen2.encode(text, true).unwrap()
        );
    }

    #[test]
    fn gguf_errors_name_the_field() {
        let mut meta = qwen().to_gguf_meta(qwen().len()).unwrap();
        meta.pre = Some("gpt-4o".into());
        let err = Tokenizer::from_gguf(&meta).unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.pre") && err.contains("llama-bpe"), "{err}");

        let mut meta = qwen().to_gguf_meta(qwen().len()).unwrap();
        meta.merges[3] = "nospace".into();
        let err = Tokenizer::from_gguf(&meta).unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.merges"), "{err}");

        let mut meta = qwen().to_gguf_meta(qwen().len()).unwrap();
        meta.token_types.pop();
        let err = Tokenizer::from_gguf(&meta).unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.token_type"), "{err}");

        assert!(qwen().to_gguf_meta(10).is_err());
    }
}
