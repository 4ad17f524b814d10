//! Text <-> token id conversion for Qwen2-family models.
//!
//! This is a thin wrapper around the `tokenizers` crate so that the rest of the engine
//! sees a small, typed API (no boxed `dyn Error`s) and so that the same tokenizer can be
//! built from three sources: a Hugging Face `tokenizer.json`, the copy embedded in the
//! binary, or the vocabulary/merges that llama.cpp stores in GGUF metadata.

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    SplitDelimiterBehavior, TokenizerBuilder,
};

/// Qwen2's pre-tokenizer split regex, exactly as it appears in Qwen's `tokenizer.json`
/// (and as llama.cpp hard-codes it for `tokenizer.ggml.pre = "qwen2"`). GGUF files do not
/// carry the regex, so it has to live here.
const QWEN2_SPLIT_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Gzipped Qwen `tokenizer.json`, embedded so the server works without network access or
/// a tokenizer file next to the weights (e.g. for GGUF files or tests).
static BUILTIN_QWEN_GZ: &[u8] =
    include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/qwen-tokenizer/tokenizer.json.gz"));

/// Name used in errors for the embedded tokenizer.
const BUILTIN_SOURCE: &str = "<builtin qwen tokenizer.json.gz>";

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

/// Errors from loading or using a tokenizer. Every loading error names its source (a
/// path, `<bytes>`, the builtin asset or a GGUF field) so users can tell which input is bad.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The tokenizer file could not be read.
    #[error("cannot read tokenizer file {path}: {source}")]
    Io {
        /// File that failed.
        path: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// The gzip stream was corrupt.
    #[error("cannot decompress tokenizer {source_name}: {source}")]
    Gzip {
        /// Where the gzip data came from.
        source_name: String,
        /// Underlying I/O error from flate2.
        source: std::io::Error,
    },
    /// The tokenizer JSON could not be parsed or built.
    #[error("invalid tokenizer {source_name}: {message}")]
    Parse {
        /// Where the JSON came from.
        source_name: String,
        /// What the tokenizers crate reported.
        message: String,
    },
    /// GGUF tokenizer metadata is missing, inconsistent or of an unsupported kind.
    #[error("invalid GGUF tokenizer metadata (field {field}): {reason}")]
    Gguf {
        /// The GGUF metadata key at fault, e.g. `tokenizer.ggml.merges`.
        field: &'static str,
        /// Human-readable explanation.
        reason: String,
    },
    /// Encoding text failed.
    #[error("cannot encode text with tokenizer {source_name}: {message}")]
    Encode {
        /// Which tokenizer was in use.
        source_name: String,
        /// What the tokenizers crate reported.
        message: String,
    },
    /// Decoding ids failed.
    #[error("cannot decode token ids with tokenizer {source_name}: {message}")]
    Decode {
        /// Which tokenizer was in use.
        source_name: String,
        /// What the tokenizers crate reported.
        message: String,
    },
}

/// Result alias for tokenizer operations.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// Tokenizer metadata in the shape llama.cpp stores it in GGUF files (`tokenizer.ggml.*`).
/// The GGUF reader/writer in `flint-model` owns the type (it is plain data there, filled from
/// or written to metadata); re-exported so callers of [`Tokenizer::from_gguf`] and
/// [`Tokenizer::to_gguf_meta`] need only this module.
pub use flint_model::gguf::GgufTokenizerMeta;

/// A loaded tokenizer. Cheap to share behind an `Arc`; all methods take `&self`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids of added tokens flagged `special`, cached because `tokenizers` only exposes
    /// them by cloning the whole added-token map.
    special_ids: HashSet<u32>,
    /// Where this tokenizer came from, for error messages.
    source_name: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("source", &self.source_name).field("len", &self.len()).finish()
    }
}

/// The most a gzipped tokenizer may expand to. Real `tokenizer.json` files are 2–35 MB; a
/// gzip stream can expand a thousandfold, so a small hostile file must not fill memory.
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 256 << 20;

/// Decompresses a gzip stream (at most [`MAX_TOKENIZER_JSON_BYTES`]), naming the source on failure.
fn gunzip(bytes: &[u8], source_name: &str) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len().saturating_mul(4).min(MAX_TOKENIZER_JSON_BYTES as usize));
    flate2::read::GzDecoder::new(bytes)
        .take(MAX_TOKENIZER_JSON_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|source| TokenizerError::Gzip { source_name: source_name.to_string(), source })?;
    if out.len() as u64 > MAX_TOKENIZER_JSON_BYTES {
        return Err(TokenizerError::Gzip {
            source_name: source_name.to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("decompresses to more than {MAX_TOKENIZER_JSON_BYTES} bytes"),
            ),
        });
    }
    Ok(out)
}

/// True when `bytes` starts with the gzip magic number.
fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

/// True for llama.cpp's `[PAD<id>]` vocabulary padding entries.
fn is_pad_entry(token: &str, id: usize) -> bool {
    token
        .strip_prefix("[PAD")
        .and_then(|rest| rest.strip_suffix(']'))
        .is_some_and(|digits| digits.parse::<usize>().ok() == Some(id))
}

impl Tokenizer {
    fn from_inner(inner: tokenizers::Tokenizer, source_name: String) -> Self {
        let special_ids =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, tok)| tok.special).map(|(id, _)| id).collect();
        Self { inner, special_ids, source_name }
    }

    /// Loads a Hugging Face `tokenizer.json`. Gzipped files are accepted too (detected by
    /// their magic bytes), since that is how the repository ships its asset.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io { path: name.clone(), source })?;
        Self::from_named_bytes(&bytes, name)
    }

    /// Parses a `tokenizer.json` held in memory (plain or gzipped).
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self> {
        Self::from_named_bytes(bytes, "<bytes>".to_string())
    }

    /// The Qwen tokenizer embedded in the binary.
    pub fn builtin_qwen() -> Result<Self> {
        Self::from_named_bytes(BUILTIN_QWEN_GZ, BUILTIN_SOURCE.to_string())
    }

    /// The embedded Qwen `tokenizer.json`, decompressed, for writing next to synthesized
    /// checkpoints so they load like a downloaded model.
    pub fn builtin_qwen_json() -> Result<Vec<u8>> {
        gunzip(BUILTIN_QWEN_GZ, BUILTIN_SOURCE)
    }

    fn from_named_bytes(bytes: &[u8], source_name: String) -> Result<Self> {
        let json;
        let bytes = if is_gzip(bytes) {
            json = gunzip(bytes, &source_name)?;
            &json[..]
        } else {
            bytes
        };
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TokenizerError::Parse { source_name: source_name.clone(), message: e.to_string() })?;
        Ok(Self::from_inner(inner, source_name))
    }

    /// Builds the tokenizer described by llama.cpp GGUF metadata for Qwen2-style models:
    /// byte-level BPE with Qwen2's split regex and NFC normalisation. Control (type 3) and
    /// user-defined (type 4) tokens become added tokens, `special` for control tokens only
    /// so that `skip_special_tokens` behaves as with the original `tokenizer.json`
    /// (where e.g. `<think>` is an added but non-special token). `[PAD<id>]`/unused
    /// padding entries are skipped.
    pub fn from_gguf(meta: &GgufTokenizerMeta) -> Result<Self> {
        use gguf_token_type::{CONTROL, UNUSED, USER_DEFINED};

        if meta.model != "gpt2" {
            return Err(TokenizerError::Gguf {
                field: "tokenizer.ggml.model",
                reason: format!(
                    "unsupported tokenizer model {:?} (only byte-level BPE \"gpt2\" is supported)",
                    meta.model
                ),
            });
        }
        match meta.pre.as_deref() {
            Some("qwen2") => {}
            other => {
                return Err(TokenizerError::Gguf {
                    field: "tokenizer.ggml.pre",
                    reason: format!("unsupported pre-tokenizer {other:?} (only \"qwen2\")"),
                })
            }
        }
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
        let split =
            Split::new(SplitPattern::Regex(QWEN2_SPLIT_REGEX.to_string()), SplitDelimiterBehavior::Isolated, false)
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
        .with_normalizer(Some(NormalizerWrapper::NFC(NFC)))
        .with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(pre)))
        .with_post_processor(Some(PostProcessorWrapper::ByteLevel(byte_level)))
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
            chat_template: None,
        })
    }

    /// Encodes `text`. Special-token strings occurring in the text (e.g. `<|im_start|>`)
    /// map to their ids, as in Hugging Face's default. `add_special_tokens` applies the
    /// post-processor (a no-op for Qwen, which adds no BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode { source_name: self.source_name.clone(), message: e.to_string() })
    }

    /// Decodes ids to text. Ids the tokenizer does not know (e.g. embedding padding rows)
    /// are dropped, which is what Hugging Face does; incomplete UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode { source_name: self.source_name.clone(), message: e.to_string() })
    }

    /// Number of ids the tokenizer knows, added tokens included (HF's `len(tokenizer)`).
    /// This can be smaller than the model's vocabulary (embedding rows).
    pub fn len(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Always false for a usable tokenizer; provided for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Id of an exact token string (byte-level form for regular tokens).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token string of an id (byte-level form for regular tokens).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is a special added token (skipped by `skip_special_tokens`).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// Every added token (`<|im_end|>`, `<tool_call>`, …) with its text, special or not.
    pub fn added_tokens(&self) -> Vec<(u32, String)> {
        let mut v: Vec<(u32, String)> =
            self.inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content)).collect();
        v.sort_unstable();
        v
    }

    /// Where this tokenizer was loaded from, for diagnostics.
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// The raw bytes a token stands for (a byte-level BPE token may hold part of a UTF-8
    /// character, which a text decode can only show as U+FFFD). OpenAI's logprobs report these.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let s = self.id_to_token(id)?;
        if self.is_special(id) {
            return Some(s.into_bytes());
        }
        // GPT-2's byte-to-unicode table, inverted: printable bytes map to themselves, the others
        // to U+0100 onwards in byte order. A token outside it (an added token) is plain text.
        let mut out = Vec::with_capacity(s.len());
        for c in s.chars() {
            match byte_of(c) {
                Some(b) => out.push(b),
                None => return Some(s.into_bytes()),
            }
        }
        Some(out)
    }
}

fn byte_of(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let cp = c as u32;
    if cp < 256 && printable(cp) {
        return Some(cp as u8);
    }
    // The n-th non-printable byte (in byte order) is U+0100 + n.
    let n = cp.checked_sub(256)?;
    (0u32..256).filter(|&b| !printable(b)).nth(n as usize).map(|b| b as u8)
}

#[cfg(test)]
pub(crate) mod tests {
    #[test]
    fn token_bytes_recover_partial_utf8() {
        let tok = qwen();
        let ids = tok.encode("a 🦀", false).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| tok.token_bytes(i).unwrap()).collect();
        assert_eq!(bytes, "a 🦀".as_bytes());
        assert_eq!(tok.token_bytes(151_645).unwrap(), b"<|im_end|>");
    }

    use super::*;
    use std::sync::OnceLock;

    /// Loading the builtin tokenizer takes a moment in debug builds; share it.
    pub(crate) fn qwen() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| match Tokenizer::builtin_qwen() {
            Ok(t) => t,
            Err(e) => panic!("builtin tokenizer must load: {e}"),
        })
    }

    /// The golden cases produced by Hugging Face transformers.
    pub(crate) fn golden() -> &'static serde_json::Value {
        static CASES: OnceLock<serde_json::Value> = OnceLock::new();
        CASES.get_or_init(|| {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/golden/tokenizer_cases.json");
            let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("cannot parse {path}: {e}"))
        })
    }

    /// (text, ids) pairs of the golden "encode" section.
    pub(crate) fn encode_cases() -> Vec<(String, Vec<u32>)> {
        let cases = golden()["encode"].as_array().expect("encode array");
        assert!(!cases.is_empty());
        cases
            .iter()
            .map(|c| {
                let text = c["text"].as_str().expect("text").to_string();
                let ids = c["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
                (text, ids)
            })
            .collect()
    }

    #[test]
    fn len_matches_hf() {
        let expected = golden()["len_tokenizer"].as_u64().expect("len_tokenizer") as usize;
        assert_eq!(qwen().len(), expected);
        assert_eq!(qwen().len(), 151_669);
    }

    #[test]
    fn encode_matches_hf() {
        for (text, ids) in encode_cases() {
            assert_eq!(qwen().encode(&text, true).unwrap(), ids, "text {text:?}");
        }
    }

    #[test]
    fn decode_matches_hf() {
        let cases = golden()["decode"].as_array().expect("decode array");
        assert!(!cases.is_empty());
        for c in cases {
            let ids: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let skip = c["skip_special"].as_bool().unwrap();
            let text = c["text"].as_str().unwrap();
            assert_eq!(qwen().decode(&ids, skip).unwrap(), text, "ids {ids:?}");
        }
        // Every encode case must also decode back to its text (byte-level BPE is lossless).
        for (_text, ids) in encode_cases() {
            let nfc_text = qwen().decode(&ids, false).unwrap();
            assert_eq!(qwen().encode(&nfc_text, false).unwrap(), ids);
        }
    }

    #[test]
    fn special_tokens() {
        let t = qwen();
        let im_start = t.token_to_id("<|im_start|>").unwrap();
        assert_eq!(im_start, 151_644);
        assert!(t.is_special(im_start));
        let think = t.token_to_id("<think>").unwrap();
        assert_eq!(think, 151_667);
        assert!(!t.is_special(think), "<think> is added but not special in HF");
        assert_eq!(t.id_to_token(151_645).as_deref(), Some("<|im_end|>"));
        assert!(!t.is_special(0));
        let ids = t.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!(ids[0], im_start);
        assert_eq!(*ids.last().unwrap(), 151_645);
        assert_eq!(t.decode(&ids, true).unwrap(), "user\nhi");
    }

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

    #[test]
    fn gguf_errors_name_the_field() {
        let mut meta = qwen().to_gguf_meta(qwen().len()).unwrap();
        meta.pre = Some("llama-bpe".into());
        let err = Tokenizer::from_gguf(&meta).unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.pre"), "{err}");

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

    #[test]
    fn load_errors_name_the_source() {
        let err = Tokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err().to_string();
        assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
        let err = Tokenizer::from_json_bytes(b"{not json").unwrap_err();
        assert!(matches!(err, TokenizerError::Parse { .. }), "{err}");
        let err = Tokenizer::from_json_bytes(&[0x1f, 0x8b, 0, 1, 2]).unwrap_err();
        assert!(matches!(err, TokenizerError::Gzip { .. }), "{err}");
    }

    #[test]
    fn from_file_reads_gzip_and_plain() {
        let gz_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/qwen-tokenizer/tokenizer.json.gz");
        let t = Tokenizer::from_file(gz_path).unwrap();
        assert_eq!(t.len(), 151_669);
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("tokenizer.json");
        std::fs::write(&plain, Tokenizer::builtin_qwen_json().unwrap()).unwrap();
        let p = Tokenizer::from_file(&plain).unwrap();
        assert_eq!(p.encode("Hello, world!", false).unwrap(), t.encode("Hello, world!", false).unwrap());
    }
}
