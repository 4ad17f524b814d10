//! What one request may ask for, checked before any of it is paid for. Each limit guards a cost
//! the request would otherwise impose on everyone: stop strings are matched against every
//! sequence's new text on the engine thread, `logit_bias` entries are applied to every sampled
//! row, tool definitions are rendered into the prompt by the chat template. The numbers leave
//! room for any real client (OpenAI itself allows 4 stop strings and 128 tools).

use serde_json::Value;

use crate::error::{ApiError, ApiResult};

/// Stop strings per request.
pub const MAX_STOP_STRINGS: usize = 64;
/// Bytes per stop string.
pub const MAX_STOP_BYTES: usize = 1024;
/// `logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Tool definitions per request (OpenAI's own limit).
pub const MAX_TOOLS: usize = 128;
/// All tool definitions of a request, as compact JSON.
pub const MAX_TOOLS_BYTES: usize = 1 << 20;

pub fn check_stop(stops: &[String]) -> ApiResult<()> {
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!("`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed", stops.len()),
        ));
    }
    if let Some((i, s)) = stops.iter().enumerate().find(|(_, s)| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!("`stop[{i}]` is {} bytes long; at most {MAX_STOP_BYTES} are allowed", s.len()),
        ));
    }
    Ok(())
}

pub fn check_logit_bias(entries: usize) -> ApiResult<()> {
    if entries > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("`logit_bias` has {entries} entries; at most {MAX_LOGIT_BIAS} are allowed"),
        ));
    }
    Ok(())
}

/// OpenAI's rule for function names: 1 to 64 of a-z, A-Z, 0-9, `_` and `-`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Tool definitions as OpenAI defines them:
/// `{"type": "function", "function": {"name", "description"?, "parameters"?: object, "strict"?}}`.
pub fn check_tools(tools: &[Value]) -> ApiResult<()> {
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            "tools",
            format!("`tools` has {} definitions; at most {MAX_TOOLS} are allowed", tools.len()),
        ));
    }
    let mut bytes = 0usize;
    for (i, t) in tools.iter().enumerate() {
        let bad = |what: &str| ApiError::invalid("tools", format!("`tools[{i}]`: {what}"));
        let Some(obj) = t.as_object() else { return Err(bad("must be an object")) };
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => return Err(bad(&format!("type {other:?} is not supported; use \"function\""))),
            None => return Err(bad("`type` must be \"function\"")),
        }
        let Some(f) = obj.get("function").and_then(Value::as_object) else {
            return Err(bad("`function` must be an object"));
        };
        match f.get("name").and_then(Value::as_str) {
            Some(n) if valid_name(n) => {}
            Some(n) => return Err(bad(&format!("function name {n:?} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'"))),
            None => return Err(bad("`function.name` must be a string")),
        }
        if f.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
            return Err(bad("`function.description` must be a string"));
        }
        if f.get("parameters").is_some_and(|p| !p.is_object() && !p.is_null()) {
            return Err(bad("`function.parameters` must be a JSON Schema object"));
        }
        if f.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
            return Err(bad("`function.strict` must be a boolean"));
        }
        bytes = bytes.saturating_add(serde_json::to_vec(t).map_or(usize::MAX, |v| v.len()));
        if bytes > MAX_TOOLS_BYTES {
            return Err(ApiError::invalid(
                "tools",
                format!("`tools` exceed {MAX_TOOLS_BYTES} bytes of JSON; send fewer or smaller definitions"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool(f: Value) -> Value {
        json!({"type": "function", "function": f})
    }

    #[test]
    fn tool_definitions_are_checked() {
        let ok = tool(json!({"name": "get_weather", "description": "d", "parameters": {"type": "object"}}));
        assert!(check_tools(&[ok.clone(), tool(json!({"name": "f-2"}))]).is_ok());
        for bad in [
            json!(1),
            json!({"type": "banana", "function": {"name": "f"}}),
            json!({"function": {"name": "f"}}),
            json!({"type": "function"}),
            tool(json!({"name": "f", "parameters": "nope"})),
            tool(json!({"name": ""})),
            tool(json!({"name": "has space"})),
            tool(json!({"name": "x".repeat(65)})),
            tool(json!({"name": 3})),
            tool(json!({"name": "f", "description": 3})),
            tool(json!({"name": "f", "strict": "yes"})),
        ] {
            let e = check_tools(&[ok.clone(), bad.clone()]).expect_err(&bad.to_string());
            assert_eq!(e.param.as_deref(), Some("tools"));
            assert!(e.message.contains("tools[1]"), "{}", e.message);
        }
        let many: Vec<Value> = (0..=MAX_TOOLS).map(|i| tool(json!({"name": format!("f{i}")}))).collect();
        assert!(check_tools(&many).is_err());
        let big = tool(json!({"name": "f", "description": "x".repeat(MAX_TOOLS_BYTES)}));
        assert!(check_tools(&[big]).unwrap_err().message.contains("bytes"));
    }

    #[test]
    fn stop_and_logit_bias_are_bounded() {
        assert!(check_stop(&vec!["x".to_string(); MAX_STOP_STRINGS]).is_ok());
        assert!(check_stop(&vec!["x".to_string(); MAX_STOP_STRINGS + 1]).is_err());
        assert!(check_stop(&["y".repeat(MAX_STOP_BYTES)]).is_ok());
        assert!(check_stop(&["ok".into(), "y".repeat(MAX_STOP_BYTES + 1)]).unwrap_err().message.contains("stop[1]"));
        assert!(check_logit_bias(MAX_LOGIT_BIAS).is_ok());
        assert_eq!(check_logit_bias(MAX_LOGIT_BIAS + 1).unwrap_err().param.as_deref(), Some("logit_bias"));
    }
}
