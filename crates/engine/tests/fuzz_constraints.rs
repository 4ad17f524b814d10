//! Generated grammars and schemas through the grammar compiler, as a request's constraint goes:
//! on the compile queue's threads (their stack, their bounds), then walked for a few tokens. The
//! shapes are the ones that once aborted the process (rule and `$ref` chains), ran for seconds or
//! failed only at generation (wide optional objects, huge alternations, nested repeats), mixed
//! with random nesting, references, cycles and junk. Each must compile or be refused with
//! `GrammarError::Invalid`, and a compiled one must walk without a panic. Seeded: a failure names
//! its seed and case. `FLINT_FUZZ_CASES` sets the number of cases (scripts/fuzz.sh runs more).

use std::sync::Arc;

use flint_engine::structured::{Constraint, GrammarCompiler, GrammarError, GrammarState, ToolSchema};
use flint_engine::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

const VOCAB: usize = 151_936;
const EOS: [u32; 2] = [151_645, 151_643];
const WORDS: [&str; 8] = ["alpha", "beta", "x", "", "a b", "\"q\"", "é", "{}"];

fn ident(rng: &mut StdRng, i: usize) -> String {
    format!("n{}_{i}", rng.random_range(0..1000))
}

/// A random JSON schema `depth` levels deep at most, referring to `defs` names.
fn schema(rng: &mut StdRng, depth: usize, defs: &[String]) -> Value {
    if depth == 0 || rng.random_range(0..4) == 0 {
        return match rng.random_range(0..7) {
            0 => json!({"type": "string", "maxLength": rng.random_range(0..20)}),
            1 => json!({"type": "integer", "minimum": rng.random_range(-50..0), "maximum": rng.random_range(0..50)}),
            2 => json!({"enum": WORDS[..rng.random_range(1..WORDS.len())]}),
            3 if !defs.is_empty() => json!({"$ref": format!("#/$defs/{}", defs[rng.random_range(0..defs.len())])}),
            4 => {
                json!({"type": "string", "pattern": format!("^[a-z]{{{},{}}}$", rng.random_range(0..3), rng.random_range(3..9))})
            }
            5 => json!(rng.random_range(0..2) == 0),
            _ => json!({"type": rng.random_range(0..3).to_string()}),
        };
    }
    match rng.random_range(0..4) {
        0 => {
            let n = if rng.random_range(0..8) == 0 { rng.random_range(300..1500) } else { rng.random_range(0..8) };
            let props: Map<String, Value> = (0..n).map(|i| (ident(rng, i), schema(rng, depth - 1, defs))).collect();
            let required: Vec<&String> = props.keys().filter(|_| rng.random_range(0..3) == 0).collect();
            let mut o = json!({"type": "object", "properties": props, "required": required});
            if rng.random_range(0..3) == 0 {
                o["additionalProperties"] = json!(rng.random_range(0..2) == 0);
            }
            o
        }
        1 => json!({"type": "array", "items": schema(rng, depth - 1, defs), "maxItems": rng.random_range(0..4)}),
        2 => {
            let alts: Vec<Value> = (0..rng.random_range(1..5)).map(|_| schema(rng, depth - 1, defs)).collect();
            json!({["anyOf", "oneOf", "allOf"][rng.random_range(0..3)]: alts})
        }
        _ => json!({"type": "array", "prefixItems": [schema(rng, depth - 1, defs)], "items": false}),
    }
}

/// A schema with `$defs` that refer to each other (chains, cycles) and a root that uses them.
fn schema_with_defs(rng: &mut StdRng) -> Value {
    let long = rng.random_range(0..6) == 0;
    let n = if long { rng.random_range(1000..8000) } else { rng.random_range(0..6) };
    let names: Vec<String> = (0..n).map(|i| ident(rng, i)).collect();
    let mut defs = Map::new();
    for (i, d) in names.iter().enumerate() {
        let v = if long && i + 1 < n {
            json!({"$ref": format!("#/$defs/{}", names[i + 1])})
        } else {
            schema(rng, 3, &names)
        };
        defs.insert(d.clone(), v);
    }
    let mut root = schema(rng, 3, &names);
    if let (Value::Object(o), Some(first)) = (&mut root, names.first()) {
        if long {
            o.clear();
            o.insert("$ref".into(), json!(format!("#/$defs/{first}")));
        }
        o.insert("$defs".into(), Value::Object(defs));
    }
    root
}

/// A random Lark grammar: chains of rules (some thousands long), alternations (some tens of
/// thousands wide), groups, repeats, terminals, regexes, embedded schemas, and junk.
fn lark(rng: &mut StdRng) -> String {
    let long = rng.random_range(0..6) == 0;
    let n = if long { rng.random_range(1000..9000) } else { rng.random_range(1..12) };
    let names: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
    let mut g = String::from("start: r0\n");
    for (i, r) in names.iter().enumerate() {
        let next = names.get(i + 1).cloned().unwrap_or_else(|| "\"end\"".into());
        let body = match rng.random_range(0..8) {
            _ if long => format!("{next} | \"x\""),
            0 => format!("{next} | \"x\""),
            1 => {
                let k =
                    if rng.random_range(0..10) == 0 { rng.random_range(2000..25_000) } else { rng.random_range(1..6) };
                (0..k).map(|j| format!("\"w{j}\"")).collect::<Vec<_>>().join(" | ") + &format!(" | {next}")
            }
            2 => format!("{}{next}{}", "(".repeat(rng.random_range(0..35)), ")".repeat(rng.random_range(0..35))),
            3 => format!("/[a-z]{{{}}}/ {next}", rng.random_range(0..2000)),
            4 => format!("%json {} {next}", schema(rng, 3, &[])),
            5 => format!("{next}* \"y\"?"),
            6 => format!("T{i} {next}\nT{i}: /[0-9]+/"),
            _ => WORDS[rng.random_range(0..WORDS.len())].to_string(),
        };
        g.push_str(&format!("{r}: {body}\n"));
    }
    g
}

fn constraint(rng: &mut StdRng) -> Constraint {
    match rng.random_range(0..6) {
        0 | 1 => Constraint::JsonSchema(schema_with_defs(rng)),
        2 => Constraint::Lark(lark(rng)),
        3 => Constraint::Regex(format!(
            "({}){{{}}}{{{}}}",
            WORDS[rng.random_range(0..3)],
            rng.random_range(0..1200),
            rng.random_range(0..1200)
        )),
        4 => Constraint::Choice((0..rng.random_range(1..4096)).map(|i| format!("{} {i}", WORDS[i % 8])).collect()),
        _ => Constraint::ToolCalls {
            tools: (0..rng.random_range(1..4))
                .map(|i| ToolSchema { name: format!("t{i}"), parameters: schema_with_defs(rng) })
                .collect(),
            parallel: rng.random_range(0..2) == 0,
            optional: rng.random_range(0..2) == 0,
        },
    }
}

/// The server's limit on a constraint's text (`flint_server::structured::MAX_CONSTRAINT_BYTES`).
const MAX_CONSTRAINT_BYTES: usize = 256 << 10;

fn size(c: &Constraint) -> usize {
    match c {
        Constraint::JsonSchema(v) => v.to_string().len(),
        Constraint::Regex(s) | Constraint::Lark(s) => s.len(),
        Constraint::Choice(c) => c.iter().map(String::len).sum(),
        Constraint::JsonObject => 0,
        Constraint::ToolCalls { tools, .. } => tools.iter().map(|t| t.parameters.to_string().len()).sum(),
    }
}

fn allowed(words: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    for (w, &bits) in words.iter().enumerate() {
        for b in 0..32 {
            if bits >> b & 1 == 1 {
                out.push(w as u32 * 32 + b);
            }
        }
    }
    out
}

#[test]
fn generated_constraints_compile_or_are_refused_never_crash() {
    let cases: u64 = std::env::var("FLINT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    let seed: u64 = std::env::var("FLINT_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(33);
    let only: Option<u64> = std::env::var("FLINT_FUZZ_CASE").ok().and_then(|v| v.parse().ok());
    let compiler = Arc::new(GrammarCompiler::new(Arc::new(Tokenizer::builtin_qwen().unwrap()), VOCAB, EOS.to_vec()));
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let (mut compiled, mut refused) = (0, 0);
    for case in 0..cases {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(case));
        let c = constraint(&mut rng);
        if only.is_some_and(|o| o != case) {
            continue;
        }
        let what = format!("seed {seed} case {case} ({} bytes)", size(&c));
        // The server refuses a constraint past its size limit before compiling it.
        if size(&c) > MAX_CONSTRAINT_BYTES {
            refused += 1;
            continue;
        }
        match rt.block_on(compiler.submit(c).wait()) {
            Ok(g) => {
                compiled += 1;
                let mut state = GrammarState::new(&g, None).unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut words = Vec::new();
                for _ in 0..rng.random_range(0..12) {
                    if state.is_finished() || state.mask(&EOS, &mut words).is_err() {
                        break;
                    }
                    let ids = allowed(&words);
                    assert!(!ids.is_empty(), "{what}: an empty mask was returned as Ok");
                    if state.advance(ids[rng.random_range(0..ids.len())], &EOS).is_err() {
                        break;
                    }
                }
            }
            Err(GrammarError::Invalid(m)) => {
                assert!(!m.is_empty(), "{what}: an empty message");
                refused += 1;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
    if only.is_none() {
        assert!(compiled > cases / 10 && refused > cases / 10, "compiled {compiled}, refused {refused}");
    }
}
