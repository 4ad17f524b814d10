//! Rendering Hugging Face chat templates (Jinja2) with minijinja.
//!
//! The goal is byte-identical output to transformers' `apply_chat_template`, because the
//! model was trained on exactly those strings. transformers renders with a sandboxed
//! Jinja2 environment (`trim_blocks`, `lstrip_blocks`, loop controls), Python string
//! methods, its own `tojson` (plain `json.dumps`), `raise_exception` and `strftime_now`.
//! minijinja differs from Jinja2 in a few visible places, which this module patches:
//!
//! * `tojson`: minijinja's escapes HTML characters and uses its own spacing; replaced by a
//!   `json.dumps` clone (same separators, `ensure_ascii=False`, `indent`, `sort_keys`).
//! * Printing non-strings (`{{ none }}`, `{{ true }}`, lists, dicts) and the `string`
//!   filter: minijinja prints `none`/`true`/JSON-ish maps; replaced by Python's
//!   `str()`/`repr()` forms (`None`, `True`, `{'a': 1}`).
//! * Python string/dict/list methods come from `minijinja_contrib::pycompat`.
//! * `{% generation %}…{% endgeneration %}` (transformers' assistant-mask extension) is
//!   rewritten to an always-true `if` block, which is what it renders as.
//!
//! Known remaining differences: the `~` operator stringifies with minijinja's rules
//! (`none`, `true`), and `strftime_now` formats UTC rather than local time (there is no
//! time-zone database dependency).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectRepr, Value};
use minijinja::{Environment, Error, ErrorKind};

mod pycompat;

use pycompat::{py_str, py_str_checked, strftime_now, tojson};

/// Name of the main template inside the environment.
const DEFAULT_NAME: &str = "default";
/// Name of the optional tool-use template (HF's named-template form).
const TOOL_USE_NAME: &str = "tool_use";

/// Fuel (minijinja's unit of work: about one instruction, or 64 bytes of data made) every
/// render gets. Each message, each JSON value and each byte of text in the input adds to it
/// ([`FUEL_PER_MESSAGE`], [`FUEL_PER_VALUE`], one per byte), up to [`MAX_FUEL`]. It bounds both
/// the time and the memory one render can take, whatever the template or the messages: Qwen's
/// template spends about 150 per message and a tenth per byte of text (20,000 short turns take
/// under 3M); a template that loops over `range(100000)` twice runs out.
pub const BASE_FUEL: u64 = 1_000_000;
/// See [`BASE_FUEL`].
pub const FUEL_PER_MESSAGE: u64 = 400;
/// See [`BASE_FUEL`].
pub const FUEL_PER_VALUE: u64 = 16;
/// The most fuel any render gets (a second or two of work).
pub const MAX_FUEL: u64 = 16_000_000;
/// Stack given to the render thread per unit of fuel. A template can build a value nested as
/// deep as its fuel allows (about 9 fuel a level), and dropping that value recurses (about 100
/// bytes of stack a level); 32 bytes per fuel is three times that. Only touched pages cost memory.
const STACK_BYTES_PER_FUEL: u64 = 32;
/// The deepest nesting of arrays and objects accepted in messages, tools and extra variables
/// (serde_json's parser stops at 128); values the template prints are held to the same depth.
pub const MAX_VALUE_DEPTH: usize = 128;

/// Variables the renderer sets itself; extras may not override them, just as Python's
/// `render(messages=..., **kwargs)` would reject a duplicate keyword.
const RESERVED_VARIABLES: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// A tokenizer config / template file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File that failed.
        path: String,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// A tokenizer config was not valid JSON.
    #[error("cannot parse {path} as JSON: {source}")]
    Json {
        /// File that failed.
        path: String,
        /// Underlying parse error.
        source: serde_json::Error,
    },
    /// A field of the tokenizer config has an unexpected shape.
    #[error("invalid field \"{field}\" in {path}: {reason}")]
    InvalidField {
        /// File at fault.
        path: String,
        /// Field at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No chat template was found.
    #[error("{path} has no \"chat_template\" (and there is no chat_template.jinja next to it)")]
    MissingTemplate {
        /// The tokenizer config that was searched.
        path: String,
    },
    /// The template does not compile.
    #[error("chat template syntax error: {0}")]
    Syntax(#[source] Error),
    /// The template called `raise_exception(message)` (e.g. to reject a role order).
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    /// Rendering failed for another reason (bad attribute access, type error, ...).
    #[error("cannot render chat template: {0}")]
    Render(#[source] Error),
    /// An extra variable collides with one the renderer sets itself.
    #[error("extra template variable \"{0}\" is reserved (set it through the dedicated argument)")]
    ReservedVariable(String),
    /// Rendering needed more work or memory than its budget (see [`BASE_FUEL`]), or the input
    /// nests deeper than [`MAX_VALUE_DEPTH`].
    #[error("chat template rendering exceeded its budget: {0}")]
    Budget(String),
}

/// Marker attached to the minijinja error produced by `raise_exception`, so that `render`
/// can tell a deliberate template error from a genuine failure.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// A compiled chat template, ready to render many conversations. `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("has_tool_use", &self.has_tool_use)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` become template variables (when given)
    /// as transformers passes its special-tokens map.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, ChatTemplateError> {
        Self::with_templates(source, None, bos_token, eos_token)
    }

    fn with_templates(
        default: &str,
        tool_use: Option<&str>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = new_environment()?;
        env.add_template_owned(DEFAULT_NAME, rewrite_generation_tags(default)).map_err(ChatTemplateError::Syntax)?;
        if let Some(tool_use) = tool_use {
            env.add_template_owned(TOOL_USE_NAME, rewrite_generation_tags(tool_use))
                .map_err(ChatTemplateError::Syntax)?;
        }
        Ok(Self { env, has_tool_use: tool_use.is_some(), bos_token, eos_token, source: default.to_string() })
    }

    /// The (default) template's source, as the checkpoint gives it (`/tokenizer_info` hands it
    /// to clients that render prompts themselves).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Loads the template from a Hugging Face `tokenizer_config.json`: `chat_template` as
    /// a string, or the list-of-`{name, template}` form (using `default`, and `tool_use`
    /// when tools are given, as transformers does). A `chat_template.jinja` file next to
    /// the config takes precedence, matching newer transformers. `bos_token`/`eos_token`
    /// may be strings or `{"content": ...}` objects.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, ChatTemplateError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|source| ChatTemplateError::Io { path: name.clone(), source })?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| ChatTemplateError::Json { path: name.clone(), source })?;
        let invalid =
            |field: &'static str, reason: String| ChatTemplateError::InvalidField { path: name.clone(), field, reason };
        let bos_token = special_token(&config, "bos_token").map_err(|r| invalid("bos_token", r))?;
        let eos_token = special_token(&config, "eos_token").map_err(|r| invalid("eos_token", r))?;

        let jinja_path = path.with_file_name("chat_template.jinja");
        if jinja_path.is_file() {
            let source = std::fs::read_to_string(&jinja_path)
                .map_err(|source| ChatTemplateError::Io { path: jinja_path.display().to_string(), source })?;
            return Self::new(&source, bos_token, eos_token);
        }

        match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => Err(ChatTemplateError::MissingTemplate { path: name }),
            Some(serde_json::Value::String(source)) => Self::new(source, bos_token, eos_token),
            Some(serde_json::Value::Array(list)) => {
                let mut named = BTreeMap::new();
                for entry in list {
                    let entry_name = entry.get("name").and_then(|v| v.as_str());
                    let template = entry.get("template").and_then(|v| v.as_str());
                    match (entry_name, template) {
                        (Some(n), Some(t)) => {
                            named.insert(n, t);
                        }
                        _ => {
                            return Err(invalid(
                                "chat_template",
                                "list entries must be {\"name\": string, \"template\": string}".into(),
                            ))
                        }
                    }
                }
                let default = named
                    .get(DEFAULT_NAME)
                    .ok_or_else(|| invalid("chat_template", "no template named \"default\"".into()))?;
                Self::with_templates(default, named.get(TOOL_USE_NAME).copied(), bos_token, eos_token)
            }
            Some(other) => Err(invalid("chat_template", format!("expected a string or a list, found {other}"))),
        }
    }

    /// The BOS token string given to the template, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string given to the template, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders a conversation. `messages` are OpenAI-style message objects, `tools` the
    /// tool list (passed as `none` when absent, as transformers does, so `tools is not
    /// none` checks work), `extra` any further variables such as `enable_thinking`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let mut conv = Converter::default();
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        // transformers passes `documents=None` explicitly.
        ctx.insert("documents".into(), Value::from(()));
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        for (key, value) in extra {
            if RESERVED_VARIABLES.contains(&key.as_str()) {
                return Err(ChatTemplateError::ReservedVariable(key.clone()));
            }
            ctx.insert(key.clone(), conv.value(value, 0)?);
        }
        let message_values = messages.iter().map(|m| conv.value(m, 1)).collect::<Result<Vec<_>, _>>()?;
        ctx.insert("messages".into(), Value::from(message_values));
        let tools_value = match tools {
            Some(t) => conv.value(t, 0)?,
            None => Value::from(()),
        };
        ctx.insert("tools".into(), tools_value);
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));

        // The budget grows with the input, so long conversations render and nothing runs away.
        let fuel = BASE_FUEL
            .saturating_add(FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64))
            .saturating_add(conv.fuel)
            .min(MAX_FUEL);
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel));
        let name = if tools.is_some() && self.has_tool_use { TOOL_USE_NAME } else { DEFAULT_NAME };
        let template = env.get_template(name).map_err(ChatTemplateError::Render)?;
        let ctx = Value::from(ctx);
        // On a thread of its own, with a stack sized for the deepest value the fuel can build
        // (a tokio worker's 2 MiB would overflow, and a stack overflow aborts the process).
        let stack = usize::try_from(fuel.saturating_mul(STACK_BYTES_PER_FUEL)).unwrap_or(usize::MAX);
        std::thread::scope(|scope| {
            let worker = std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(stack)
                .spawn_scoped(scope, || template.render(ctx).map_err(classify_render_error))
                .map_err(|e| ChatTemplateError::Budget(format!("cannot start the render thread: {e}")))?;
            worker.join().unwrap_or_else(|_| Err(ChatTemplateError::Budget("the render thread panicked".into())))
        })
    }
}

/// A JSON object as a template value. Keeps the keys in document order (Python dicts
/// do, and `tojson` output must match), which minijinja's own map types only do with a
/// serde feature we do not otherwise need.
#[derive(Debug)]
struct JsonObject(Vec<(Value, Value)>);

impl Object for JsonObject {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        // Chat messages have a handful of keys; a linear scan beats hashing here.
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// Converts JSON (parsed with serde_json's `preserve_order`) into template values, adding up
/// the fuel its size earns (see [`BASE_FUEL`]) and refusing nesting deeper than
/// [`MAX_VALUE_DEPTH`].
#[derive(Default)]
struct Converter {
    fuel: u64,
}

impl Converter {
    fn value(&mut self, value: &serde_json::Value, depth: usize) -> Result<Value, ChatTemplateError> {
        if depth > MAX_VALUE_DEPTH {
            return Err(ChatTemplateError::Budget(format!(
                "messages, tools or variables nest deeper than {MAX_VALUE_DEPTH} levels"
            )));
        }
        self.fuel = self.fuel.saturating_add(FUEL_PER_VALUE);
        Ok(match value {
            serde_json::Value::Null => Value::from(()),
            serde_json::Value::Bool(b) => Value::from(*b),
            serde_json::Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Value::from(i)
                } else if let Some(u) = n.as_u64() {
                    Value::from(u)
                } else {
                    Value::from(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            serde_json::Value::String(s) => {
                self.fuel = self.fuel.saturating_add(s.len() as u64);
                Value::from(s.as_str())
            }
            serde_json::Value::Array(items) => {
                Value::from(items.iter().map(|v| self.value(v, depth + 1)).collect::<Result<Vec<_>, _>>()?)
            }
            serde_json::Value::Object(map) => {
                let mut entries = Vec::with_capacity(map.len());
                for (k, v) in map {
                    self.fuel = self.fuel.saturating_add(k.len() as u64);
                    entries.push((Value::from(k.as_str()), self.value(v, depth + 1)?));
                }
                Value::from_object(JsonObject(entries))
            }
        })
    }
}

/// Turns a minijinja error into `Raised` when it came from `raise_exception`, and into
/// `Budget` when the render ran out of fuel.
fn classify_render_error(err: Error) -> ChatTemplateError {
    if err.kind() == ErrorKind::OutOfFuel {
        return ChatTemplateError::Budget(
            "it needs more work or memory than the conversation justifies (a runaway loop in the template?)".into(),
        );
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return ChatTemplateError::Raised(raised.0.clone());
        }
        cur = e.source();
    }
    ChatTemplateError::Render(detached(&err))
}

/// The error without the template values minijinja attaches for debugging: one may be nested
/// deeper than the caller's stack can drop (the render thread's stack is sized for it, the
/// caller's is not). Kind, message and location are kept.
fn detached(err: &Error) -> Error {
    let mut detail = err.detail().unwrap_or_default().to_string();
    if let (Some(name), Some(line)) = (err.name(), err.line()) {
        let _ = write!(detail, " (in {name}:{line})");
    }
    Error::new(err.kind(), detail)
}

/// Reads `bos_token`/`eos_token` from a tokenizer config: absent/null, a string, or an
/// AddedToken object with `content`.
fn special_token(config: &serde_json::Value, field: &str) -> Result<Option<String>, String> {
    match config.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Object(obj)) => match obj.get("content") {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            _ => Err("object form must have a string \"content\"".into()),
        },
        Some(other) => Err(format!("expected a string or an object, found {other}")),
    }
}

/// Builds the environment with transformers' settings and helpers.
fn new_environment() -> Result<Environment<'static>, ChatTemplateError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .map_err(ChatTemplateError::Syntax)?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        out.write_str(&py_str_checked(value)?)
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: &Value| py_str_checked(value).map(Value::from));
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    Ok(env)
}

/// `raise_exception(message)`: aborts rendering with `message`.
fn raise_exception(message: Option<Value>) -> Result<Value, Error> {
    let message = message.map(|m| py_str(&m)).unwrap_or_default();
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

/// Rewrites `{% generation %}`/`{% endgeneration %}` (transformers' `AssistantTracker`
/// extension, unknown to minijinja) into `{% if true %}`/`{% endif %}`. Whitespace-control
/// markers are kept, so trimming behaves identically.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // Search after the opening `{%`, so `{%}` cannot yield an end before the start.
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open_mod, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, close_mod) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = write!(out, "{{%{open_mod} {r} {close_mod}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::pycompat::*;
    use super::*;
    use serde_json::json;

    fn qwen_config_path() -> String {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/qwen-tokenizer/tokenizer_config.json").to_string()
    }

    fn render_simple(source: &str, ctx: serde_json::Value) -> Result<String, ChatTemplateError> {
        let t = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into()))?;
        let extra = ctx.as_object().cloned().unwrap_or_default();
        t.render(&[], None, false, &extra)
    }

    #[test]
    fn golden_chat_cases_render_identically() {
        let t = ChatTemplate::from_tokenizer_config(qwen_config_path()).unwrap();
        assert_eq!(t.eos_token(), Some("<|im_end|>"));
        assert_eq!(t.bos_token(), None);
        let cases = crate::tokenizer::tests::golden()["chat"].as_array().expect("chat cases");
        assert!(!cases.is_empty());
        for (i, case) in cases.iter().enumerate() {
            let messages = case["messages"].as_array().unwrap();
            let tools = match &case["tools"] {
                serde_json::Value::Null => None,
                t => Some(t),
            };
            let mut extra = serde_json::Map::new();
            if !case["enable_thinking"].is_null() {
                extra.insert("enable_thinking".into(), case["enable_thinking"].clone());
            }
            let add = case["add_generation_prompt"].as_bool().unwrap();
            let got = t.render(messages, tools, add, &extra).unwrap();
            assert_eq!(got, case["rendered"].as_str().unwrap(), "chat case #{i}");
        }
    }

    #[test]
    fn raise_exception_aborts_with_message() {
        let err = render_simple(
            "{% if true %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}",
            json!({}),
        )
        .unwrap_err();
        match &err {
            ChatTemplateError::Raised(msg) => assert_eq!(msg, "Conversation roles must alternate"),
            other => panic!("expected Raised, got {other:?}"),
        }
        assert!(err.to_string().contains("Conversation roles must alternate"));
    }

    #[test]
    fn syntax_error_is_an_error() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m }", None, None).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Syntax(_)), "{err:?}");
        let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(err.to_string().contains("syntax error"), "{err}");
        assert!(!err.to_string().contains('\n'), "one line: {err}");
        // A stray `{%}` must be an error, not a slice panic in the tag rewriter.
        assert!(ChatTemplate::new("a {%} b", None, None).is_err());
    }

    #[test]
    fn other_render_errors_are_render_errors() {
        let err = render_simple("{{ foo.bar.baz }}", json!({})).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Render(_)), "{err:?}");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let ctx = json!({"x": {"b": 1, "a": [1.5, "é<>&'\"\n", null, true, 1e-7, 1e16, 100.0], "c": {}}});
        assert_eq!(
            render_simple("{{ x | tojson }}", ctx.clone()).unwrap(),
            r#"{"b": 1, "a": [1.5, "é<>&'\"\n", null, true, 1e-07, 1e+16, 100.0], "c": {}}"#
        );
        assert_eq!(
            render_simple("{{ x | tojson(indent=2) }}", ctx.clone()).unwrap(),
            "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é<>&'\\\"\\n\",\n    null,\n    true,\n    1e-07,\n    1e+16,\n    100.0\n  ],\n  \"c\": {}\n}"
        );
        assert_eq!(
            render_simple("{{ x.a[1] | tojson(ensure_ascii=true) }}", ctx.clone()).unwrap(),
            r#""\u00e9<>&'\"\n""#
        );
        assert_eq!(
            render_simple("{{ x | tojson(sort_keys=true, separators=[',', ':']) }}", ctx).unwrap(),
            r#"{"a":[1.5,"é<>&'\"\n",null,true,1e-07,1e+16,100.0],"b":1,"c":{}}"#
        );
        assert_eq!(render_simple("{{ '🦀' | tojson(ensure_ascii=true) }}", json!({})).unwrap(), r#""\ud83e\udd80""#);
    }

    #[test]
    fn python_style_printing() {
        let ctx = json!({"n": null, "t": true, "d": {"a": "it's", "b": [1, 2.0]}, "f": 0.0001});
        assert_eq!(
            render_simple("{{ n }}|{{ t }}|{{ d }}|{{ f }}|{{ t | string }}|{{ undefined_var }}", ctx).unwrap(),
            "None|True|{'a': \"it's\", 'b': [1, 2.0]}|0.0001|True|"
        );
    }

    #[test]
    fn python_string_methods_and_variables() {
        let out = render_simple(
            "{{ bos_token }}{{ '  a,b '.strip().split(',') | join('-') }}{{ 'x'.upper() }}\
             {% if documents is none and tools is none %}ok{% endif %}{{ flag }}",
            json!({"flag": "F"}),
        )
        .unwrap();
        assert_eq!(out, "<s>a-bXokF");
    }

    #[test]
    fn trim_and_lstrip_blocks() {
        let out = render_simple("  {% if true %}\nA\n  {% endif %}\nB\n", json!({})).unwrap();
        assert_eq!(out, "A\nB");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let src = "{% for m in ['a', 'b'] %}{%- generation -%} {{ m }} {%- endgeneration %}{% endfor %}";
        assert_eq!(render_simple(src, json!({})).unwrap(), "ab");
        assert_eq!(
            rewrite_generation_tags("{%- generation +%}x{% endgeneration%}{% if 1 %}"),
            "{%- if true +%}x{% endif %}{% if 1 %}"
        );
    }

    #[test]
    fn reserved_extra_variables_are_rejected() {
        let t = ChatTemplate::new("{{ messages }}", None, None).unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("messages".into(), json!([]));
        assert!(matches!(t.render(&[], None, false, &extra), Err(ChatTemplateError::ReservedVariable(_))));
    }

    #[test]
    fn float_repr_matches_python() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456789012345.0, "123456789012345.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (-0.0, "-0.0"),
            (6.02214076e23, "6.02214076e+23"),
            (2.5e-3, "0.0025"),
        ] {
            assert_eq!(py_float_repr(f), s);
        }
    }

    #[test]
    fn strftime_formats_utc() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %a %A %b %B %j %I%p %-d %y %%", t),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 01PM 29 24 %"
        );
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
        let now = render_simple("{{ strftime_now('%Y') }}", json!({})).unwrap();
        assert_eq!(now.len(), 4);
    }

    #[test]
    fn tokenizer_config_forms() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(
            &path,
            json!({
                "bos_token": {"content": "<s>", "__type": "AddedToken"},
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "default", "template": "D{{ bos_token }}{{ eos_token }}"},
                    {"name": "tool_use", "template": "T{{ tools | length }}"}
                ]
            })
            .to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&path).unwrap();
        let extra = serde_json::Map::new();
        assert_eq!(t.render(&[], None, false, &extra).unwrap(), "D<s></s>");
        assert_eq!(t.render(&[], Some(&json!([1, 2])), false, &extra).unwrap(), "T2");

        std::fs::write(&path, json!({"eos_token": 5}).to_string()).unwrap();
        let err = ChatTemplate::from_tokenizer_config(&path).unwrap_err();
        assert!(err.to_string().contains("eos_token"), "{err}");

        std::fs::write(&path, json!({"eos_token": "x"}).to_string()).unwrap();
        let err = ChatTemplate::from_tokenizer_config(&path).unwrap_err();
        assert!(matches!(err, ChatTemplateError::MissingTemplate { .. }), "{err}");

        std::fs::write(dir.path().join("chat_template.jinja"), "J{{ eos_token }}\n").unwrap();
        let t = ChatTemplate::from_tokenizer_config(&path).unwrap();
        assert_eq!(t.render(&[], None, false, &extra).unwrap(), "Jx");

        let err = ChatTemplate::from_tokenizer_config(dir.path().join("missing.json")).unwrap_err();
        assert!(err.to_string().contains("missing.json"), "{err}");
    }
}
