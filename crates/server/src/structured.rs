//! The request fields that constrain output, validated in one place: OpenAI's `response_format`,
//! vLLM's `structured_outputs`, and the legacy `guided_*` fields (which vLLM now ignores with a
//! 200; flint honours them, and refuses what it cannot honour). At most one may be set. The
//! chosen constraint is compiled off the async workers, with a deadline, into the grammar the
//! engine walks.

use std::time::Duration;

use flint_engine::structured::{Constraint, GrammarError, StructuredOutput};
use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};
use crate::protocol::Common;
use crate::state::ServingModel;

/// Longest a constraint may take to compile, by default, before the request gets a 400.
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest schema, regex or grammar, as JSON text.
pub const MAX_CONSTRAINT_BYTES: usize = 256 << 10;
/// Most choices in a `choice` constraint.
pub const MAX_CHOICES: usize = 4096;

/// A constraint and the field it came from (named in every error about it).
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub param: &'static str,
    pub constraint: Constraint,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg)
}

fn string(param: &str, v: &Value) -> ApiResult<String> {
    v.as_str().map(str::to_string).ok_or_else(|| bad(param, format!("`{param}` must be a string")))
}

fn schema(param: &str, v: &Value) -> ApiResult<Value> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        // vLLM accepts a schema serialized as a string.
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(param, format!("`{param}` is a string that is not a JSON schema: {e}"))),
        _ => Err(bad(param, format!("`{param}` must be a JSON schema (an object)"))),
    }
}

fn choices(param: &str, v: &Value) -> ApiResult<Vec<String>> {
    let list = v.as_array().ok_or_else(|| bad(param, format!("`{param}` must be a list of strings")))?;
    if list.is_empty() || list.len() > MAX_CHOICES {
        return Err(bad(param, format!("`{param}` must hold 1 to {MAX_CHOICES} strings, got {}", list.len())));
    }
    list.iter().map(|c| string(param, c)).collect()
}

/// A grammar as llguidance reads it: Lark. GBNF (llama.cpp's `root ::= …`) is told apart so the
/// error can say what to do.
fn grammar(param: &str, v: &Value) -> ApiResult<Constraint> {
    let g = string(param, v)?;
    if g.contains("::=") {
        return Err(bad(
            param,
            format!("`{param}` looks like GBNF (`::=`); flint takes Lark grammars (llguidance's dialect): write `start: …` rules"),
        ));
    }
    Ok(Constraint::Lark(g))
}

/// `response_format`: `text`, `json_object` or `json_schema`.
fn response_format(v: &Value) -> ApiResult<Option<Constraint>> {
    const P: &str = "response_format";
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| bad(P, "`response_format.type` is required"))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Constraint::JsonObject)),
        "json_schema" => {
            let js = v
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(P, "`response_format.json_schema` must be an object with `name` and `schema`"))?;
            if let Some(n) = js.get("name") {
                n.as_str().ok_or_else(|| bad(P, "`response_format.json_schema.name` must be a string"))?;
            }
            // OpenAI's `strict` asks for exactly what flint always does: output valid under the schema.
            let s = js.get("schema").map_or(Ok(Value::Object(Map::new())), |s| schema(P, s))?;
            Ok(Some(Constraint::JsonSchema(s)))
        }
        other => Err(bad(P, format!("`response_format.type` must be text, json_object or json_schema, got {other:?}"))),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`
/// (also what `flint bench throughput --structured-output` takes).
pub fn structured_outputs(v: &Value) -> ApiResult<Option<Constraint>> {
    const P: &str = "structured_outputs";
    let o = v.as_object().ok_or_else(|| bad(P, "`structured_outputs` must be an object"))?;
    let mut found = Vec::new();
    for (k, val) in o {
        if val.is_null() {
            continue;
        }
        let c = match k.as_str() {
            "json" => Constraint::JsonSchema(schema(P, val)?),
            "regex" => Constraint::Regex(string(P, val)?),
            "choice" => Constraint::Choice(choices(P, val)?),
            "grammar" => grammar(P, val)?,
            "json_object" if val == &Value::Bool(true) => Constraint::JsonObject,
            "json_object" => continue,
            // Options that only tune a backend: flint's output is the same with or without them.
            "disable_fallback" | "disable_additional_properties" | "backend" => continue,
            other => {
                return Err(bad(
                    P,
                    format!(
                    "`structured_outputs.{other}` is not supported; use json, regex, choice, grammar or json_object"
                ),
                ))
            }
        };
        found.push(c);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(bad(P, "`structured_outputs` must set exactly one of json, regex, choice, grammar, json_object")),
    }
}

/// The constraint a request asks for, if any; 400 for a malformed one or for two at once.
pub fn requested(c: &Common) -> ApiResult<Option<Requested>> {
    let mut found: Vec<Requested> = Vec::new();
    let mut add = |param: &'static str, c: Option<Constraint>| {
        if let Some(constraint) = c {
            found.push(Requested { param, constraint });
        }
    };
    if let Some(v) = &c.response_format {
        add("response_format", response_format(v)?);
    }
    if let Some(v) = &c.structured_outputs {
        add("structured_outputs", structured_outputs(v)?);
    }
    if let Some(v) = &c.guided_json {
        add("guided_json", Some(Constraint::JsonSchema(schema("guided_json", v)?)));
    }
    if let Some(v) = &c.guided_regex {
        add("guided_regex", Some(Constraint::Regex(string("guided_regex", v)?)));
    }
    if let Some(v) = &c.guided_choice {
        add("guided_choice", Some(Constraint::Choice(choices("guided_choice", v)?)));
    }
    if let Some(v) = &c.guided_grammar {
        add("guided_grammar", Some(grammar("guided_grammar", v)?));
    }
    if let Some(Value::String(w)) = &c.guided_whitespace_pattern {
        return Err(bad("guided_whitespace_pattern", format!("`guided_whitespace_pattern` ({w:?}) is not supported: flint writes JSON with Python's separators and no other whitespace")));
    }
    if let Some(b) = &c.guided_decoding_backend {
        let ok = b.as_str().is_some_and(|b| ["auto", "guidance", "llguidance"].contains(&b));
        if !ok {
            return Err(bad(
                "guided_decoding_backend",
                format!("`guided_decoding_backend` {b} is not available: flint uses llguidance (\"auto\")"),
            ));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|r| r.param).collect();
        return Err(bad(names[1], format!("only one output constraint may be set; got {}", names.join(" and "))));
    }
    let r = found.pop();
    if let Some(r) = &r {
        check_size(r)?;
    }
    Ok(r)
}

fn check_size(r: &Requested) -> ApiResult<()> {
    let bytes = match &r.constraint {
        Constraint::JsonSchema(v) => v.to_string().len(),
        Constraint::Regex(s) | Constraint::Lark(s) => s.len(),
        Constraint::Choice(c) => c.iter().map(String::len).sum(),
        Constraint::JsonObject => 0,
        Constraint::ToolCalls { tools, .. } => tools.iter().map(|t| t.parameters.to_string().len()).sum(),
    };
    if bytes > MAX_CONSTRAINT_BYTES {
        return Err(bad(
            r.param,
            format!("`{}` is {bytes} bytes; at most {MAX_CONSTRAINT_BYTES} are allowed", r.param),
        ));
    }
    Ok(())
}

/// Compile `r` for `model` on the compile threads, within `timeout` (waiting in their queue
/// included); `after` is where the constraint starts (the reasoning's end marker, with a
/// reasoning parser). If the request times out or its client leaves, this future is dropped and
/// a compile not yet started is withdrawn.
pub async fn compile(
    model: &ServingModel,
    r: Requested,
    after: Option<String>,
    timeout: Duration,
) -> ApiResult<StructuredOutput> {
    let param = r.param;
    let ticket = model.router.grammars().submit(r.constraint);
    let grammar = match tokio::time::timeout(timeout, ticket.wait()).await {
        Err(_) => {
            return Err(bad(
                param,
                format!(
                    "`{param}` did not compile within {} s (the server compiles a few constraints at a time); \
                     simplify it or retry",
                    timeout.as_secs_f64()
                ),
            ))
        }
        Ok(Err(GrammarError::Invalid(m))) => return Err(bad(param, format!("`{param}` is invalid: {m}"))),
        Ok(Err(e @ GrammarError::Unavailable(_))) => return Err(bad(param, e.to_string())),
        Ok(Ok(g)) => g,
    };
    Ok(StructuredOutput { grammar, after })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn common(v: Value) -> Common {
        serde_json::from_value(v).unwrap()
    }

    fn param_of(v: Value) -> Option<String> {
        requested(&common(v)).err().and_then(|e| e.param)
    }

    #[test]
    fn every_field_maps_to_its_constraint() {
        let r = |v: Value| requested(&common(v)).unwrap().map(|r| (r.param, r.constraint));
        assert_eq!(r(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            r(json!({"response_format": {"type": "json_object"}})),
            Some(("response_format", Constraint::JsonObject))
        );
        let s = json!({"type": "object"});
        assert_eq!(
            r(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": true}}})
            ),
            Some(("response_format", Constraint::JsonSchema(s.clone())))
        );
        assert_eq!(r(json!({"guided_json": s.to_string()})), Some(("guided_json", Constraint::JsonSchema(s.clone()))));
        assert_eq!(
            r(json!({"structured_outputs": {"regex": "a+"}})),
            Some(("structured_outputs", Constraint::Regex("a+".into())))
        );
        assert_eq!(
            r(json!({"guided_choice": ["a", "b"]})),
            Some(("guided_choice", Constraint::Choice(vec!["a".into(), "b".into()])))
        );
        assert_eq!(
            r(json!({"guided_grammar": "start: \"x\""})),
            Some(("guided_grammar", Constraint::Lark("start: \"x\"".into())))
        );
        assert_eq!(
            r(json!({"structured_outputs": {"json_object": true}})),
            Some(("structured_outputs", Constraint::JsonObject))
        );
    }

    #[test]
    fn bad_or_conflicting_constraints_name_their_field() {
        assert_eq!(param_of(json!({"response_format": {"type": "xml"}})).as_deref(), Some("response_format"));
        assert_eq!(param_of(json!({"response_format": {"type": "json_schema"}})).as_deref(), Some("response_format"));
        assert_eq!(
            param_of(json!({"structured_outputs": {"structural_tag": "x"}})).as_deref(),
            Some("structured_outputs")
        );
        assert_eq!(
            param_of(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})).as_deref(),
            Some("structured_outputs")
        );
        assert_eq!(param_of(json!({"guided_choice": []})).as_deref(), Some("guided_choice"));
        assert_eq!(param_of(json!({"guided_grammar": "root ::= \"a\""})).as_deref(), Some("guided_grammar"));
        assert_eq!(
            param_of(json!({"guided_decoding_backend": "xgrammar"})).as_deref(),
            Some("guided_decoding_backend")
        );
        assert_eq!(param_of(json!({"guided_whitespace_pattern": " *"})).as_deref(), Some("guided_whitespace_pattern"));
        assert_eq!(
            param_of(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"})).as_deref(),
            Some("guided_regex")
        );
        let huge = "a".repeat(MAX_CONSTRAINT_BYTES + 1);
        assert_eq!(param_of(json!({"guided_regex": huge})).as_deref(), Some("guided_regex"));
    }
}
