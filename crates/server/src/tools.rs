//! Tool calls in Qwen2.5's (Hermes-style) format: the model writes
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, which becomes OpenAI's
//! `message.tool_calls` (and, streaming, tool-call deltas) with `finish_reason: "tool_calls"`.

use serde_json::{json, Value};

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
    pub fn to_json(&self, index: Option<usize>) -> Value {
        let mut v = json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        });
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

fn call_id(request_id: &str, choice: usize, n: usize) -> String {
    // Unique within the response and stable for a request: a client can match results to calls.
    let tail: String = request_id.chars().rev().take(12).collect::<Vec<_>>().into_iter().rev().collect();
    format!("call_{tail}_{choice}_{n}")
}

/// Parse one `<tool_call>` body; `None` if it is not `{"name": string, "arguments": …}`.
fn parse_call(body: &str, id: String) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        None => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall { id, name, arguments })
}

/// Split a finished output into content (text outside the tags, `None` if blank) and tool calls.
/// A tag whose body is not a valid call stays in the content, untouched.
pub fn extract(text: &str, request_id: &str, choice: usize) -> (Option<String>, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else { break };
        match parse_call(&after[..end], call_id(request_id, choice, calls.len())) {
            Some(c) => {
                content.push_str(&rest[..start]);
                calls.push(c);
            }
            None => content.push_str(&rest[..start + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &after[end + CLOSE.len()..];
    }
    content.push_str(rest);
    let content =
        if calls.is_empty() { Some(content) } else { Some(content.trim().to_string()).filter(|c| !c.is_empty()) };
    (content, calls)
}

/// Incremental version for streams: text is released as content until a `<tool_call>` begins
/// (a possible start of the tag is held back), and each completed call is returned whole.
#[derive(Debug, Default, Clone)]
pub struct ToolStream {
    held: String,
    in_call: bool,
    calls: usize,
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
                        out.calls.push(c);
                    }
                    None => out.content.push_str(&format!("{OPEN}{body}{CLOSE}")),
                }
            } else if let Some(start) = self.held.find(OPEN) {
                out.content.push_str(&self.held[..start]);
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
                out.content.push_str(&self.held[..cut]);
                self.held.drain(..cut);
                break;
            }
        }
        // Text between calls is whitespace from the template: not worth a content delta.
        if self.calls > 0 && out.content.trim().is_empty() {
            out.content.clear();
        }
        out
    }

    /// End of output: an unterminated call is released as plain text.
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.held);
        if self.in_call {
            self.in_call = false;
            format!("{OPEN}{rest}")
        } else {
            rest
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>";

    #[test]
    fn extracts_calls_and_content() {
        let (content, calls) = extract(OUT, "chatcmpl-abc", 0);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(serde_json::from_str::<Value>(&calls[0].arguments).unwrap(), json!({"city": "Paris"}));
        assert_eq!(calls[1].arguments, "{}");
        assert_ne!(calls[0].id, calls[1].id);
        let (content, calls) = extract("plain answer", "x", 0);
        assert_eq!((content.as_deref(), calls.len()), (Some("plain answer"), 0));
        // Not a call: left as text.
        let (content, calls) = extract("<tool_call>oops</tool_call>", "x", 0);
        assert_eq!((content.as_deref(), calls.len()), (Some("<tool_call>oops</tool_call>"), 0));
    }

    #[test]
    fn streaming_matches_whole_parse_for_every_split() {
        for step in 1..8 {
            let mut s = ToolStream::default();
            let (mut content, mut calls) = (String::new(), Vec::new());
            let chars: Vec<char> = OUT.chars().collect();
            for piece in chars.chunks(step) {
                let d = s.push(&piece.iter().collect::<String>(), "chatcmpl-abc", 0);
                content.push_str(&d.content);
                assert!(!d.content.contains('<'), "a tag leaked as content: {:?}", d.content);
                calls.extend(d.calls);
            }
            content.push_str(&s.finish());
            let (want_content, want_calls) = extract(OUT, "chatcmpl-abc", 0);
            assert_eq!(calls, want_calls, "step {step}");
            assert_eq!(content.trim(), want_content.unwrap(), "step {step}");
        }
    }

    #[test]
    fn unterminated_call_is_released_as_text() {
        let mut s = ToolStream::default();
        let d = s.push("hi <tool_call>{\"name\"", "x", 0);
        assert_eq!(d.content, "hi ");
        assert_eq!(s.finish(), "<tool_call>{\"name\"");
        let mut s = ToolStream::default();
        assert_eq!(s.push("a <tool", "x", 0).content, "a ");
        assert_eq!(s.push("box", "x", 0).content, "<toolbox");
    }
}
