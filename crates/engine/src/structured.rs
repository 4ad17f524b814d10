//! Structured outputs: a sample constrained to a JSON schema, any JSON object, a regex, one of a
//! list of strings, a Lark grammar, or well-formed tool calls. A request's constraint is compiled
//! once (per distinct constraint, cached) into an llguidance grammar before it is queued; each
//! sample then walks its own copy ([`GrammarState`]), which computes the allowed-token mask the
//! sampler applies before anything else, and advances on every token drawn.

mod compiler;
mod histogram;
mod marker;
mod state;
mod tok_env;

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

pub use compiler::{CompiledGrammar, GrammarCompiler, GrammarError};
pub use histogram::{MaskHistogram, MASK_BUCKETS};
pub use marker::MarkerWatch;
pub use state::GrammarState;

/// A request's compiled constraint, and where in the output it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredOutput {
    pub grammar: CompiledGrammar,
    /// Constrain only the text after this marker (the reasoning's end, `</think>`); everything up
    /// to and including it is free.
    pub after: Option<String>,
}

/// What a sample's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// One JSON value valid under this JSON Schema.
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// The whole output matches this regex (Rust `regex` syntax, implicitly anchored).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (which also embeds `%json {…}` schemas).
    Lark(String),
    /// One or more Qwen/Hermes tool calls, `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`,
    /// each naming one of `tools` with arguments valid under its parameter schema. With
    /// `optional`, free text may come first and the calls may not come at all (`tool_choice:
    /// "auto"` with strict tools: only a call, once it starts, is constrained).
    ToolCalls { tools: Vec<ToolSchema>, parallel: bool, optional: bool },
}

/// A callable function: its name and the JSON Schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSchema {
    pub name: String,
    pub parameters: Value,
}

/// How the JSON of a schema is laid out: Python's `json.dumps` separators and no other
/// whitespace. Free whitespace lets a model pad forever (a known failure of constrained JSON with
/// weak models); a schema's own `x-guidance` settings replace these.
fn layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

fn with_layout(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(m) = &mut s {
        m.entry("x-guidance").or_insert_with(layout);
    }
    s
}

/// A Lark string literal (llguidance reads them as JSON strings).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

impl Constraint {
    /// The llguidance grammar this constraint compiles from.
    pub(crate) fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema)),
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(with_layout(&json!({"type": "object"}))),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Choice(choices) => {
                let alts: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Constraint::ToolCalls { tools, parallel, optional } => {
                TopLevelGrammar::from_lark(tool_calls_lark(tools, *parallel, *optional))
            }
        }
    }

    /// The cache key: equal keys compile to the same grammar.
    pub(crate) fn key(&self) -> String {
        match self {
            Constraint::JsonSchema(v) => format!("json:{v}"),
            Constraint::JsonObject => "json_object".into(),
            Constraint::Regex(r) => format!("regex:{r}"),
            Constraint::Choice(c) => format!("choice:{}", Value::from(c.clone())),
            Constraint::Lark(g) => format!("lark:{g}"),
            Constraint::ToolCalls { tools, parallel, optional } => {
                let t: Vec<Value> = tools.iter().map(|t| json!([t.name, t.parameters])).collect();
                format!("tools:{parallel}:{optional}:{}", Value::from(t))
            }
        }
    }
}

/// Tool calls as the Qwen2.5 template writes them: `<tool_call>` and `</tool_call>` are single
/// tokens, the call's JSON has `name` first and `arguments` second, calls are one per line.
/// Optional calls may follow free text, which cannot contain `<tool_call>` (a special token is
/// never text), so the grammar knows a call has started the moment that token is drawn.
fn tool_calls_lark(tools: &[ToolSchema], parallel: bool, optional: bool) -> String {
    let variants: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = json!({"x-guidance": layout(), "anyOf": variants});
    let calls = if parallel { "call (\"\\n\" call)*" } else { "call" };
    let start =
        if optional { format!("start: TEXT | TEXT? {calls}\nTEXT: /(?s:.+)/") } else { format!("start: {calls}") };
    format!("{start}\ncall: <tool_call> \"\\n\" %json {schema} \"\\n\" </tool_call>\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tell_constraints_apart() {
        let a = Constraint::Choice(vec!["a,b".into()]);
        let b = Constraint::Choice(vec!["a".into(), "b".into()]);
        assert_ne!(a.key(), b.key());
        assert_ne!(Constraint::Regex("x".into()).key(), Constraint::Lark("x".into()).key());
        let s = json!({"type": "string"});
        assert_eq!(Constraint::JsonSchema(s.clone()).key(), Constraint::JsonSchema(s).key());
    }

    #[test]
    fn a_schema_keeps_its_own_layout() {
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_layout(&own)["x-guidance"]["whitespace_flexible"], true);
        assert_eq!(with_layout(&json!({"type": "object"}))["x-guidance"]["key_separator"], ": ");
    }
}
