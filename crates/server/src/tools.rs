//! Tool calls in Qwen2.5's (Hermes-style) format: the model writes
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, which becomes OpenAI's
//! `message.tool_calls` (and, streaming, tool-call deltas) with `finish_reason: "tool_calls"`.

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::api_types::chat::{ChatToolCall, FunctionCall};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// JSON text, as OpenAI sends `function.arguments`.
    pub arguments: String,
}

impl ToolCall {
    /// The call in chat's shape; `index` (its place among the choice's calls) when streamed.
    pub fn to_chat(&self, index: Option<usize>) -> ChatToolCall {
        ChatToolCall {
            id: self.id.clone(),
            kind: "function",
            function: FunctionCall { name: self.name.clone(), arguments: self.arguments.clone() },
            index,
        }
    }
}

fn call_id(request_id: &str, choice: usize, n: usize) -> String {
    // Unique within the response and stable for a request: a client can match results to calls.
    let tail: String = request_id.chars().rev().take(12).collect::<Vec<_>>().into_iter().rev().collect();
    format!("call_{tail}_{choice}_{n}")
}

/// A `<tool_call>` body as the model wrote it: the arguments stay text, so nothing in them is
/// changed on the way to the client (a 26-digit integer parsed into an f64 came back as
/// `-3.9355609393093556e+25`).
#[derive(Deserialize)]
struct RawCall<'a> {
    name: String,
    #[serde(borrow, default)]
    arguments: Option<&'a RawValue>,
}

/// Parse one `<tool_call>` body; `None` if it is not `{"name": string, "arguments": …}`. The
/// arguments are handed on as generated (a JSON string's contents when the model wrote them as
/// a string).
fn parse_call(body: &str, id: String) -> Option<ToolCall> {
    let call: RawCall = serde_json::from_str(body.trim()).ok()?;
    let arguments = match call.arguments.map(RawValue::get) {
        None => "{}".to_string(),
        Some(raw) if raw.starts_with('"') => serde_json::from_str::<String>(raw).ok()?,
        Some(raw) => raw.to_string(),
    };
    Some(ToolCall { id, name: call.name, arguments })
}

/// Split a finished output into content and tool calls, by running [`ToolStream`] over the
/// whole text, so a stream and a whole parse cannot disagree.
///
/// The content follows the rule documented on [`ToolStream`]; it is `None` when calls were
/// found and no content is left (it can then never be whitespace only), and `Some` —
/// verbatim, possibly empty — when there are no calls.
pub fn extract(text: &str, request_id: &str, choice: usize) -> (Option<String>, Vec<ToolCall>) {
    let mut s = ToolStream::default();
    let ToolDelta { mut content, calls } = s.push(text, request_id, choice);
    content.push_str(&s.finish());
    let content = if calls.is_empty() { Some(content) } else { Some(content).filter(|c| !c.trim().is_empty()) };
    (content, calls)
}

/// Incremental tool-call parser for streams; [`extract`] is this run over the whole text.
///
/// The rule, which depends only on what has been seen so far (a streaming client cannot
/// un-send text):
/// - A `<tool_call>…</tool_call>` whose body is `{"name": string, "arguments": …}` is a call
///   and is removed from the content. Any other text — an invalid body together with its
///   tags, an unterminated `<tool_call>` at the end — is content, verbatim.
/// - Every maximal run of whitespace in the remaining content is kept verbatim, except a run
///   that a call was removed from or next to (the whitespace of the template around calls)
///   *and* that begins or ends the content: that run is dropped. So `"\n<call>\n"` around
///   calls at either end disappears, while `"a <call> b"` keeps `"a  b"` and whitespace not
///   touching a call (leading spaces of a plain answer) is never dropped.
///
/// Text is released as content as soon as it is known, except a trailing whitespace run
/// (held until the next non-whitespace text decides it, or until [`ToolStream::finish`]) and a
/// suffix that could still grow into `<tool_call>`. Each completed call is returned whole.
/// The concatenation of every `push`'s content and `finish` is the same for any split of the
/// output into pieces, and equals [`extract`]'s content (`None` read as `""`).
#[derive(Debug, Default, Clone)]
pub struct ToolStream {
    /// Unprocessed text: a possible start of `<tool_call>`, or the body of an open call.
    held: String,
    in_call: bool,
    calls: usize,
    /// The trailing whitespace run of the content so far, not yet released.
    ws: String,
    /// A valid call was removed inside or next to `ws`.
    ws_has_call: bool,
    /// Some content has been released (it then ends with non-whitespace).
    emitted: bool,
}

#[derive(Debug, Default, PartialEq)]
pub struct ToolDelta {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

impl ToolStream {
    pub fn num_calls(&self) -> usize {
        self.calls
    }

    /// Content text (outside valid calls) arrives: release it, holding its trailing whitespace.
    fn text(&mut self, s: &str, out: &mut String) {
        let Some(first) = s.find(|c: char| !c.is_whitespace()) else {
            self.ws.push_str(s);
            return;
        };
        // `s`'s leading whitespace continues the held run. The run is dropped only if it
        // touches a call and begins the content.
        self.ws.push_str(&s[..first]);
        if self.emitted || !self.ws_has_call {
            out.push_str(&self.ws);
        }
        let end = s.char_indices().rev().find(|(_, c)| !c.is_whitespace()).map_or(s.len(), |(i, c)| i + c.len_utf8());
        out.push_str(&s[first..end]);
        self.emitted = true;
        self.ws.clear();
        self.ws.push_str(&s[end..]);
        self.ws_has_call = false;
    }

    pub fn push(&mut self, text: &str, request_id: &str, choice: usize) -> ToolDelta {
        self.held.push_str(text);
        let mut out = ToolDelta::default();
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CLOSE) else { break };
                let body: String = self.held[..end].to_string();
                self.held.drain(..end + CLOSE.len());
                self.in_call = false;
                match parse_call(&body, call_id(request_id, choice, self.calls)) {
                    Some(c) => {
                        self.calls += 1;
                        self.ws_has_call = true;
                        out.calls.push(c);
                    }
                    None => self.text(&format!("{OPEN}{body}{CLOSE}"), &mut out.content),
                }
            } else if let Some(start) = self.held.find(OPEN) {
                let before: String = self.held[..start].to_string();
                self.text(&before, &mut out.content);
                self.held.drain(..start + OPEN.len());
                self.in_call = true;
            } else {
                // Hold back a suffix that could still grow into `<tool_call>`.
                let keep = (1..OPEN.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&k| {
                        self.held.is_char_boundary(self.held.len() - k)
                            && OPEN.starts_with(&self.held[self.held.len() - k..])
                    })
                    .unwrap_or(0);
                let cut = self.held.len() - keep;
                let released: String = self.held.drain(..cut).collect();
                self.text(&released, &mut out.content);
                break;
            }
        }
        out
    }

    /// End of output: the rest of the content. An unterminated call or a partial tag is
    /// released as plain text; held whitespace is released unless it touches a call.
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.held);
        let rest = if std::mem::take(&mut self.in_call) { format!("{OPEN}{rest}") } else { rest };
        let mut out = String::new();
        self.text(&rest, &mut out);
        if !self.ws_has_call {
            out.push_str(&self.ws);
        }
        self.ws.clear();
        self.ws_has_call = false;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const OUT: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>";
    const CALL: &str = "<tool_call>{\"name\":\"f\",\"arguments\":{\"x\":1}}</tool_call>";
    const BAD: &str = "<tool_call>oops</tool_call>";

    /// Outputs covering the rule's cases; `C` stands for a valid call, `B` for an invalid one.
    fn outputs() -> Vec<String> {
        let raw = [
            "plain answer",
            "  leading and trailing  \n",
            "",
            " \n\t",
            "C",
            "\nC \n C\n",
            "Let me check.\nC\n after it.\n",
            "Ok  tail B",
            "Ok  tail B C",
            "Ok  tail C B  C  ",
            "  Ok C  ",
            "C  Ok",
            "a C b <tool_call>{\"name\"",
            "a b <tool_call>",
            "é<tool_call>{\"name\":\"é\",\"arguments\":{\"x\":\"🦀\"}}</tool_call>🦀 <tool_ca",
            "🦀\u{3000}C\u{3000}é\u{3000}",
            "<tool<tool_call>{\"name\":\"f\"}</tool_call>",
            "x <tool_call> {\"name\": \"f\"} </tool_call>\t",
            "<tool_call>a<tool_call>{\"name\":\"f\"}</tool_call> z",
            "a</tool_call> b C",
            "B",
            "  B  ",
        ];
        raw.iter().map(|r| r.replace('C', CALL).replace('B', BAD)).chain([OUT.to_string()]).collect()
    }

    /// The rule written out directly (not incrementally), to check `extract` against.
    fn reference(text: &str) -> (String, usize) {
        let (mut content, mut call_at, mut rest) = (String::new(), Vec::new(), text);
        while let Some(start) = rest.find(OPEN) {
            let after = &rest[start + OPEN.len()..];
            let Some(end) = after.find(CLOSE) else { break };
            if parse_call(&after[..end], String::new()).is_some() {
                content.push_str(&rest[..start]);
                call_at.push(content.len());
            } else {
                content.push_str(&rest[..start + OPEN.len() + end + CLOSE.len()]);
            }
            rest = &after[end + CLOSE.len()..];
        }
        content.push_str(rest);
        let touches = |a: usize, b: usize| call_at.iter().any(|&p| a <= p && p <= b);
        let first = content.find(|c: char| !c.is_whitespace()).unwrap_or(content.len());
        let last = content.len() - content.trim_end().len();
        let end = content.len() - last;
        let (lo, hi) = if first == content.len() {
            (if touches(0, first) { first } else { 0 }, content.len())
        } else {
            (if touches(0, first) { first } else { 0 }, if touches(end, content.len()) { end } else { content.len() })
        };
        (content[lo..hi].to_string(), call_at.len())
    }

    /// Stream `pieces` through a `ToolStream`: (concatenated content, calls).
    fn stream<'a>(pieces: impl IntoIterator<Item = &'a str>) -> (String, Vec<ToolCall>) {
        let mut s = ToolStream::default();
        let (mut content, mut calls) = (String::new(), Vec::new());
        for p in pieces {
            let d = s.push(p, "chatcmpl-abc", 0);
            content.push_str(&d.content);
            calls.extend(d.calls);
        }
        content.push_str(&s.finish());
        (content, calls)
    }

    /// Split `text` at the char indices in `cuts` (ascending).
    fn split<'a>(text: &'a str, chars: &[usize], cuts: &[usize]) -> Vec<&'a str> {
        let mut bounds = vec![0];
        bounds.extend(cuts.iter().map(|&c| chars[c]));
        bounds.push(text.len());
        bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect()
    }

    #[test]
    fn extracts_calls_and_content() {
        let (content, calls) = extract(OUT, "chatcmpl-abc", 0);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&calls[0].arguments).unwrap(), json!({"city": "Paris"}));
        assert_eq!(calls[1].arguments, "{}");
        assert_ne!(calls[0].id, calls[1].id);
        let (content, calls) = extract("plain answer", "x", 0);
        assert_eq!((content.as_deref(), calls.len()), (Some("plain answer"), 0));
        // Not a call: left as text.
        let (content, calls) = extract("<tool_call>oops</tool_call>", "x", 0);
        assert_eq!((content.as_deref(), calls.len()), (Some("<tool_call>oops</tool_call>"), 0));
        // Only calls (and template whitespace): no content.
        let (content, calls) = extract(&format!("\n{CALL}\n\n{CALL}\n"), "x", 0);
        assert_eq!((content, calls.len()), (None, 2));
    }

    #[test]
    fn arguments_are_handed_on_as_generated() {
        let big = "<tool_call>{\"name\": \"f\", \"arguments\": {\"n\": -39355609393093556123456789, \"x\": 1.50}}</tool_call>";
        let (_, calls) = extract(big, "x", 0);
        assert_eq!(calls[0].arguments, "{\"n\": -39355609393093556123456789, \"x\": 1.50}");
        let quoted = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
        assert_eq!(extract(quoted, "x", 0).1[0].arguments, "{\"a\": 1}");
        // Still a call only when the body is an object naming a function.
        assert!(extract("<tool_call>{\"name\": 5}</tool_call>", "x", 0).1.is_empty());
        assert!(extract("<tool_call>[1]</tool_call>", "x", 0).1.is_empty());
    }

    #[test]
    fn whitespace_rule_examples() {
        let c = |t: &str| extract(&t.replace('C', CALL).replace('B', BAD), "x", 0).0;
        // The issue: the space before an invalid tag is content, streamed or not.
        assert_eq!(c("Ok  tail B").as_deref(), Some("Ok  tail <tool_call>oops</tool_call>"));
        assert_eq!(c("Ok  tail B C").as_deref(), Some("Ok  tail <tool_call>oops</tool_call>"));
        assert_eq!(c("Ok  tail C").as_deref(), Some("Ok  tail"));
        assert_eq!(c("Ok C B C").as_deref(), Some("Ok  <tool_call>oops</tool_call>"));
        // Whitespace touching a call is dropped only at the ends of the content.
        assert_eq!(c("a C b").as_deref(), Some("a  b"));
        assert_eq!(c("\n C \nb\n").as_deref(), Some("b\n"));
        // Whitespace not touching a call is never dropped (it may already be sent).
        assert_eq!(c("  Ok C").as_deref(), Some("  Ok"));
        assert_eq!(c("  Ok  ").as_deref(), Some("  Ok  "));
        assert_eq!(c("").as_deref(), Some(""));
        assert_eq!(c(" C ").as_deref(), None);
    }

    #[test]
    fn issue_whitespace_before_tag_is_streamed() {
        for text in ["Ok  tail B", "Ok  tail B C", "Ok  tail C"] {
            let text = text.replace('C', CALL).replace('B', BAD);
            let want = extract(&text, "chatcmpl-abc", 0);
            // Token by token, the lone space its own piece.
            let tokens: Vec<&str> = text.split_inclusive(['<', '>', ' ']).collect();
            let (content, calls) = stream(tokens);
            assert_eq!((Some(content).filter(|c| !c.is_empty() || calls.is_empty()), calls), want, "{text:?}");
        }
    }

    #[test]
    fn extract_follows_the_rule() {
        for text in outputs() {
            let (content, calls) = extract(&text, "x", 0);
            let (want, n) = reference(&text);
            assert_eq!(calls.len(), n, "{text:?}");
            assert_eq!(content.unwrap_or_default(), want, "{text:?}");
        }
    }

    #[test]
    fn streaming_matches_whole_parse_for_every_split() {
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        for text in outputs() {
            let (want, want_calls) = extract(&text, "chatcmpl-abc", 0);
            let want = want.unwrap_or_default();
            let chars: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
            let n = chars.len();
            let check = |cuts: &[usize]| {
                let (content, calls) = stream(split(&text, &chars, cuts));
                assert_eq!(content, want, "{text:?} cut at chars {cuts:?}");
                assert_eq!(calls, want_calls, "{text:?} cut at chars {cuts:?}");
            };
            // Every split into pieces of 1..=8 chars, where there are few enough of them.
            if n <= 18 {
                for mask in 0u32..(1 << n.saturating_sub(1)) {
                    let cuts: Vec<usize> = (1..n).filter(|&c| mask & (1 << (c - 1)) != 0).collect();
                    let mut b = vec![0];
                    b.extend(&cuts);
                    b.push(n);
                    if b.windows(2).all(|w| w[1] - w[0] <= 8) {
                        check(&cuts);
                    }
                }
                continue;
            }
            // Longer ones: fixed steps at every offset, every 1- and 2-cut split, random splits.
            for step in 1..=8 {
                for first in 1..=step.min(n) {
                    check(&(first..n).step_by(step).collect::<Vec<_>>());
                }
            }
            for a in 1..n {
                for b in a..n {
                    check(&[a, b][..if a == b { 1 } else { 2 }]);
                }
            }
            for _ in 0..300 {
                let mut cuts = Vec::new();
                let mut at = 0;
                loop {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    at += 1 + (rng % 8) as usize;
                    if at >= n {
                        break;
                    }
                    cuts.push(at);
                }
                check(&cuts);
            }
        }
    }

    #[test]
    fn unterminated_call_is_released_as_text() {
        let mut s = ToolStream::default();
        let d = s.push("hi <tool_call>{\"name\"", "x", 0);
        // The space is held until it is known not to precede a call.
        assert_eq!(d.content, "hi");
        assert_eq!(s.finish(), " <tool_call>{\"name\"");
        let mut s = ToolStream::default();
        assert_eq!(s.push("a <tool", "x", 0).content, "a");
        assert_eq!(s.push("box", "x", 0).content, " <toolbox");
        assert_eq!(s.finish(), "");
    }
}
