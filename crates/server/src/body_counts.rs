//! The lengths of a body's lists, counted before anything is built from it. A 13.6 MB chat
//! body of 420,000 one-character messages took 8.5 s and 0.74 GB to parse into a value tree and
//! shape for the template, only for the template's budget to refuse it; counted first (one pass
//! over the bytes that keeps nothing), it is refused in milliseconds. The lists counted are the
//! ones a client can make long: conversation turns (`messages`, the Responses API's `input`),
//! their content parts and tool calls, `tools`, `prompt` lists and `/detokenize`'s `tokens`.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::{ApiError, ApiResult};

/// Conversation turns per request: more than any context holds (each turn costs its template
/// at least five tokens, so 8,192 turns are 40k tokens before any text).
pub const MAX_MESSAGES: usize = 8192;
/// Content parts and tool calls over all the turns of a request.
pub const MAX_PARTS: usize = 16_384;
/// Prompts in a completions request's `prompt` list (admission caps the sequences far lower).
pub const MAX_PROMPTS: usize = 4096;
/// Ids in a `prompt` of token ids or a `/detokenize` list: the longest context a model has.
pub const MAX_IDS: usize = 1 << 20;

/// What a body holds, by count.
#[derive(Debug, Default, PartialEq)]
pub struct Counts {
    /// `messages` or `input` (0 when it is not a list).
    pub turns: usize,
    /// Content parts and tool calls, over every turn.
    pub parts: usize,
    /// `prompt`'s prompts: the strings and id lists of a list (a list of ids is one prompt, and
    /// a single string none: it is not a list).
    pub prompts: usize,
    /// Token ids in `prompt`, over all its prompts.
    pub prompt_ids: usize,
    /// `/detokenize`'s `tokens`.
    pub tokens: usize,
    pub tools: usize,
}

impl Counts {
    /// 400 for the first list past its limit, naming its field.
    pub fn check(&self) -> ApiResult<()> {
        let over = |param: &str, what: &str, n: usize, max: usize| {
            Err(ApiError::invalid(param, format!("`{param}` has {n} {what}; at most {max} are allowed")))
        };
        if self.turns > MAX_MESSAGES {
            return over("messages", "messages", self.turns, MAX_MESSAGES);
        }
        if self.parts > MAX_PARTS {
            return over("messages", "content parts and tool calls", self.parts, MAX_PARTS);
        }
        if self.prompts > MAX_PROMPTS {
            return over("prompt", "prompts", self.prompts, MAX_PROMPTS);
        }
        if self.prompt_ids > MAX_IDS {
            return over("prompt", "token ids", self.prompt_ids, MAX_IDS);
        }
        if self.tokens > MAX_IDS {
            return over("tokens", "token ids", self.tokens, MAX_IDS);
        }
        if self.tools > crate::limits::MAX_TOOLS {
            return over("tools", "definitions", self.tools, crate::limits::MAX_TOOLS);
        }
        Ok(())
    }
}

/// Count `bytes`' lists without building them. A body that is not a JSON object, or not JSON,
/// counts as empty: the parser that follows says what is wrong with it.
pub fn count(bytes: &[u8]) -> Counts {
    let mut counts = Counts::default();
    let mut de = serde_json::Deserializer::from_slice(bytes);
    if Top(&mut counts).deserialize(&mut de).is_err() {
        return Counts::default();
    }
    counts
}

/// Visits the top-level object, counting the fields that hold long lists.
struct Top<'a>(&'a mut Counts);

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match &*key {
                "messages" | "input" => map.next_value_seed(Turns(self.0))?,
                "prompt" => {
                    let l = map.next_value_seed(Items { nested: true })?;
                    // A list of numbers is one prompt of ids; otherwise each item is a prompt.
                    self.0.prompts = if l.numbers > 0 && l.numbers == l.len { 1 } else { l.len };
                    self.0.prompt_ids = l.numbers + l.inner_numbers;
                }
                "tokens" => self.0.tokens = map.next_value_seed(Items { nested: false })?.len,
                "tools" => self.0.tools = map.next_value_seed(Items { nested: false })?.len,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// What a value holds, as a list.
#[derive(Debug, Default)]
struct List {
    /// Its items (0 for anything that is not a list).
    len: usize,
    /// Items that are numbers.
    numbers: usize,
    /// Numbers in the lists inside it (counted with `nested`).
    inner_numbers: usize,
    /// The value itself is a number.
    is_number: bool,
}

/// Counts a list's items; with `nested`, also the numbers in the lists inside it (a `prompt` of
/// several id lists).
struct Items {
    nested: bool,
}

impl<'de> DeserializeSeed<'de> for Items {
    type Value = List;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<List, D::Error> {
        d.deserialize_any(self)
    }
}

fn number<E>() -> Result<List, E> {
    Ok(List { is_number: true, ..List::default() })
}

impl<'de> Visitor<'de> for Items {
    type Value = List;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<List, A::Error> {
        let mut l = List::default();
        while let Some(item) = seq.next_element_seed(Items { nested: false })? {
            l.len += 1;
            l.numbers += usize::from(item.is_number);
            if self.nested {
                l.inner_numbers += item.numbers;
            }
        }
        Ok(l)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<List, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(List::default())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<List, E> {
        Ok(List::default())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<List, E> {
        number()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<List, E> {
        number()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<List, E> {
        number()
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<List, E> {
        Ok(List::default())
    }
    fn visit_unit<E: de::Error>(self) -> Result<List, E> {
        Ok(List::default())
    }
}

/// `messages` / `input`: the turns, and in each its content parts and tool calls.
struct Turns<'a>(&'a mut Counts);

impl<'de> DeserializeSeed<'de> for Turns<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Turns<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(parts) = seq.next_element_seed(Turn)? {
            self.0.turns += 1;
            self.0.parts = self.0.parts.saturating_add(parts);
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// One turn: the length of its `content` list plus its `tool_calls` list.
struct Turn;

impl<'de> DeserializeSeed<'de> for Turn {
    type Value = usize;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Turn {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        let mut parts = 0usize;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if matches!(&*key, "content" | "tool_calls") {
                parts = parts.saturating_add(map.next_value_seed(Items { nested: false })?.len);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(parts)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(0)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_unit<E: de::Error>(self) -> Result<usize, E> {
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_long_lists_only() {
        let body = br#"{"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}, {"id": "2"}, {"id": "3"}]}
        ], "tools": [{}, {}], "temperature": 9, "extra": {"messages": [1, 2, 3]}}"#;
        assert_eq!(count(body), Counts { turns: 3, parts: 5, tools: 2, ..Default::default() });
        let prompts = br#"{"prompt": [[1, 2, 3], [4, 5]], "tokens": [7, 8, 9]}"#;
        assert_eq!(count(prompts), Counts { prompts: 2, prompt_ids: 5, tokens: 3, ..Default::default() });
        let one = br#"{"prompt": [1, 2, 3]}"#;
        assert_eq!(count(one), Counts { prompts: 1, prompt_ids: 3, ..Default::default() });
        let texts = br#"{"prompt": ["a", "b"]}"#;
        assert_eq!(count(texts), Counts { prompts: 2, ..Default::default() });
        assert_eq!(count(br#"{"prompt": "one"}"#), Counts::default());
        assert_eq!(count(br#"{"input": "Hi"}"#), Counts::default());
        // Not an object, or not JSON: nothing counted (the parser explains).
        assert_eq!(count(b"[1, 2]"), Counts::default());
        assert_eq!(count(b"{\"messages\": [1, 2"), Counts::default());
    }

    #[test]
    fn limits_name_their_field() {
        let param = |c: Counts| c.check().err().and_then(|e| e.param);
        assert_eq!(param(Counts { turns: MAX_MESSAGES + 1, ..Default::default() }).as_deref(), Some("messages"));
        assert_eq!(param(Counts { parts: MAX_PARTS + 1, ..Default::default() }).as_deref(), Some("messages"));
        assert_eq!(param(Counts { tokens: MAX_IDS + 1, ..Default::default() }).as_deref(), Some("tokens"));
        assert_eq!(param(Counts { prompt_ids: MAX_IDS + 1, ..Default::default() }).as_deref(), Some("prompt"));
        assert_eq!(param(Counts { prompts: MAX_PROMPTS + 1, ..Default::default() }).as_deref(), Some("prompt"));
        assert_eq!(param(Counts { tools: 129, ..Default::default() }).as_deref(), Some("tools"));
        assert!(Counts { turns: MAX_MESSAGES, parts: MAX_PARTS, ..Default::default() }.check().is_ok());
    }

    #[test]
    fn a_huge_conversation_is_counted_quickly_and_refused() {
        let mut body = String::from("{\"messages\": [");
        for i in 0..420_000 {
            body.push_str(if i == 0 {
                "{\"role\":\"user\",\"content\":\"x\"}"
            } else {
                ",{\"role\":\"user\",\"content\":\"x\"}"
            });
        }
        body.push_str("], \"temperature\": 9}");
        let c = count(body.as_bytes());
        assert_eq!(c.turns, 420_000);
        assert!(c.check().is_err());
    }
}
