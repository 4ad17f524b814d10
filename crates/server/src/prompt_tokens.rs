//! Tokenizing a prompt without paying for more of it than the context can hold. A body may carry
//! megabytes of text; tokenizing all of it before the context-length check costs seconds of CPU
//! and, in the tokenizer's per-token bookkeeping, about a hundred times the text in memory. So a
//! long text is first counted piece by piece, and refused as soon as the count is clearly past
//! the limit; only a text that can fit is then tokenized whole, which is the exact answer.

use flint_engine::tokenizer::Tokenizer;

use crate::error::ApiError;

/// Texts up to this many bytes are tokenized whole at once (cheap: well under 10 ms).
const WHOLE_BYTES: usize = 256 << 10;
/// Piece size while counting a longer text.
const PIECE_BYTES: usize = 128 << 10;
/// How far past a piece's nominal end to look for a natural split point.
const SPLIT_SEARCH_BYTES: usize = 4 << 10;
/// Tokens a split may add or remove against tokenizing across it. Pieces end where the
/// pre-tokenizer splits anyway (after a line break, before a space-led word), so this is slack.
const SLACK_PER_SPLIT: usize = 8;

#[derive(Debug, Clone, PartialEq)]
pub enum PromptError {
    /// More than `limit` tokens; `counted` were counted before stopping.
    TooLong {
        counted: usize,
        limit: usize,
    },
    Tokenizer(String),
}

impl PromptError {
    /// The API's error: over-long text is a context-length error on `param`, in vLLM's words.
    pub fn into_api(self, param: &str) -> ApiError {
        match self {
            PromptError::TooLong { counted, limit } => ApiError::context_length(
                format!(
                    "This model's maximum context length is {limit} tokens. However, your {param} \
                     resulted in more than that ({counted} tokens counted before stopping). Please reduce \
                     the length of the {param}."
                ),
                param,
            ),
            PromptError::Tokenizer(m) => ApiError::invalid(param, m),
        }
    }
}

/// The ids of `text`, or `TooLong` if it has more than `limit` tokens. Exact: the ids are those
/// of tokenizing `text` whole, and a text refused early has more than `limit` tokens (up to the
/// per-split slack, which only ever delays the refusal).
pub fn encode_bounded(tok: &Tokenizer, text: &str, add_special: bool, limit: usize) -> Result<Vec<u32>, PromptError> {
    let encode = |s: &str, special: bool| tok.encode(s, special).map_err(|e| PromptError::Tokenizer(e.to_string()));
    if text.len() > WHOLE_BYTES {
        let (mut start, mut counted, mut splits) = (0, 0usize, 0usize);
        while start < text.len() {
            let end = split_point(text, start + PIECE_BYTES);
            counted += encode(&text[start..end], add_special && start == 0)?.len();
            if counted > limit.saturating_add(splits * SLACK_PER_SPLIT) {
                return Err(PromptError::TooLong { counted, limit });
            }
            splits += 1;
            start = end;
        }
    }
    let ids = encode(text, add_special)?;
    if ids.len() > limit {
        return Err(PromptError::TooLong { counted: ids.len(), limit });
    }
    Ok(ids)
}

/// A char boundary at or after `at` (capped to the text), preferably just after a line break
/// that is followed by a non-space, else before a space that starts a word: both are places
/// where byte-level BPE pre-tokenizers (Qwen2's, GPT-2's) split anyway.
fn split_point(text: &str, at: usize) -> usize {
    if at >= text.len() {
        return text.len();
    }
    let b = text.as_bytes();
    let window = at..(at + SPLIT_SEARCH_BYTES).min(b.len() - 1);
    let after_newline = window.clone().find(|&i| b[i] == b'\n' && !b[i + 1].is_ascii_whitespace());
    let before_word = || window.clone().find(|&i| i > 0 && b[i - 1].is_ascii_alphanumeric() && b[i] == b' ');
    match after_newline.map(|i| i + 1).or_else(before_word) {
        Some(i) => i,
        None => (at..text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(text.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> Tokenizer {
        Tokenizer::builtin_qwen().unwrap()
    }

    #[test]
    fn short_and_fitting_texts_are_exact() {
        let tok = qwen();
        for text in ["Hello, world!", "line one\nline two\n\n  indented", "é ü 😀 中文"] {
            assert_eq!(encode_bounded(&tok, text, false, 1000).unwrap(), tok.encode(text, false).unwrap());
        }
        // A long text that fits: the whole-text ids, although it was counted in pieces first.
        let long = "The quick brown fox jumps over the lazy dog.\n".repeat(8_000);
        assert!(long.len() > WHOLE_BYTES);
        let want = tok.encode(&long, false).unwrap();
        assert_eq!(encode_bounded(&tok, &long, false, want.len()).unwrap(), want);
        match encode_bounded(&tok, &long, false, want.len() - 1) {
            Err(PromptError::TooLong { counted, limit }) => assert!(counted > limit, "{counted} {limit}"),
            other => panic!("accepted one token over the limit: {:?}", other.map(|v| v.len())),
        }
    }

    #[test]
    fn a_huge_text_is_refused_after_a_few_pieces() {
        let tok = qwen();
        // 16 MB, no line breaks: pieces split before words. A 1,000-token limit is passed within
        // the first piece, so the cost is one piece, not 16 MB.
        let huge = "lorem ipsum dolor sit amet ".repeat(600_000);
        match encode_bounded(&tok, &huge, false, 1000) {
            Err(PromptError::TooLong { counted, limit: 1000 }) => {
                assert!(counted > 1000 && counted < 60_000, "counted {counted}")
            }
            other => panic!("expected TooLong, got {:?}", other.map(|v| v.len())),
        }
        // One unbroken run of a multi-byte character: pieces fall on char boundaries.
        let odd = "é".repeat(400_000);
        assert!(matches!(encode_bounded(&tok, &odd, false, 10), Err(PromptError::TooLong { .. })));
    }

    #[test]
    fn split_points_are_char_boundaries_at_or_after_the_target() {
        let text = format!("{}\nword and more é😀 {}", "a".repeat(10), "b".repeat(10_000));
        for at in 0..text.len() + 3 {
            let p = split_point(&text, at);
            assert!(text.is_char_boundary(p) && p >= at.min(text.len()), "at {at} -> {p}");
        }
        assert_eq!(split_point("abc\ndef", 1), 4);
    }
}
