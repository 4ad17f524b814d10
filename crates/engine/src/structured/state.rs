//! One sample's walk through its grammar: the mask of tokens allowed next, advanced by every
//! token drawn. With a reasoning model the walk waits until the reasoning has ended
//! (`</think>`): the chain of thought is free text, the answer after it is constrained.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokTrie};
use llguidance::Matcher;

use super::{CompiledGrammar, MarkerWatch};

pub struct GrammarState {
    matcher: Matcher,
    env: TokEnv,
    /// Set while the grammar waits for the end of the reasoning. Bytes of the token that
    /// completes it after the marker (rare: `</think>` is a token of its own in reasoning models'
    /// vocabularies) are not checked against the grammar.
    gate: Option<MarkerWatch>,
    /// Right after the reasoning: whitespace-only tokens (a template's blank line after
    /// `</think>`) may come before the grammar's first token, and are not part of its text.
    leading_whitespace: bool,
    whitespace: Arc<Vec<u32>>,
}

impl GrammarState {
    /// Start `grammar` now, or once the output contains `after` (the reasoning's end marker).
    pub fn new(grammar: &CompiledGrammar, after: Option<&str>) -> Result<Self, String> {
        let matcher = grammar.start();
        let env = matcher.tok_env().map_err(|e| e.to_string())?;
        let gate = after.filter(|a| !a.is_empty()).map(MarkerWatch::new);
        Ok(Self { matcher, env, gate, leading_whitespace: false, whitespace: grammar.whitespace.clone() })
    }

    /// Whether the next token is constrained (false while the reasoning runs).
    pub fn is_active(&self) -> bool {
        self.gate.is_none()
    }

    /// The ids allowed next, as a bitset in `out` (bit `i % 32` of word `i / 32`). `end_ids`
    /// (the sample's stop ids) are allowed exactly where the grammar may end; the grammar's
    /// own EOS ids are not otherwise allowed, so `ignore_eos` keeps meaning what it says.
    pub fn mask(&mut self, end_ids: &[u32], out: &mut Vec<u32>) -> Result<(), String> {
        let mut m = self.matcher.compute_mask().map_err(|e| grammar_failed(&e.to_string()))?;
        let trie: &TokTrie = self.env.tok_trie();
        let may_end = trie.eos_tokens().iter().any(|&e| m.is_allowed(e));
        for &e in trie.eos_tokens() {
            m.disallow_token(e);
        }
        if may_end {
            for &e in end_ids {
                if (e as usize) < trie.vocab_size() {
                    m.allow_token(e);
                }
            }
        }
        if m.is_zero() {
            return Err(grammar_failed("no token can continue the output here"));
        }
        out.clear();
        out.extend_from_slice(m.as_slice());
        if self.leading_whitespace {
            for (o, w) in out.iter_mut().zip(self.whitespace.iter()) {
                *o |= w;
            }
        }
        Ok(())
    }

    /// Take the drawn token. A stop id ends the sample and is not part of the grammar's text.
    pub fn advance(&mut self, token: u32, end_ids: &[u32]) -> Result<(), String> {
        if let Some(gate) = &mut self.gate {
            let bytes = self.env.tok_trie().token(token);
            let bytes = bytes.strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER]).unwrap_or(bytes);
            if gate.push(bytes) {
                self.gate = None;
                self.leading_whitespace = true;
            }
            return Ok(());
        }
        if end_ids.contains(&token) {
            return Ok(());
        }
        if std::mem::take(&mut self.leading_whitespace) {
            let fits = self.matcher.validate_tokens(&[token]).map_err(|e| grammar_failed(&e.to_string()))? == 1;
            let ws = self.whitespace.get(token as usize / 32).is_some_and(|w| w >> (token % 32) & 1 == 1);
            if !fits && ws {
                self.leading_whitespace = true;
                return Ok(());
            }
        }
        self.matcher.consume_token(token).map_err(|e| grammar_failed(&e.to_string()))
    }

    /// The grammar is complete and nothing may follow: the sample is done.
    pub fn is_finished(&self) -> bool {
        self.gate.is_none() && self.matcher.is_stopped()
    }
}

#[cfg(test)]
impl GrammarState {
    /// An independent copy at the same point of the walk.
    pub(crate) fn clone_for_test(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            env: self.env.clone(),
            gate: self.gate.clone(),
            leading_whitespace: self.leading_whitespace,
            whitespace: self.whitespace.clone(),
        }
    }
}

fn grammar_failed(msg: &str) -> String {
    format!("structured output failed: {}", msg.lines().next().unwrap_or(msg))
}
