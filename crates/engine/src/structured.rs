//! Structured outputs: a sample constrained to a JSON schema, any JSON object, a regex, one of a
//! list of strings, a Lark grammar, or well-formed tool calls. A request's constraint is compiled
//! once (per distinct constraint, cached) into an llguidance grammar before it is queued; each
//! sample then walks its own copy ([`GrammarState`]), which computes the allowed-token mask the
//! sampler applies before anything else, and advances on every token drawn.

mod bounds;
mod compile_queue;
mod compiler;
mod histogram;
mod marker;
mod schema;
mod state;
mod tok_env;

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

pub use bounds::MAX_LEVELS;
pub use compile_queue::{CompileStats, CompileTicket};
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

/// A client's schema as it is compiled: closed objects (see [`schema::close_objects`]) and
/// flint's layout unless it sets its own.
fn with_layout(schema: &Value) -> Value {
    let mut s = schema.clone();
    schema::close_objects(&mut s);
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
            // One terminal, so the alternatives are the lexer's (a DFA over the choices), not
            // Earley items: a rule of 3,000 alternatives passed the compile and then failed at
            // the first token, past llguidance's 2,000 items per row.
            Constraint::Choice(choices) => {
                let alts: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
                TopLevelGrammar::from_lark(format!("start: CHOICE\nCHOICE: {}", alts.join(" | ")))
            }
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Constraint::ToolCalls { tools, parallel, optional } => {
                TopLevelGrammar::from_lark(tool_calls_lark(tools, *parallel, *optional))
            }
        }
    }

    /// An upper bound on how deep compiling this constraint recurses (see [`bounds`]).
    pub(crate) fn levels(&self) -> usize {
        match self {
            Constraint::JsonSchema(v) => bounds::schema_levels(v),
            Constraint::Lark(g) => bounds::lark_levels(g),
            // The wrapper around the tools' schemas adds a handful of levels.
            Constraint::ToolCalls { tools, .. } => {
                tools.iter().fold(8usize, |n, t| n.saturating_add(bounds::schema_levels(&t.parameters)))
            }
            // Regexes are parsed with a nesting limit of their own; the rest are flat.
            Constraint::JsonObject | Constraint::Regex(_) | Constraint::Choice(_) => 0,
        }
    }

    /// The longest run of optional properties in any object of the constraint's schemas.
    pub(crate) fn optional_run(&self) -> usize {
        match self {
            Constraint::JsonSchema(v) => schema::longest_optional_run(v),
            Constraint::ToolCalls { tools, .. } => {
                tools.iter().map(|t| schema::longest_optional_run(&t.parameters)).max().unwrap_or(0)
            }
            _ => 0,
        }
    }

    /// What the client sent, for messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) | Constraint::JsonObject => "JSON schema",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice list",
            Constraint::Lark(_) => "grammar",
            Constraint::ToolCalls { .. } => "tools' parameter schemas",
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

/// The schema of one call to any of `tools`. Each tool's parameter schema goes under
/// `$defs/tool_<i>` with its local `$ref`s rebased there (Pydantic's nested models are
/// `#/$defs/Inner` references, which would otherwise point into the wrapper, where nothing is),
/// and the call's `arguments` refer to it.
fn tool_call_schema(tools: &[ToolSchema]) -> Value {
    let mut defs = Map::new();
    let variants: Vec<Value> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut parameters = t.parameters.clone();
            schema::close_objects(&mut parameters);
            schema::rebase_refs(&mut parameters, &format!("/$defs/tool_{i}"));
            defs.insert(format!("tool_{i}"), parameters);
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": {"$ref": format!("#/$defs/tool_{i}")}},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    json!({"x-guidance": layout(), "$defs": defs, "anyOf": variants})
}

/// Tool calls as the Qwen2.5 template writes them: `<tool_call>` and `</tool_call>` are single
/// tokens, the call's JSON has `name` first and `arguments` second, calls are one per line.
/// Optional calls may follow free text, which cannot contain `<tool_call>` (a special token is
/// never text), so the grammar knows a call has started the moment that token is drawn.
fn tool_calls_lark(tools: &[ToolSchema], parallel: bool, optional: bool) -> String {
    let schema = tool_call_schema(tools);
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
