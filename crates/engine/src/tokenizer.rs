//! Text <-> token id conversion for Qwen2-family models.
//!
//! This is a thin wrapper around the `tokenizers` crate so that the rest of the engine
//! sees a small, typed API (no boxed `dyn Error`s) and so that the same tokenizer can be
//! built from three sources: a Hugging Face `tokenizer.json`, the copy embedded in the
//! binary, or the vocabulary/merges that llama.cpp stores in GGUF metadata (that path, and
//! the export back to GGUF metadata, is the `gguf` submodule).

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

mod gguf;
mod gguf_spm;

pub use gguf::gguf_token_type;

/// Gzipped Qwen `tokenizer.json`, embedded so the server works without network access or
/// a tokenizer file next to the weights (e.g. for GGUF files or tests).
static BUILTIN_QWEN_GZ: &[u8] =
    include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/qwen-tokenizer/tokenizer.json.gz"));

/// Name used in errors for the embedded tokenizer.
const BUILTIN_SOURCE: &str = "<builtin qwen tokenizer.json.gz>";

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
    /// How a token's string stands for its bytes.
    pieces: PieceEncoding,
}

/// How a vocabulary entry spells its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceEncoding {
    /// GPT-2's byte-to-unicode table (Qwen, Llama 3): `Ġ` is a space.
    ByteLevel,
    /// SentencePiece's (Llama 2, Mistral): `▁` is a space, `<0x0A>` the byte 0x0A, the rest UTF-8.
    SentencePiece,
}

impl PieceEncoding {
    /// SentencePiece when the decoder undoes `▁` or byte-fallback pieces and no byte-level
    /// decoder is in it.
    fn of(decoder: Option<&tokenizers::DecoderWrapper>) -> Self {
        use tokenizers::DecoderWrapper as D;
        fn walk(d: &D, spm: &mut bool, byte_level: &mut bool) {
            match d {
                D::ByteLevel(_) => *byte_level = true,
                D::Metaspace(_) | D::ByteFallback(_) => *spm = true,
                D::Sequence(s) => s.get_decoders().iter().for_each(|d| walk(d, spm, byte_level)),
                _ => {}
            }
        }
        let (mut spm, mut byte_level) = (false, false);
        if let Some(d) = decoder {
            walk(d, &mut spm, &mut byte_level);
        }
        if spm && !byte_level {
            PieceEncoding::SentencePiece
        } else {
            PieceEncoding::ByteLevel
        }
    }
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

impl Tokenizer {
    fn from_inner(inner: tokenizers::Tokenizer, source_name: String) -> Self {
        let special_ids =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, tok)| tok.special).map(|(id, _)| id).collect();
        let pieces = PieceEncoding::of(inner.get_decoder());
        Self { inner, special_ids, source_name, pieces }
    }

    /// Loads a Hugging Face `tokenizer.json`. Gzipped files are accepted too (detected by
    /// their magic bytes), since that is how the repository ships its asset.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io { path: name.clone(), source })?;
        Self::from_named_bytes(&bytes, name)
    }

    /// This tokenizer as a `tokenizer.json` (e.g. one rebuilt from a GGUF's metadata).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(|e| TokenizerError::Parse {
            source_name: self.source_name.clone(),
            message: format!("cannot serialise: {e}"),
        })
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
        if self.pieces == PieceEncoding::SentencePiece {
            return Some(sentencepiece_bytes(&s));
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

/// A SentencePiece piece's bytes: `<0xXX>` is that byte, `▁` a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).filter(|h| h.len() == 2);
    if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
        return vec![b];
    }
    piece.replace('\u{2581}', " ").into_bytes()
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
