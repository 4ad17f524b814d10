//! The vocabulary as llguidance sees it: every token's bytes in a trie, added tokens marked
//! special, and the model's padded ids present but empty (so no grammar ever allows them).

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;

struct FlintTokEnv {
    trie: TokTrie,
}

impl TokenizerEnv for FlintTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Only llguidance's forced-token helpers tokenize text, and flint does not use them (every
    /// token is sampled under a mask): the trie's greedy split is correct, if not canonical BPE.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// Build the token environment for a model whose logits have `vocab_size` rows and which stops
/// on `eos` (the grammar allows these where it may end).
pub fn build(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<TokEnv, String> {
    let n = tokenizer.len();
    if n > vocab_size {
        return Err(format!("the tokenizer has {n} tokens, more than the model's {vocab_size} logits"));
    }
    if let Some(e) = eos.iter().find(|&&e| e as usize >= vocab_size) {
        return Err(format!("end-of-sequence id {e} is outside the model's {vocab_size} logits"));
    }
    // The grammar marks where it may end by allowing its EOS ids; flint replaces them with each
    // sample's own stop ids. A model without any still needs one: its last padding row, which
    // no tokenizer text can produce.
    let eos: Vec<u32> = match (eos, n < vocab_size) {
        ([], true) => vec![vocab_size as u32 - 1],
        ([], false) => return Err("the model has no end-of-sequence token and no spare vocabulary row".into()),
        (e, _) => e.to_vec(),
    };
    let mut words: Vec<Vec<u8>> = (0..n as u32).map(|id| tokenizer.token_bytes(id).unwrap_or_default()).collect();
    // Added tokens (`<|im_end|>`, `<tool_call>`, `</think>`) are special to the grammar whatever
    // the tokenizer's own flag says (Qwen marks `<tool_call>` non-special): text in a JSON
    // string can never be one, and a Lark grammar names them as `<tool_call>`.
    for (id, text) in tokenizer.added_tokens() {
        if let Some(w) = words.get_mut(id as usize) {
            let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            marked.extend_from_slice(text.as_bytes());
            *w = marked;
        }
    }
    words.resize(vocab_size, Vec::new());
    let info = TokRxInfo::new(vocab_size as u32, eos[0]);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    Ok(Arc::new(FlintTokEnv { trie }))
}

/// The tokens that are nothing but ASCII whitespace, as a bitset over the vocabulary.
pub fn whitespace_tokens(env: &TokEnv) -> Vec<u32> {
    let trie = env.tok_trie();
    let n = trie.vocab_size();
    let mut words = vec![0u32; n.div_ceil(32)];
    for id in 0..n as u32 {
        let b = trie.token(id);
        if !b.is_empty() && b.iter().all(|c| b" \t\n\r".contains(c)) {
            words[id as usize / 32] |= 1 << (id % 32);
        }
    }
    words
}
