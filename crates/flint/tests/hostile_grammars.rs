//! The real `flint serve` binary against hostile constraints: grammars and schemas that recursed
//! the compiler past its stack (the process aborted), compiles that outlived their requests, and
//! limits the grammar engine checked only once generation had started (a 500 mid-request).

mod common;

use std::time::{Duration, Instant};

use common::{assert_error, get, metric, post, start, stream, Server};
use serde_json::{json, Map, Value};

const CHAT: &str = "/v1/chat/completions";

fn user() -> Value {
    json!([{"role": "user", "content": "Go."}])
}

/// `start: r0`, `r{i}: r{i+1} | "x"`, …: ~20 bytes a rule.
fn rule_chain(n: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..n {
        g.push_str(&format!("r{i}: r{} | \"x\"\n", i + 1));
    }
    g + &format!("r{n}: \"end\"\n")
}

/// `_` and `i` in base 62: names short enough for 10,000 links in the 256 KB constraint limit,
/// and never a schema keyword.
fn name(mut i: usize) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut out = vec![b'_'];
    loop {
        out.push(DIGITS[i % 62]);
        i /= 62;
        if i == 0 {
            break;
        }
    }
    String::from_utf8(out).unwrap()
}

/// A schema whose root refers to link 0, each link to the next: a `$ref` chain `n` deep, as JSON
/// pointers to top-level keys.
fn ref_chain(n: usize) -> Value {
    let mut s = Map::new();
    for i in 0..n {
        s.insert(name(i), json!({"$ref": format!("#/{}", name(i + 1))}));
    }
    s.insert(name(n), json!({"type": "string"}));
    s.insert("$ref".into(), json!(format!("#/{}", name(0))));
    Value::Object(s)
}

async fn alive(s: &Server) {
    let (st, _) = get(s, "/health").await;
    assert_eq!(st, 200, "the server is gone");
}

/// Finding 1: chains 10,000 deep (a Lark grammar, a `$ref` chain; in every field that takes
/// them) are a 400 and the server lives; before, ~800 links aborted the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_grammars_and_schemas_are_refused_and_the_server_lives() {
    let s = start(&[], None).await;
    let grammar = rule_chain(10_000);
    let schema = ref_chain(10_000);
    assert!(grammar.len() < 256 << 10 && schema.to_string().len() < 256 << 10, "within the size limit");
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": schema}}]);
    let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}});
    for (param, extra) in [
        ("structured_outputs", json!({"structured_outputs": {"grammar": grammar}})),
        ("guided_grammar", json!({"guided_grammar": grammar})),
        ("response_format", json!({"response_format": rf})),
        ("guided_json", json!({"guided_json": schema})),
        ("tool_choice", json!({"tools": tool, "tool_choice": "required"})),
    ] {
        let mut body = json!({"messages": user(), "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, b) = post(&s, CHAT, body).await;
        assert_error(st, &b, 400, Some(param));
        assert!(b["error"]["message"].as_str().unwrap().contains("nests too deeply"), "{param}: {b}");
        alive(&s).await;
    }
    // The chains as the finding sent them (800 rules, 1,000 `$defs`) are within the bound: they
    // compile on the compile threads' deep stacks (or are refused), and the server lives.
    let defs: Map<String, Value> =
        (0..1000).map(|i| (format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}))).collect();
    let mut defs = defs;
    defs.insert("d1000".into(), json!({"type": "string", "maxLength": 3}));
    for extra in [
        json!({"structured_outputs": {"grammar": rule_chain(800)}}),
        json!({"guided_json": {"$defs": defs, "$ref": "#/$defs/d0"}}),
    ] {
        let mut body = json!({"messages": user(), "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, b) = post(&s, CHAT, body).await;
        assert!(st == 200 || st == 400, "{st}: {b}");
        alive(&s).await;
    }
    // Nesting deep in the request's other fields: parsed with serde_json's depth limit, rendered
    // by the template with its own, compiled within the bound.
    let mut deep = json!({"type": "string"});
    for _ in 0..100 {
        deep = json!({"type": "array", "items": deep});
    }
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": deep}}}}]);
    let (st, b) =
        post(&s, CHAT, json!({"messages": user(), "tools": tools, "tool_choice": "required", "max_tokens": 2})).await;
    assert!(st == 200 || st == 400, "{st}: {b}");
    alive(&s).await;
}

/// Finding 3: compiles run on a bounded queue; a compile whose request timed out before a thread
/// was free never starts, and the one that was running ends on its own (its result is kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_compiles_never_start_and_the_queue_drains() {
    let s = start(&["--grammar-compile-threads", "1", "--grammar-compile-timeout", "0.05"], None).await;
    // Distinct schemas of 6,000 required properties: ~0.4 s each to compile, far past 50 ms.
    let schema = |k: usize| {
        let names: Vec<String> = (0..6000).map(|i| format!("k{k}_{i}")).collect();
        let props: Map<String, Value> = names.iter().map(|n| (n.clone(), json!({"type": "integer"}))).collect();
        json!({"type": "object", "properties": props, "required": names})
    };
    let neighbour = {
        let base = s.base.clone();
        tokio::spawn(async move {
            let body = json!({"prompt": "Hello", "max_tokens": 64, "ignore_eos": true, "stream": true});
            let r = reqwest::Client::new().post(format!("{base}/v1/completions")).json(&body).send().await;
            r.expect("neighbour").text().await.expect("neighbour's stream")
        })
    };
    let hostile: Vec<_> = (0..6)
        .map(|k| {
            let (base, body) = (s.base.clone(), json!({"prompt": "x", "max_tokens": 2, "guided_json": schema(k)}));
            tokio::spawn(async move {
                let r = reqwest::Client::new().post(format!("{base}/v1/completions")).json(&body).send().await;
                let r = r.expect("hostile request");
                (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
            })
        })
        .collect();
    for h in hostile {
        let (st, b) = h.await.unwrap();
        assert_error(st, &b, 400, Some("guided_json"));
        assert!(b["error"]["message"].as_str().unwrap().contains("did not compile within"), "{b}");
    }
    // The running compile finishes, the rest are dropped unstarted; nothing is left queued.
    let t0 = Instant::now();
    let text = loop {
        let (_, text) = get(&s, "/metrics").await;
        let pending = metric(&text, "flint:grammar_compiles_running") + metric(&text, "flint:grammar_compiles_queued");
        if pending == 0.0 && metric(&text, "flint:grammar_compiles_skipped_total") >= 1.0 {
            break text;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "compiles still pending:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (started, skipped) =
        (metric(&text, "flint:grammar_compiles_total"), metric(&text, "flint:grammar_compiles_skipped_total"));
    assert_eq!(started + skipped, 6.0, "every compile either ran or was dropped:\n{text}");
    assert!(started < 6.0 && skipped >= 1.0, "abandoned compiles were started: {started} ran, {skipped} dropped");
    assert_eq!(metric(&text, "flint:grammar_compile_threads"), 1.0);
    let events = neighbour.await.unwrap();
    assert!(events.trim_end().ends_with("data: [DONE]"), "the neighbour's stream did not finish");
    alive(&s).await;
}

/// Finding 5: what the grammar engine refuses is a 400 at validation, and a choice list within
/// the documented limit works (each was a 500 at the first generated token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_grammar_engine_refuses_is_found_at_validation() {
    let s = start(&[], None).await;
    let alternatives: Vec<String> = (0..20_000).map(|i| format!("\"w{i}\"")).collect();
    let optional: Map<String, Value> = (0..2000).map(|i| (format!("p{i}"), json!({"type": "integer"}))).collect();
    for (param, extra) in [
        ("structured_outputs", json!({"structured_outputs": {"regex": "a{1000}{1000}"}})),
        (
            "structured_outputs",
            json!({"structured_outputs": {"grammar": format!("start: {}", alternatives.join(" | "))}}),
        ),
        ("guided_json", json!({"guided_json": {"type": "object", "properties": optional}})),
    ] {
        let mut body = json!({"prompt": "x", "max_tokens": 8});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, b) = post(&s, "/v1/completions", body).await;
        assert_error(st, &b, 400, Some(param));
    }
    let choices: Vec<String> = (0..4096).map(|i| format!("answer {i}")).collect();
    let body = json!({"prompt": "x", "max_tokens": 16, "structured_outputs": {"choice": choices}});
    let (st, b) = post(&s, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{b}");
    let text = b["choices"][0]["text"].as_str().unwrap();
    assert!(choices.iter().any(|c| c == text), "{text:?} is not one of the choices");
    // Streamed too.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let events = stream(&s, "/v1/completions", streamed).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(!events.iter().any(|e| e.contains("\"error\"")), "{events:?}");
    alive(&s).await;
}
