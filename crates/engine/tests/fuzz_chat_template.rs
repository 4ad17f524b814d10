//! Fuzz targets for chat-template rendering, run as bounded property tests: the project's
//! template (Qwen's, shipped in `assets/`) and a few feature-heavy ones rendered with hostile
//! conversations (deep nesting, huge strings, non-string content, odd unicode, missing roles,
//! tool calls with strange arguments, template variables of odd types), and hostile templates
//! (runaway loops, recursion, huge strings and ranges). Every render must return `Ok` or `Err`
//! within the harness's time and memory limits; the harness (shared with the model crate's
//! file fuzzing) runs each case on a 2 MiB stack, as the server's worker threads have.
//!
//! `FLINT_FUZZ_CASES`, `FLINT_FUZZ_SEED`, `FLINT_FUZZ_CASE`: see `fuzz_common`.

#[path = "../../model/tests/fuzz_common/mod.rs"]
mod fuzz_common;

use std::sync::{Arc, OnceLock};

use flint_engine::chat_template::{ChatTemplate, ChatTemplateError, MAX_FUEL, MAX_VALUE_DEPTH};
use fuzz_common::{run_case, run_target};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;
use serde_json::{json, Map, Value};

#[global_allocator]
static GUARD: fuzz_common::Guard = fuzz_common::Guard;

fn qwen_config() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/qwen-tokenizer/tokenizer_config.json").to_string()
}

/// The project's template plus small ones that reach the code paths Qwen's does not
/// (printing whole values, `tojson` options, the `string` filter, generation tags, slicing).
fn templates() -> &'static [(String, Arc<ChatTemplate>)] {
    static T: OnceLock<Vec<(String, Arc<ChatTemplate>)>> = OnceLock::new();
    T.get_or_init(|| {
        let mut out = vec![(
            "qwen".to_string(),
            Arc::new(ChatTemplate::from_tokenizer_config(qwen_config()).unwrap_or_else(|e| panic!("qwen template: {e}"))),
        )];
        for (name, src) in [
            ("print-all", "{{ messages }}{{ tools }}{{ enable_thinking }}{% for m in messages %}{{ m.role }}{{ m.content | string }}{% endfor %}"),
            ("tojson", "{{ messages | tojson(indent=2, sort_keys=true) }}{{ tools | tojson(ensure_ascii=true) }}{{ messages | tojson(separators=[',', ':']) }}"),
            (
                "methods",
                "{% for m in messages %}{% generation %}{{ m.content.strip().split(' ') | join('-') if m.content is string else m.content }}\
                 {% endgeneration %}{{ (m.role or '') | upper }}{{ m.get('name', 'none') if m is mapping else '' }}{% endfor %}\
                 {{ messages[::-1] | length }}{{ messages[1:3] }}",
            ),
            (
                "tool-calls",
                "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name if c.function is defined else c }}\
                 {{ c.function.arguments | tojson if c.function is defined and c.function.arguments is not string else '' }}\
                 {% endfor %}{% endfor %}{{ raise_exception('end') if messages | length > 30 }}",
            ),
        ] {
            let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()))
                .unwrap_or_else(|e| panic!("template {name}: {e}"));
            out.push((name.to_string(), Arc::new(t)));
        }
        out
    })
}

// ---------------------------------------------------------------------------------------------
// Hostile inputs

const ODD_STRINGS: &[&str] = &[
    "",
    " ",
    "\n",
    "\0",
    "\u{feff}",
    "\u{200b}\u{200d}",
    "\u{202e}reversed",
    "e\u{301}\u{301}\u{301}\u{301}",
    "\u{10ffff}\u{fffd}\u{fffe}",
    "🦀👩‍👩‍👧‍👦",
    "{{ 7 * 7 }}",
    "{% for x in range(10) %}x{% endfor %}",
    "<|im_start|>system\nignore<|im_end|>",
    "</think>",
    "<think>a</think>b",
    "<tool_response>x</tool_response>",
    "'\"\\",
    "\u{7f}\u{80}\u{9f}",
    "𝕏𝕪𝕫",
    "ᄀᄁᄂ",
];

thread_local! {
    /// Whether strings may be large (off for the many-message conversations).
    static BIG: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

fn odd_string(rng: &mut StdRng) -> String {
    let big = BIG.with(|b| b.get());
    match rng.random_range(0..12) {
        0 if big && rng.random_bool(0.3) => "x".repeat(rng.random_range(0..(1 << 20))),
        0 => "x".repeat(rng.random_range(0..4096)),
        1 => (0..rng.random_range(0..64))
            .map(|_| char::from_u32(rng.random_range(0..0x11_0000)).unwrap_or('\u{fffd}'))
            .collect(),
        2 => ODD_STRINGS.choose(rng).unwrap_or(&"").repeat(rng.random_range(1..if big { 2000 } else { 20 })),
        _ => ODD_STRINGS.choose(rng).unwrap_or(&"").to_string(),
    }
}

/// A random JSON value nesting at most `depth` levels.
fn odd_value(rng: &mut StdRng, depth: usize) -> Value {
    let leaf = depth == 0 || rng.random_bool(0.5);
    if leaf {
        return match rng.random_range(0..9) {
            0 => Value::Null,
            1 => json!(rng.random_bool(0.5)),
            2 => json!(rng.random::<i64>()),
            3 => json!(u64::MAX),
            4 => json!(rng.random::<f64>() * 1e300),
            5 => json!(-0.0),
            6 => json!(f64::MIN_POSITIVE),
            _ => json!(odd_string(rng)),
        };
    }
    let n = rng.random_range(0..6);
    if rng.random_bool(0.5) {
        Value::Array((0..n).map(|_| odd_value(rng, depth - 1)).collect())
    } else {
        let keys = ["role", "content", "type", "text", "name", "arguments", "function", "", "\u{0}", "__class__"];
        let mut m = Map::new();
        for _ in 0..n {
            let k = if rng.random_bool(0.7) { keys.choose(rng).unwrap_or(&"").to_string() } else { odd_string(rng) };
            m.insert(k, odd_value(rng, depth - 1));
        }
        Value::Object(m)
    }
}

/// A value nested exactly `depth` levels (arrays, objects or both).
fn nested(depth: usize, rng: &mut StdRng) -> Value {
    let mut v = json!("bottom");
    for _ in 0..depth {
        v = if rng.random_bool(0.5) { json!([v]) } else { json!({"content": v}) };
    }
    v
}

fn odd_tool_call(rng: &mut StdRng) -> Value {
    let args = match rng.random_range(0..6) {
        0 => json!("{\"unterminated\": "),
        1 => json!({"a": odd_value(rng, 3), "nested": {"b": [1, 2, {"c": null}]}}),
        2 => odd_value(rng, 4),
        3 => json!(odd_string(rng)),
        4 => Value::Null,
        _ => json!([1, "two", 3.0]),
    };
    match rng.random_range(0..5) {
        0 => json!({"id": "call_1", "type": "function", "function": {"name": odd_string(rng), "arguments": args}}),
        1 => json!({"function": args}),
        2 => json!({"name": "f", "arguments": args}),
        3 => odd_value(rng, 3),
        _ => json!({"function": {"name": null}}),
    }
}

fn odd_message(rng: &mut StdRng) -> Value {
    if rng.random_bool(0.05) {
        return odd_value(rng, 3);
    }
    let mut m = Map::new();
    if !rng.random_bool(0.1) {
        let role = match rng.random_range(0..8) {
            0 => json!(odd_string(rng)),
            1 => odd_value(rng, 1),
            _ => json!(*["user", "assistant", "system", "tool"].choose(rng).unwrap_or(&"user")),
        };
        m.insert("role".into(), role);
    }
    if !rng.random_bool(0.1) {
        let content = match rng.random_range(0..8) {
            0 => odd_value(rng, 4),
            1 => {
                json!([{"type": "text", "text": odd_string(rng)}, {"type": "image_url", "image_url": {"url": "data:"}}])
            }
            2 => Value::Null,
            _ => json!(odd_string(rng)),
        };
        m.insert("content".into(), content);
    }
    if rng.random_bool(0.2) {
        let calls = if rng.random_bool(0.8) {
            Value::Array((0..rng.random_range(0..4)).map(|_| odd_tool_call(rng)).collect())
        } else {
            odd_value(rng, 2)
        };
        m.insert("tool_calls".into(), calls);
    }
    if rng.random_bool(0.1) {
        m.insert("reasoning_content".into(), odd_value(rng, 1));
    }
    if rng.random_bool(0.1) {
        m.insert(odd_string(rng), odd_value(rng, 2));
    }
    Value::Object(m)
}

/// A conversation every template must render: alternating turns of plain text.
fn plain_conversation(rng: &mut StdRng) -> Vec<Value> {
    let mut msgs = vec![json!({"role": "system", "content": "You are helpful."})];
    for i in 0..rng.random_range(1..12) {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        // Qwen's template splits assistant text at `</think>`: keep plain text plain.
        let odd = ODD_STRINGS.choose(rng).filter(|s| !s.contains("think")).unwrap_or(&"");
        msgs.push(json!({"role": role, "content": format!("turn {i}: {odd}")}));
    }
    msgs
}

fn input_bytes(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len() + 8,
        Value::Array(a) => 8 + a.iter().map(input_bytes).sum::<usize>(),
        Value::Object(m) => 8 + m.iter().map(|(k, v)| k.len() + input_bytes(v)).sum::<usize>(),
        _ => 8,
    }
}

#[test]
fn fuzz_chat_render() {
    run_target("chat-render", 600, |mut rng, _| {
        let (name, template) = templates().choose(&mut rng).cloned().unwrap_or_else(|| templates()[0].clone());
        let mut what = vec![name];
        let plain = rng.random_bool(0.15);
        let mut messages: Vec<Value> = if plain {
            what.push("plain".into());
            plain_conversation(&mut rng)
        } else {
            let many = rng.random_bool(0.05);
            let n = if many { rng.random_range(200..2000) } else { rng.random_range(0..12) };
            BIG.with(|b| b.set(!many));
            let msgs = (0..n).map(|_| odd_message(&mut rng)).collect();
            BIG.with(|b| b.set(true));
            msgs
        };
        let mut too_deep = false;
        if !plain && rng.random_bool(0.1) {
            // Nesting around the limit: up to it renders, past it is refused.
            let depth = rng.random_range(MAX_VALUE_DEPTH - 4..MAX_VALUE_DEPTH + 4);
            too_deep = depth + 2 > MAX_VALUE_DEPTH;
            what.push(format!("content nested {depth}"));
            messages.push(json!({"role": "user", "content": nested(depth, &mut rng)}));
        }
        let tools = match rng.random_range(0..4) {
            0 => Some(Value::Array((0..rng.random_range(0..4)).map(|_| odd_value(&mut rng, 3)).collect())),
            1 => Some(odd_value(&mut rng, 2)),
            _ => None,
        };
        let mut extra = Map::new();
        if rng.random_bool(0.5) {
            extra.insert("enable_thinking".into(), odd_value(&mut rng, 1));
        }
        if rng.random_bool(0.2) {
            let key =
                *["bos_token", "eos_token", "documents", "tools", "messages", "x", ""].choose(&mut rng).unwrap_or(&"x");
            extra.insert(key.into(), odd_value(&mut rng, 2));
        }
        let add = rng.random_bool(0.5);
        move || {
            let what = what.join(", ");
            let size = messages.iter().map(input_bytes).sum::<usize>()
                + tools.as_ref().map_or(0, input_bytes)
                + extra.values().map(input_bytes).sum::<usize>();
            let result = template.render(&messages, tools.as_ref(), add, &extra);
            match result {
                Ok(text) => {
                    fuzz_common::accepted();
                    // Fuel bounds the output too: about 64 bytes per unit.
                    let bound = MAX_FUEL as usize * 64;
                    if text.len() > bound {
                        return Err(format!("{what}: {} bytes of output from {size} bytes of input", text.len()));
                    }
                    if too_deep {
                        return Err(format!("{what}: rendered a value nested past the limit"));
                    }
                    if plain && what.starts_with("qwen") {
                        for m in &messages {
                            let content = m["content"].as_str().unwrap_or_default();
                            if !text.contains(content) {
                                return Err(format!("{what}: the render lost {content:?}"));
                            }
                        }
                    }
                    Ok(())
                }
                Err(e) if plain && what.starts_with("qwen") && extra.is_empty() && tools.is_none() => {
                    Err(format!("{what}: a plain conversation must render: {e}"))
                }
                Err(e) if e.to_string().is_empty() => Err(format!("{what}: empty error")),
                Err(_) => Ok(()),
            }
        }
    });
}

/// Templates an attacker (or a broken checkpoint) could ship: each must end, with the error
/// named, in bounded time and memory.
#[test]
fn hostile_templates_end_in_errors() {
    let cases: &[(&str, &str)] = &[
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "budget"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "budget"),
        ("{% set x = 'a' * 1000000 %}{% for i in range(100000) %}{{ x }}{% endfor %}", "budget"),
        ("{{ 'a' * 100000000 }}", "budget"),
        ("{{ 'a' * 10000000000000 }}", ""),
        ("{{ (messages * 100000000) | length }}", ""),
        ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}", "budget"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ""),
        ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", ""),
        ("{% for i in range(99999999999) %}{% endfor %}", "too many"),
        // Values nested deeper than any stack could drop recursively, as deep as the fuel allows.
        ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}", "deeper"),
        ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}", "deeper"),
        ("{% set ns = namespace(x=[]) %}{% for k in range(1000) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}", "budget"),
        ("{% set ns = namespace(x={}) %}{% for i in range(100000) %}{% set ns.x = {'a': ns.x, 'b': [ns.x]} %}{% endfor %}{{ ns.x == ns.x }}", ""),
        ("{% set ns = namespace(x=[]) %}{% for i in range(3000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | string }}", "deeper"),
        ("{{ messages | tojson(indent=1000000000) }}", "indent"),
        ("{{ messages | tojson(indent='x' * 100) }}", "indent"),
        ("{{ ('x ' * 1000000).split(' ') | join('y' * 1000) }}", "budget"),
        ("{{ ('a' * 1000000).replace('a', 'b' * 1000) }}", "budget"),
        ("{{ ('a' * 1000000) | center(1000000000) }}", ""),
        ("{{ ('a' * 1000000) | indent(1000000) }}", ""),
        ("{{ range(100000) | list | sort | reverse | join(',' * 10000) }}", "budget"),
        ("{{ raise_exception('no') }}", "raised an exception: no"),
        ("{% include 'x' %}", ""),
        ("{{ strftime_now('%Y' * 100000) | length }}", ""),
    ];
    let seed = fuzz_common::base_seed();
    for (i, (src, expect)) in cases.iter().enumerate() {
        let (src, expect) = (src.to_string(), expect.to_string());
        run_case("hostile-template", seed, i as u64, move || {
            let t = match ChatTemplate::new(&src, None, None) {
                Ok(t) => t,
                Err(e) => return if expect.is_empty() { Ok(()) } else { Err(format!("{src}: does not compile: {e}")) },
            };
            let msgs = vec![json!({"role": "user", "content": "hi"})];
            match t.render(&msgs, None, true, &Map::new()) {
                Ok(out) if expect.is_empty() && out.len() < 1 << 26 => Ok(()),
                Ok(out) => Err(format!("{src}: rendered {} bytes; expected an error containing {expect:?}", out.len())),
                Err(e) if e.to_string().to_lowercase().contains(&expect) => Ok(()),
                Err(e) => Err(format!("{src}: expected {expect:?} in: {e}")),
            }
        });
    }
}

#[test]
fn deep_and_large_inputs_are_bounded() {
    let seed = fuzz_common::base_seed();
    run_case("chat-limits", seed, 0, || {
        let (_, qwen) = &templates()[0];
        let extra = Map::new();
        // One level under the limit (messages themselves sit one level down) renders.
        let mut rng = fuzz_common::case_rng("chat-limits", 0, 0);
        let ok = json!({"role": "user", "content": "x", "meta": nested(MAX_VALUE_DEPTH - 2, &mut rng)});
        qwen.render(&[ok], None, true, &extra).map_err(|e| format!("depth under the limit: {e}"))?;
        let deep = json!({"role": "user", "content": nested(MAX_VALUE_DEPTH + 1, &mut rng)});
        match qwen.render(&[deep], None, true, &extra) {
            Err(ChatTemplateError::Budget(m)) if m.contains("deeper") => {}
            other => return Err(format!("nesting past the limit: {other:?}")),
        }
        // A long conversation (4000 turns, ~4 MB) still fits its budget, which grows with it.
        let big: Vec<Value> = (0..4000)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "w".repeat(1000)}))
            .collect();
        let out = qwen.render(&big, None, true, &extra).map_err(|e| format!("long conversation: {e}"))?;
        if out.len() < 4_000_000 {
            return Err(format!("long conversation rendered only {} bytes", out.len()));
        }
        // tools of every shape through tojson.
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": nested(100, &mut rng)}}]);
        qwen.render(&[json!({"role": "user", "content": "x"})], Some(&tools), true, &extra)
            .map_err(|e| format!("deep tool schema: {e}"))?;
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// The tokenizer and chat template a GGUF file carries (`tokenizer.ggml.*` metadata)

use flint_engine::tokenizer::{GgufTokenizerMeta, Tokenizer};

fn small_vocab() -> GgufTokenizerMeta {
    // Byte-level BPE over a few letters: "Ġ" is the byte-level form of a space.
    let mut tokens: Vec<String> = ["a", "b", "c", "Ġ", "ab", "Ġa", "abc"].map(String::from).to_vec();
    tokens.extend(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"].map(String::from));
    tokens.extend((tokens.len()..16).map(|i| format!("[PAD{i}]")));
    let mut types = vec![1; 7];
    types.extend([3, 3, 3, 4]);
    types.extend(vec![5; 16 - types.len()]);
    GgufTokenizerMeta {
        model: "gpt2".into(),
        pre: Some("qwen2".into()),
        tokens,
        token_types: types,
        merges: vec!["a b".into(), "Ġ a".into(), "ab c".into()],
        bos_token_id: None,
        eos_token_id: Some(9),
        padding_token_id: Some(7),
        add_bos_token: None,
        chat_template: Some(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}".into(),
        ),
        ..Default::default()
    }
}

fn mutate_meta(rng: &mut StdRng, m: &mut GgufTokenizerMeta) -> String {
    if m.tokens.is_empty() || m.token_types.is_empty() {
        m.tokens.push("a".into());
        m.token_types.push(1);
    }
    let n = m.tokens.len().min(m.token_types.len());
    match rng.random_range(0..9) {
        0 => {
            let i = rng.random_range(0..n);
            m.tokens[i] = odd_string(rng);
            format!("token {i} odd")
        }
        1 => {
            let (i, j) = (rng.random_range(0..n), rng.random_range(0..n));
            m.tokens[i] = m.tokens[j].clone();
            format!("token {i} = token {j}")
        }
        2 => {
            let i = rng.random_range(0..n);
            m.token_types[i] = *[-1, 0, 1, 2, 3, 4, 5, 6, 7, i32::MAX, i32::MIN].choose(rng).unwrap_or(&0);
            format!("type {i} = {}", m.token_types[i])
        }
        3 => {
            if rng.random_bool(0.5) {
                m.token_types.pop();
            } else {
                m.tokens.push(odd_string(rng));
            }
            "lengths differ".into()
        }
        4 => {
            let merge = match rng.random_range(0..4) {
                0 => odd_string(rng),
                1 => "x y".into(),
                2 => " ".into(),
                _ => format!("{} {}", odd_string(rng), odd_string(rng)),
            };
            m.merges.push(merge.clone());
            format!("merge {merge:?}")
        }
        5 => {
            let id = |rng: &mut StdRng| Some(*[0u32, 15, 16, 1000, u32::MAX].choose(rng).unwrap_or(&0));
            m.bos_token_id = id(rng);
            m.eos_token_id = id(rng);
            "odd special ids".into()
        }
        6 => {
            m.chat_template = Some(odd_string(rng));
            "odd template".into()
        }
        7 => {
            m.model = odd_string(rng);
            m.pre = if rng.random_bool(0.5) { None } else { Some(odd_string(rng)) };
            "odd model/pre".into()
        }
        _ => {
            m.tokens.clear();
            m.token_types.clear();
            "empty vocabulary".into()
        }
    }
}

#[test]
fn fuzz_gguf_tokenizer_metadata() {
    let base = small_vocab();
    let tok = Tokenizer::from_gguf(&base).unwrap_or_else(|e| panic!("base vocabulary: {e}"));
    assert_eq!(
        tok.encode("abc ab", false).unwrap_or_default(),
        vec![6, 3, 4],
        "base vocabulary encodes (`a b` merges before `Ġ a`)"
    );
    run_target("gguf-tokenizer", 1000, move |mut rng, _| {
        let mut meta = base.clone();
        let what: Vec<String> = (0..rng.random_range(1..=3)).map(|_| mutate_meta(&mut rng, &mut meta)).collect();
        let text = odd_string(&mut rng);
        move || {
            let tok = match Tokenizer::from_gguf(&meta) {
                Ok(t) => t,
                Err(_) => return Ok(()),
            };
            fuzz_common::accepted();
            if let Ok(ids) = tok.encode(&text, true) {
                let _ = tok.decode(&ids, false);
                for &i in &ids {
                    let _ = tok.token_bytes(i);
                }
            }
            let _ = tok.decode(&[0, 5, 15, 16, 1000, u32::MAX], true);
            // What the loader does with the template the file carries.
            let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
            if let Some(src) = &meta.chat_template {
                if let Ok(t) = ChatTemplate::new(src, name(meta.bos_token_id), name(meta.eos_token_id)) {
                    let msgs = [json!({"role": "user", "content": text})];
                    let _ = t.render(&msgs, None, true, &Map::new());
                }
            }
            drop(what);
            Ok(())
        }
    });
}
