//! SentencePiece tokenizers as llama.cpp stores them in GGUF (`tokenizer.ggml.model = "llama"`:
//! Llama 2, Mistral 7B, and the GGUFs of models fine-tuned from them): pieces with scores and
//! types, no merges. Rebuilt as Hugging Face's `LlamaTokenizerFast` is: a `▁` before the text
//! (SentencePiece's dummy prefix) and for every space, BPE whose merges are every split of a piece
//! into two pieces, ranked by the merged piece's score (SentencePiece's BPE merges the pair whose
//! result scores highest), byte fallback to `<0xXX>` pieces for what the vocabulary lacks, and the
//! BOS put first when the file says so.

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder};

use super::gguf::bos_template;
use super::gguf::gguf_token_type::{BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED};
use super::{GgufTokenizerMeta, Result, Tokenizer, TokenizerError};

/// SentencePiece's word-boundary mark, which stands for a space.
const SPACE: &str = "\u{2581}";

fn err(field: &'static str, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::Gguf { field, reason: reason.into() }
}

/// The merges that make SentencePiece's BPE out of its pieces: every split of a normal piece into
/// two pieces of the vocabulary, highest-scoring result first (ties: by the ids of the halves).
fn merges(tokens: &[String], types: &[i32], scores: &[f32], vocab: &Vocab) -> Vec<(String, String)> {
    let mut ranked: Vec<(f32, u32, u32, &str, &str)> = Vec::new();
    for ((piece, &ty), &score) in tokens.iter().zip(types).zip(scores) {
        if ty != NORMAL && ty != USER_DEFINED {
            continue;
        }
        for (i, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(i);
            if let (Some(&a), Some(&b)) = (vocab.get(l), vocab.get(r)) {
                ranked.push((score, a, b, l, r));
            }
        }
    }
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    ranked.into_iter().map(|(_, _, _, l, r)| (l.to_string(), r.to_string())).collect()
}

impl Tokenizer {
    /// The tokenizer of a GGUF whose `tokenizer.ggml.model` is `"llama"` (SentencePiece BPE).
    pub(super) fn from_gguf_sentencepiece(meta: &GgufTokenizerMeta) -> Result<Self> {
        let n = meta.tokens.len();
        if meta.token_types.len() != n {
            let reason = format!("has {} entries but tokenizer.ggml.tokens has {n}", meta.token_types.len());
            return Err(err("tokenizer.ggml.token_type", reason));
        }
        if meta.scores.len() != n {
            let reason = format!("has {} entries but tokenizer.ggml.tokens has {n}", meta.scores.len());
            return Err(err("tokenizer.ggml.scores", reason));
        }
        let mut vocab = Vocab::default();
        let mut added = Vec::new();
        let mut unk = None;
        for (id, (token, &ty)) in meta.tokens.iter().zip(&meta.token_types).enumerate() {
            let id = u32::try_from(id).map_err(|_| err("tokenizer.ggml.tokens", "more than 2^32 tokens"))?;
            if vocab.insert(token.clone(), id).is_some() {
                return Err(err("tokenizer.ggml.tokens", format!("token {token:?} appears more than once")));
            }
            match ty {
                UNKNOWN => {
                    unk = Some(token.clone());
                    added.push(AddedToken::from(token.clone(), true));
                }
                CONTROL => added.push(AddedToken::from(token.clone(), true)),
                USER_DEFINED => added.push(AddedToken::from(token.clone(), false).normalized(false)),
                NORMAL | BYTE | UNUSED => {}
                other => return Err(err("tokenizer.ggml.token_type", format!("token {id} has unknown type {other}"))),
            }
        }
        let merges = merges(&meta.tokens, &meta.token_types, &meta.scores, &vocab);
        let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
        if let Some(u) = unk {
            bpe = bpe.unk_token(u);
        }
        let bpe = bpe.build().map_err(|e| err("tokenizer.ggml.tokens", e.to_string()))?;

        let tok_err = |e: tokenizers::Error| err("tokenizer.ggml.tokens", e.to_string());
        let mut normalizers = Vec::new();
        let dummy_prefix = meta.add_space_prefix.unwrap_or(true);
        if dummy_prefix {
            normalizers.push(NormalizerWrapper::Prepend(Prepend::new(SPACE.into())));
        }
        normalizers.push(NormalizerWrapper::Replace(Replace::new(" ", SPACE).map_err(tok_err)?));
        let mut decoders = vec![
            DecoderWrapper::Replace(Replace::new(SPACE, " ").map_err(tok_err)?),
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ];
        if dummy_prefix {
            decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
        }
        let post = match (meta.add_bos_token.unwrap_or(true), meta.bos_token_id) {
            (true, Some(id)) => {
                let token = meta
                    .tokens
                    .get(id as usize)
                    .ok_or_else(|| err("tokenizer.ggml.bos_token_id", format!("{id} is outside the {n} tokens")))?;
                Some(PostProcessorWrapper::Template(bos_template(token, id)?))
            }
            _ => None,
        };
        let built = TokenizerBuilder::<
            ModelWrapper,
            NormalizerWrapper,
            tokenizers::PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        >::new()
        .with_model(ModelWrapper::BPE(bpe))
        .with_normalizer(Some(NormalizerWrapper::Sequence(NormalizerSequence::new(normalizers))))
        .with_pre_tokenizer(None)
        .with_post_processor(post)
        .with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(decoders))))
        .build()
        .map_err(|e| err("tokenizer.ggml.tokens", e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::from(built);
        // Already in the vocabulary: they keep their ids, and are matched whole in text.
        let (special, other): (Vec<AddedToken>, Vec<AddedToken>) = added.into_iter().partition(|t| t.special);
        inner.add_special_tokens(special).map_err(tok_err)?;
        inner.add_tokens(other).map_err(tok_err)?;
        Ok(Self::from_inner(inner, "<gguf metadata (sentencepiece)>".to_string()))
    }
}
