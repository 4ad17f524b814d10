//! Reasoning output (`--reasoning-parser`): a reasoning model's chain of thought, the text up to
//! `</think>`, is returned apart from its answer, as `message.reasoning` (and, for older clients,
//! `reasoning_content`), streamed as `delta.reasoning`.
//!
//! - `deepseek_r1`: the R1-Distill template opens `<think>\n` in the prompt itself, so the output
//!   starts inside the reasoning: everything before `</think>` is reasoning, and everything is
//!   reasoning if `</think>` never arrives (a leading `<think>`, as older templates leave it to
//!   the model, is dropped).
//! - `qwen3`: the model opens `<think>` itself; an output that does not start with it (thinking
//!   disabled) is all answer.

use std::str::FromStr;

use flint_engine::structured::MarkerWatch;
use flint_engine::tokenizer::Tokenizer;

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    DeepSeekR1,
    Qwen3,
}

impl FromStr for ReasoningParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "deepseek_r1" => Ok(Self::DeepSeekR1),
            "qwen3" => Ok(Self::Qwen3),
            other => Err(format!("unknown reasoning parser {other:?}; flint has deepseek_r1 and qwen3")),
        }
    }
}

impl ReasoningParser {
    /// Where a constraint starts: after the reasoning, when the output will have one.
    /// `thinking`: the request's `chat_template_kwargs.enable_thinking` (Qwen3 templates close
    /// an empty reasoning in the prompt when it is false).
    pub fn constraint_after(self, thinking: bool) -> Option<String> {
        match self {
            Self::DeepSeekR1 => Some(THINK_END.into()),
            Self::Qwen3 => thinking.then(|| THINK_END.into()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing decided yet: the output may still open with `<think>`.
    Start,
    Reasoning,
    /// The answer; `fresh` while nothing of it has been released (its leading whitespace, the
    /// template's separation from `</think>`, is dropped).
    Content {
        fresh: bool,
    },
}

/// Splits one sample's text, as it streams, into reasoning and content. Any split of the same
/// output into pieces gives the same concatenated reasoning and content.
#[derive(Debug, Clone)]
pub struct ReasoningSplit {
    parser: ReasoningParser,
    phase: Phase,
    /// Text that may be the start of a marker.
    held: String,
    /// Output tokens up to and including the one that completes `</think>` (all of them while
    /// it has not come).
    tokens_to_end: usize,
    /// Spots `</think>` across tokens.
    end: MarkerWatch,
    ended: bool,
    /// The output turned out to have no reasoning (qwen3 without `<think>`).
    no_reasoning: bool,
}

/// What one piece of output added.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// The length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl ReasoningSplit {
    pub fn new(parser: ReasoningParser) -> Self {
        Self {
            parser,
            phase: Phase::Start,
            held: String::new(),
            tokens_to_end: 0,
            end: MarkerWatch::new(THINK_END),
            ended: false,
            no_reasoning: false,
        }
    }

    /// Count the output tokens `ids` (their bytes, so a marker split across tokens is found).
    pub fn count_tokens(&mut self, tok: &Tokenizer, ids: &[u32]) {
        for &id in ids {
            if self.ended {
                return;
            }
            self.tokens_to_end += 1;
            self.ended = self.end.push(&tok.token_bytes(id).unwrap_or_default());
        }
    }

    /// `usage.completion_tokens_details.reasoning_tokens`.
    pub fn reasoning_tokens(&self) -> usize {
        if self.no_reasoning {
            0
        } else {
            self.tokens_to_end
        }
    }

    /// Take `text` and return what can be released.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.held.push_str(text);
        loop {
            match self.phase {
                Phase::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_START) {
                        self.held = rest.to_string();
                        self.phase = Phase::Reasoning;
                    } else if THINK_START.starts_with(t) {
                        return out; // still possibly `<think>`
                    } else {
                        self.phase = match self.parser {
                            ReasoningParser::DeepSeekR1 => Phase::Reasoning,
                            ReasoningParser::Qwen3 => {
                                self.no_reasoning = true;
                                Phase::Content { fresh: false }
                            }
                        };
                    }
                }
                Phase::Reasoning => {
                    if let Some(i) = self.held.find(THINK_END) {
                        out.reasoning.push_str(&self.held[..i]);
                        self.held = self.held[i + THINK_END.len()..].to_string();
                        self.phase = Phase::Content { fresh: true };
                    } else {
                        let keep = partial_suffix(&self.held, THINK_END);
                        let cut = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                }
                Phase::Content { fresh } => {
                    let s = std::mem::take(&mut self.held);
                    let s = if fresh { s.trim_start().to_string() } else { s };
                    if !s.is_empty() {
                        self.phase = Phase::Content { fresh: false };
                    }
                    out.content.push_str(&s);
                    return out;
                }
            }
        }
    }

    /// One streamed output: count its tokens, split its text, and at the `last` one release
    /// whatever was held.
    pub fn take(&mut self, tok: &Tokenizer, ids: &[u32], text: &str, last: bool) -> Split {
        self.count_tokens(tok, ids);
        let mut split = self.push(text);
        if last {
            let rest = self.finish();
            split.reasoning.push_str(&rest.reasoning);
            split.content.push_str(&rest.content);
        }
        split
    }

    /// The end of the output: release whatever was held.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.held);
        match self.phase {
            Phase::Start if self.parser == ReasoningParser::Qwen3 => {
                self.no_reasoning = true;
                Split { content: rest, ..Default::default() }
            }
            Phase::Start | Phase::Reasoning => Split { reasoning: rest, ..Default::default() },
            Phase::Content { fresh } => {
                Split { content: if fresh { rest.trim_start().to_string() } else { rest }, ..Default::default() }
            }
        }
    }

    /// Split a whole output at once (the stream's rule, so the two cannot disagree), with its
    /// reasoning tokens.
    pub fn split_all(parser: ReasoningParser, tok: &Tokenizer, text: &str, ids: &[u32]) -> (Split, usize) {
        let mut s = Self::new(parser);
        s.count_tokens(tok, ids);
        let mut a = s.push(text);
        let b = s.finish();
        a.reasoning.push_str(&b.reasoning);
        a.content.push_str(&b.content);
        (a, s.reasoning_tokens())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(p: ReasoningParser, t: &str) -> (String, String) {
        let mut s = ReasoningSplit::new(p);
        let mut a = s.push(t);
        let b = s.finish();
        a.reasoning.push_str(&b.reasoning);
        a.content.push_str(&b.content);
        (a.reasoning, a.content)
    }

    #[test]
    fn deepseek_r1_reasoning_ends_at_think_end() {
        let r1 = ReasoningParser::DeepSeekR1;
        assert_eq!(all(r1, "Let me see.\n</think>\n\nParis."), ("Let me see.\n".into(), "Paris.".into()));
        assert_eq!(all(r1, "<think>\nhmm</think>ok"), ("\nhmm".into(), "ok".into()));
        assert_eq!(all(r1, "never closes </thi"), ("never closes </thi".into(), String::new()));
        assert_eq!(all(r1, "</think>"), (String::new(), String::new()));
    }

    #[test]
    fn qwen3_without_think_is_all_content() {
        let q = ReasoningParser::Qwen3;
        assert_eq!(all(q, "Paris."), (String::new(), "Paris.".into()));
        assert_eq!(all(q, "<think>a</think>\nb"), ("a".into(), "b".into()));
        assert_eq!(all(q, "<thi"), (String::new(), "<thi".into()));
    }

    #[test]
    fn reasoning_tokens_run_to_the_one_closing_it() {
        let tok = Tokenizer::builtin_qwen().unwrap();
        let count = |p, text: &str| {
            let ids = tok.encode(text, false).unwrap();
            let (_, n) = ReasoningSplit::split_all(p, &tok, text, &ids);
            let end = text.find(THINK_END).map(|i| tok.encode(&text[..i + THINK_END.len()], false).unwrap().len());
            (n, end.unwrap_or(ids.len()), ids.len())
        };
        let (n, want, total) = count(ReasoningParser::DeepSeekR1, "a b c</think>\n\nanswer here");
        assert_eq!(n, want);
        assert!(n < total);
        let (n, _, total) = count(ReasoningParser::DeepSeekR1, "thinking, never done");
        assert_eq!(n, total);
        assert_eq!(count(ReasoningParser::Qwen3, "plain answer").0, 0);
        // Split across tokens: `</` + `think` + `>`.
        let (n, want, _) = count(ReasoningParser::DeepSeekR1, "x</ think>y</think>z");
        assert_eq!(n, want);
    }

    /// Every split of an output into pieces releases the same reasoning and content.
    #[test]
    fn streaming_agrees_with_the_whole_split() {
        let texts =
            ["<think>\nab</think>\n\ncd", "x</think>y", "a</thi</think>z", "é</think>\n ü", "no end <", "<think"];
        for p in [ReasoningParser::DeepSeekR1, ReasoningParser::Qwen3] {
            for t in texts {
                let want = all(p, t);
                let chars: Vec<char> = t.chars().collect();
                for cut in 0..=chars.len() {
                    for cut2 in cut..=chars.len() {
                        let pieces: Vec<String> = [&chars[..cut], &chars[cut..cut2], &chars[cut2..]]
                            .iter()
                            .map(|c| c.iter().collect())
                            .collect();
                        let mut s = ReasoningSplit::new(p);
                        let (mut r, mut c) = (String::new(), String::new());
                        for piece in &pieces {
                            let o = s.push(piece);
                            r.push_str(&o.reasoning);
                            c.push_str(&o.content);
                        }
                        let o = s.finish();
                        r.push_str(&o.reasoning);
                        c.push_str(&o.content);
                        assert_eq!((r, c), want, "{p:?} {pieces:?}");
                    }
                }
            }
        }
    }
}
