//! A Responses request as the chat request it stands for: `instructions` and `input` items as
//! messages (`function_call` / `function_call_output` as the assistant's tool calls and tool
//! results), `text.format` as `response_format`, flat function tools as chat tools. What a
//! stateless server cannot do is refused, and chat's errors are renamed to the Responses fields.

use serde_json::{json, Map, Value};

use crate::error::{ApiError, ApiResult};
use crate::protocol::{parse_request, ChatRequest};

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

/// Text of a message's content: a string, or a list of `input_text` / `output_text` parts.
fn content_text(i: usize, c: &Value) -> ApiResult<String> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(
                            "input",
                            format!(
                                "input[{i}]: content part type {:?} is not supported (text only)",
                                kind.unwrap_or("?")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad("input", format!("input[{i}]: `content` must be a string or a list of text parts"))),
    }
}

/// `instructions` and `input` as chat messages.
fn messages(v: &Value) -> ApiResult<Vec<Value>> {
    let mut out = Vec::new();
    match v.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(bad("instructions", "`instructions` must be a string")),
    }
    let items = match v.get("input") {
        Some(Value::String(s)) => return Ok([out, vec![json!({"role": "user", "content": s})]].concat()),
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) => return Err(bad("input", "`input` is required")),
        Some(_) => return Err(bad("input", "`input` must be a string or a list of items")),
    };
    for (i, item) in items.iter().enumerate() {
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        let field = |k: &str| -> ApiResult<String> {
            item.get(k)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| bad("input", format!("input[{i}] ({kind}): `{k}` must be a string")))
        };
        match kind {
            "message" => {
                let role = field("role")?;
                if !["user", "system", "developer", "assistant"].contains(&role.as_str()) {
                    return Err(bad("input", format!("input[{i}]: unknown role {role:?}")));
                }
                let content = content_text(i, item.get("content").unwrap_or(&Value::Null))?;
                out.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call = json!({"id": field("call_id")?, "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls of one turn gather on one assistant message, as chat clients send them.
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
                            calls.push(call);
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => {
                        return Err(bad("input", format!("input[{i}] (function_call_output): `output` is required")))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": field("call_id")?, "content": output}));
            }
            // The template drops earlier reasoning from the prompt anyway.
            "reasoning" => {}
            "item_reference" => {
                return Err(bad(
                    "input",
                    format!("input[{i}]: item references need stored responses; flint stores none"),
                ))
            }
            other => return Err(bad("input", format!("input[{i}]: item type {other:?} is not supported"))),
        }
    }
    Ok(out)
}

/// Function tools, flat as the Responses API defines them, in chat's nested shape.
fn tools(v: &Value) -> ApiResult<Option<Value>> {
    let Some(list) = v.get("tools").filter(|t| !t.is_null()) else { return Ok(None) };
    let list = list.as_array().ok_or_else(|| bad("tools", "`tools` must be a list"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut f = Map::new();
                for k in ["name", "description", "parameters", "strict"] {
                    if let Some(x) = t.get(k).filter(|x| !x.is_null()) {
                        f.insert(k.into(), x.clone());
                    }
                }
                out.push(json!({"type": "function", "function": f}));
            }
            other => {
                return Err(bad(
                    "tools",
                    format!("tools[{i}]: type {:?} is not supported (function only)", other.unwrap_or("?")),
                ))
            }
        }
    }
    Ok(Some(Value::Array(out)))
}

fn tool_choice(v: &Value) -> ApiResult<Option<Value>> {
    match v.get("tool_choice") {
        None | Some(Value::Null) => Ok(None),
        Some(s @ Value::String(_)) => Ok(Some(s.clone())),
        Some(o @ Value::Object(_)) => {
            match (o.get("type").and_then(Value::as_str), o.get("name").and_then(Value::as_str)) {
                (Some("function"), Some(name)) => Ok(Some(json!({"type": "function", "function": {"name": name}}))),
                _ => Err(bad(
                    "tool_choice",
                    format!("`tool_choice` {o} must be a mode or {{\"type\": \"function\", \"name\": …}}"),
                )),
            }
        }
        Some(other) => Err(bad("tool_choice", format!("`tool_choice` {other} is not valid"))),
    }
}

/// `text.format` as chat's `response_format`.
fn response_format(v: &Value) -> ApiResult<Option<Value>> {
    let Some(f) = v.pointer("/text/format").filter(|f| !f.is_null()) else { return Ok(None) };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut js = Map::new();
            for k in ["name", "schema", "strict", "description"] {
                if let Some(x) = f.get(k) {
                    js.insert(k.into(), x.clone());
                }
            }
            if !js.contains_key("schema") {
                return Err(bad("text", "`text.format.schema` is required for json_schema"));
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        other => Err(bad("text", format!("`text.format.type` {:?} is not supported", other.unwrap_or("?")))),
    }
}

/// The chat request a Responses request stands for; refuses what a stateless server cannot do.
pub fn to_chat(v: &Value) -> ApiResult<ChatRequest> {
    if v.get("previous_response_id").is_some_and(|p| !p.is_null()) {
        return Err(bad(
            "previous_response_id",
            "flint stores no responses (store: false); send the whole conversation as `input` instead",
        ));
    }
    if v.get("conversation").is_some_and(|p| !p.is_null()) {
        return Err(bad("conversation", "flint stores no conversations; send the whole conversation as `input`"));
    }
    if v.get("store") == Some(&Value::Bool(true)) {
        return Err(bad("store", "flint does not store responses; send `store: false` (or leave it out)"));
    }
    if v.get("background") == Some(&Value::Bool(true)) {
        return Err(bad("background", "background responses need storage; flint answers in the foreground"));
    }
    if let Some(t) = v.get("truncation").and_then(Value::as_str).filter(|t| *t != "disabled") {
        return Err(bad("truncation", format!("`truncation` {t:?} is not supported; a prompt too long is a 400")));
    }
    let mut chat = json!({"messages": messages(v)?});
    for (from, to) in [
        ("model", "model"),
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("seed", "seed"),
        ("top_logprobs", "top_logprobs"),
    ] {
        if let Some(x) = v.get(from).filter(|x| !x.is_null()) {
            chat[to] = x.clone();
        }
    }
    if chat.get("top_logprobs").is_some() {
        chat["logprobs"] = json!(true);
    }
    if let Some(t) = tools(v)? {
        chat["tools"] = t;
    }
    if let Some(t) = tool_choice(v)? {
        chat["tool_choice"] = t;
    }
    if let Some(f) = response_format(v)? {
        chat["response_format"] = f;
    }
    let bytes = serde_json::to_vec(&chat).map_err(|e| ApiError::internal(e.to_string()))?;
    parse_request(&bytes).map_err(rename)
}

/// Chat's names of the fields the Responses API names otherwise.
const RENAMED: [(&str, &str); 4] = [
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text"),
];

/// A chat field's error, named as the Responses API names the field: in `param` and wherever
/// the message quotes a chat field (`max_tokens` reads `max_output_tokens`).
pub fn rename(mut e: ApiError) -> ApiError {
    if let Some(p) = e.param.as_deref() {
        if let Some((_, to)) = RENAMED.iter().find(|(from, _)| *from == p) {
            e.param = Some(to.to_string());
        }
    }
    for (from, to) in RENAMED {
        let to = if to == "text" { "text.format" } else { to };
        e.message = e.message.replace(&format!("`{from}`"), &format!("`{to}`"));
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> ApiResult<ChatRequest> {
        to_chat(&v)
    }

    #[test]
    fn input_items_become_messages() {
        let v = json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "22C"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 22C."}]}
            ]
        });
        let m = messages(&v).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1]["content"], "Weather?");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2, "one turn's calls on one message");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "c1", "content": "22C"}));
        assert_eq!(m[4]["content"], "It is 22C.");
        assert_eq!(messages(&json!({"input": "Hi"})).unwrap(), vec![json!({"role": "user", "content": "Hi"})]);
    }

    #[test]
    fn fields_map_to_chat_and_refusals_name_theirs() {
        let c = chat(json!({"input": "Hi", "max_output_tokens": 7, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "f"}}))
        .unwrap();
        assert_eq!(c.common.max_tokens, Some(7));
        assert_eq!(c.common.response_format.as_ref().unwrap()["json_schema"]["schema"], json!({"type": "object"}));
        assert_eq!(c.tools.as_ref().unwrap()[0]["function"]["strict"], true);
        assert_eq!(c.tool_choice.as_ref().unwrap()["function"]["name"], "f");
        let param = |v: Value| chat(v).err().and_then(|e| e.param);
        assert_eq!(
            param(json!({"input": "Hi", "previous_response_id": "resp_1"})).as_deref(),
            Some("previous_response_id")
        );
        assert_eq!(param(json!({"input": "Hi", "store": true})).as_deref(), Some("store"));
        assert_eq!(param(json!({"input": "Hi", "tools": [{"type": "web_search"}]})).as_deref(), Some("tools"));
        assert_eq!(param(json!({"input": [{"type": "item_reference", "id": "x"}]})).as_deref(), Some("input"));
        assert_eq!(
            param(json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})).as_deref(),
            Some("input")
        );
        assert_eq!(param(json!({})).as_deref(), Some("input"));
        assert_eq!(param(json!({"input": "Hi", "max_output_tokens": "x"})).as_deref(), Some("max_output_tokens"));
        assert!(chat(json!({"input": "Hi", "store": false})).is_ok());
    }

    #[test]
    fn renamed_errors_quote_the_responses_names() {
        let e = rename(ApiError::invalid("max_tokens", "`max_tokens` must be at least 1, got 0"));
        assert_eq!(e.param.as_deref(), Some("max_output_tokens"));
        assert_eq!(e.message, "`max_output_tokens` must be at least 1, got 0");
        let e = rename(ApiError::invalid("response_format", "`response_format.type` must be …"));
        assert_eq!((e.param.as_deref(), e.message.contains("max_tokens")), (Some("text"), false));
        let e = rename(ApiError::invalid("messages", "`messages` has 9000 messages; at most 8192 are allowed"));
        assert_eq!(e.message, "`input` has 9000 messages; at most 8192 are allowed");
    }
}
