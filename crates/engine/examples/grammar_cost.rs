//! What compiling a constraint costs, for the shapes that hostile clients send: rule and `$ref`
//! chains, many optional properties, wide alternations, nested repeats, big choice lists, and
//! large valid schemas. Each is compiled once on a thread with the compile queue's stack (no
//! cache hits), and the wall time and outcome (compiled, or the refusal's first line) printed. A
//! measurement, not a test: it asserts nothing about time.
//!
//! `cargo run --release -p flint-engine --example grammar_cost [filter]` (a filter keeps the rows
//! whose label contains it, e.g. `chain`).

use std::sync::Arc;
use std::time::Instant;

use flint_engine::structured::{Constraint, GrammarCompiler};
use flint_engine::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

fn rule_chain(n: usize) -> Constraint {
    let mut g = String::from("start: r0\n");
    for i in 0..n {
        g.push_str(&format!("r{i}: r{} | \"x\"\n", i + 1));
    }
    Constraint::Lark(g + &format!("r{n}: \"end\"\n"))
}

fn ref_chain(n: usize) -> Constraint {
    let mut defs: Map<String, Value> =
        (0..n).map(|i| (format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}))).collect();
    defs.insert(format!("d{n}"), json!({"type": "string"}));
    Constraint::JsonSchema(json!({"$defs": defs, "$ref": "#/$defs/d0"}))
}

fn object(n: usize, required: bool) -> Constraint {
    let names: Vec<String> = (0..n).map(|i| format!("field_{i}")).collect();
    let props: Map<String, Value> = names.iter().map(|p| (p.clone(), json!({"type": "integer"}))).collect();
    let mut s = json!({"type": "object", "properties": props});
    if required {
        s["required"] = json!(names);
    }
    Constraint::JsonSchema(s)
}

fn alternatives(n: usize) -> Constraint {
    let alts: Vec<String> = (0..n).map(|i| format!("\"w{i}\"")).collect();
    Constraint::Lark(format!("start: {}", alts.join(" | ")))
}

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    let compiler = Arc::new(GrammarCompiler::new(Arc::new(Tokenizer::builtin_qwen().unwrap()), 151_936, vec![151_645]));
    compiler.warm_up().unwrap();
    let rows: Vec<(String, Constraint)> = vec![
        ("rule chain 800".into(), rule_chain(800)),
        ("rule chain 4,000".into(), rule_chain(4000)),
        ("rule chain 10,000".into(), rule_chain(10_000)),
        ("$ref chain 1,000".into(), ref_chain(1000)),
        ("$ref chain 2,400".into(), ref_chain(2400)),
        ("$ref chain 10,000".into(), ref_chain(10_000)),
        ("480 optional properties".into(), object(480, false)),
        ("6,000 optional properties".into(), object(6000, false)),
        ("6,000 required properties".into(), object(6000, true)),
        ("Lark rule of 1,500 alternatives".into(), alternatives(1500)),
        ("Lark rule of 20,000 alternatives".into(), alternatives(20_000)),
        ("regex a{1000}{1000}".into(), Constraint::Regex("a{1000}{1000}".into())),
        ("choice of 4,096".into(), Constraint::Choice((0..4096).map(|i| format!("answer {i}")).collect())),
    ];
    println!("{:<34} {:>10}  outcome", "constraint", "ms");
    for (label, c) in rows.into_iter().filter(|(l, _)| l.contains(&filter)) {
        let compiler = compiler.clone();
        let t0 = Instant::now();
        let outcome = std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn(move || match compiler.compile(&c) {
                Ok(_) => "compiled".to_string(),
                Err(e) => e.to_string().lines().next().unwrap_or("").chars().take(90).collect(),
            })
            .expect("thread")
            .join()
            .unwrap_or_else(|_| "panicked".into());
        println!("{label:<34} {:>10.1}  {outcome}", t0.elapsed().as_secs_f64() * 1e3);
    }
}
