//! Incremental detokenization for streaming responses.
//!
//! Decoding one token at a time is wrong for byte-level BPE: a Chinese character or an
//! emoji is often split across tokens, and decoding a partial UTF-8 sequence yields the
//! U+FFFD replacement character. Decoding the whole sequence on every step is correct but
//! quadratic. Like Hugging Face TGI, we keep two offsets into the ids: text up to
//! `read_offset` has been emitted, and `prefix_offset..read_offset` is a short window
//! of already-emitted tokens decoded again as context. Each step decodes the window with
//! and without the new tokens and emits the difference, but only once the result no
//! longer ends in U+FFFD (i.e. the pending UTF-8 sequence is complete).

use crate::tokenizer::{Result, Tokenizer};

/// The replacement character a lossy decode produces for incomplete UTF-8.
const REPLACEMENT: char = '\u{FFFD}';

/// Tokens held back waiting for the rest of a UTF-8 character. A character is at most 4
/// bytes, so beyond this the bytes are invalid for good and the full decode shows the
/// replacement character too: emit it rather than hold text back (and re-decode) forever.
const MAX_PENDING: usize = 4;

/// Streaming decoder state for one sequence. Feed ids with [`push`](Self::push) and
/// finish with [`flush`](Self::flush); the concatenated outputs equal
/// `tokenizer.decode(all_ids, skip_special_tokens)`.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    skip_special_tokens: bool,
    /// Ids from `prefix_offset` on; earlier ids are dropped once emitted, so memory and
    /// per-step work stay bounded however long the generation runs.
    ids: Vec<u32>,
    /// Index in `ids` where the already-emitted part of the window ends.
    read_offset: usize,
    /// Total ids pushed so far.
    total: usize,
}

impl IncrementalDecoder {
    /// A decoder for a new sequence. `skip_special_tokens` is passed to every decode.
    pub fn new(skip_special_tokens: bool) -> Self {
        Self { skip_special_tokens, ids: Vec::new(), read_offset: 0, total: 0 }
    }

    /// Number of ids pushed so far.
    pub fn num_tokens(&self) -> usize {
        self.total
    }

    /// Adds one generated id and returns the text that became final (possibly empty,
    /// when the id ends in the middle of a UTF-8 sequence or decodes to nothing).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.total += 1;
        let prefix = tok.decode(&self.ids[..self.read_offset], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids, self.skip_special_tokens)?;
        let pending = self.ids.len() - self.read_offset;
        if full == prefix {
            // A token that decodes to nothing (a skipped special token): it can never
            // contribute text, so keep it out of the window instead of re-decoding it forever.
            self.ids.pop();
            Ok(String::new())
        } else if full.len() > prefix.len() && (!full.ends_with(REPLACEMENT) || pending > MAX_PENDING) {
            let new_text = suffix_after(&full, &prefix);
            // The just-emitted tokens become the context window for the next step.
            self.ids.drain(..self.read_offset);
            self.read_offset = self.ids.len();
            Ok(new_text)
        } else {
            Ok(String::new())
        }
    }

    /// Returns whatever text is still pending (e.g. a trailing incomplete UTF-8
    /// sequence, rendered as U+FFFD just as a full decode would) and resets the window.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(&self.ids[..self.read_offset], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids, self.skip_special_tokens)?;
        let rest = suffix_after(&full, &prefix);
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        Ok(rest)
    }
}

/// `full` minus its leading `prefix`. The window decode normally extends the prefix
/// decode; if it does not (a decoder that rewrites earlier text), fall back to the part
/// after the longest common prefix so we never slice inside a character.
fn suffix_after(full: &str, prefix: &str) -> String {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest.to_string();
    }
    let common = full
        .char_indices()
        .zip(prefix.chars())
        .find(|((_, a), b)| a != b)
        .map_or(prefix.len().min(full.len()), |((i, _), _)| i);
    full.get(common..).unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{encode_cases, qwen};

    fn stream(ids: &[u32], skip: bool) -> Vec<String> {
        let tok = qwen();
        let mut dec = IncrementalDecoder::new(skip);
        let mut chunks: Vec<String> = ids.iter().map(|&id| dec.push(tok, id).unwrap()).collect();
        chunks.push(dec.flush(tok).unwrap());
        assert_eq!(dec.num_tokens(), ids.len());
        chunks
    }

    fn check(ids: &[u32], skip: bool) {
        let full = qwen().decode(ids, skip).unwrap();
        let chunks = stream(ids, skip);
        assert_eq!(chunks.concat(), full, "ids {ids:?}");
        if !full.contains(REPLACEMENT) {
            for c in &chunks {
                assert!(!c.contains(REPLACEMENT), "chunk {c:?} of {full:?}");
            }
        }
    }

    #[test]
    fn streaming_matches_full_decode_on_golden_cases() {
        // The golden texts include emoji and CJK split across byte-level tokens.
        for (_text, ids) in encode_cases() {
            check(&ids, false);
            check(&ids, true);
        }
    }

    #[test]
    fn multibyte_characters_are_held_back_until_complete() {
        let tok = qwen();
        let ids = tok.encode("🦀🚀 👨\u{200d}👩\u{200d}👧 你好", false).unwrap();
        check(&ids, false);
        // At least one token must be a partial character for this test to mean anything.
        let partial = ids.iter().any(|&id| tok.decode(&[id], false).unwrap().contains(REPLACEMENT));
        assert!(partial, "expected a token that splits a UTF-8 sequence");
    }

    #[test]
    fn incomplete_tail_is_flushed_as_full_decode_does() {
        let tok = qwen();
        let ids = tok.encode("I ❤️ Rust 🦀🚀 👨\u{200d}👩\u{200d}👧", false).unwrap();
        // Cut right after a token that leaves a UTF-8 sequence incomplete.
        let cut = (1..=ids.len())
            .find(|&n| tok.decode(&ids[..n], false).unwrap().ends_with(REPLACEMENT))
            .expect("some prefix must end inside a character");
        let truncated = &ids[..cut];
        let full = tok.decode(truncated, false).unwrap();
        assert!(full.ends_with(REPLACEMENT), "{full:?}");
        let chunks = stream(truncated, false);
        assert_eq!(chunks.concat(), full);
        // Only flush may emit the dangling replacement character.
        let (last, pushed) = chunks.split_last().unwrap();
        assert!(last.ends_with(REPLACEMENT), "{last:?}");
        assert!(pushed.iter().all(|c| !c.ends_with(REPLACEMENT)));
    }

    #[test]
    fn special_tokens_respect_skip_flag() {
        let ids = [151_644, 872, 198, 6023, 151_645];
        assert_eq!(stream(&ids, true).concat(), "user\nhi");
        assert_eq!(stream(&ids, false).concat(), "<|im_start|>user\nhi<|im_end|>");
    }

    #[test]
    fn flush_on_empty_and_twice() {
        let tok = qwen();
        let mut dec = IncrementalDecoder::new(false);
        assert_eq!(dec.flush(tok).unwrap(), "");
        assert_eq!(dec.push(tok, 9707).unwrap(), "Hello");
        assert_eq!(dec.flush(tok).unwrap(), "");
        assert_eq!(dec.push(tok, 1879).unwrap(), " world");
    }

    #[test]
    fn suffix_after_handles_non_prefix() {
        assert_eq!(suffix_after("abc", "ab"), "c");
        assert_eq!(suffix_after("aXc", "ab"), "Xc");
        assert_eq!(suffix_after("é!", "éa"), "!");
        assert_eq!(suffix_after("a", "abc"), "");
    }

    #[test]
    fn skipped_special_tokens_do_not_grow_the_window() {
        let tok = qwen();
        let mut dec = IncrementalDecoder::new(true);
        let mut out = String::new();
        for _ in 0..1000 {
            out.push_str(&dec.push(tok, 151645).unwrap()); // <|im_end|>, skipped
        }
        assert!(dec.ids.len() <= 1, "window grew to {}", dec.ids.len());
        out.push_str(&dec.push(tok, 9707).unwrap()); // "Hello"
        assert_eq!(out, "Hello");
    }
}
