//! Structured outputs, forced tool calls and reasoning output through the real `flint serve`:
//! on the random-weight demo model (gibberish unless constrained) every constrained answer must
//! parse; on scripted models the reasoning is split from the answer, streaming and not.

mod common;

use common::{assert_error, get, metric, post, scripted, start, stream};
use serde_json::{json, Value};

fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": false
    })
}

fn check_person(v: &Value) {
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(o.len(), 3, "{v}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 6), "{v}");
    assert!(o["age"].as_u64().is_some_and(|a| a <= 99), "{v}");
    let pets = o["pets"].as_array().unwrap();
    assert!(pets.len() <= 2 && pets.iter().all(|p| p == "cat" || p == "dog"), "{v}");
}

/// The content deltas of a chat stream, per choice.
fn streamed_content(events: &[String], n: usize) -> Vec<String> {
    let mut out = vec![String::new(); n];
    for e in events {
        let Ok(c) = serde_json::from_str::<Value>(e) else { continue };
        for ch in c["choices"].as_array().into_iter().flatten() {
            if let Some(t) = ch["delta"]["content"].as_str() {
                out[ch["index"].as_u64().unwrap() as usize].push_str(t);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_output_on_the_demo_model() {
    let s = start(&[], None).await;
    let msgs = json!([{"role": "user", "content": "Describe a person."}]);

    // response_format json_schema, n = 3, sampled: every choice parses and validates.
    let rf = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person(), "strict": true}});
    let (st, r) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": msgs, "response_format": rf, "n": 3, "seed": 4, "max_tokens": 200}),
    )
    .await;
    assert_eq!(st, 200, "{r}");
    for c in r["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        check_person(&serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap());
    }

    // Streaming, with the legacy guided_json: the streamed text parses too.
    let events = stream(
        &s,
        "/v1/chat/completions",
        json!({"messages": msgs, "guided_json": person(), "n": 2, "seed": 9, "max_tokens": 200, "stream": true}),
    )
    .await;
    for text in streamed_content(&events, 2) {
        check_person(&serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}")));
    }

    // json_object, choice, regex (completions), vLLM's structured_outputs.
    let (_, r) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": msgs, "guided_choice": ["yes", "no"], "n": 4, "max_tokens": 10}),
    )
    .await;
    for c in r["choices"].as_array().unwrap() {
        assert!(c["message"]["content"] == "yes" || c["message"]["content"] == "no", "{c}");
    }
    let (st, r) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "Code:", "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}, "max_tokens": 20, "n": 2, "seed": 1}),
    )
    .await;
    assert_eq!(st, 200, "{r}");
    for c in r["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        assert!(
            t.len() == 6
                && t[..3].bytes().all(|b| b.is_ascii_uppercase())
                && t[4..].bytes().all(|b| b.is_ascii_digit()),
            "{t:?}"
        );
    }

    // tool_choice "required" and a named function: schema-valid tool calls.
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": false}}}
    ]);
    for (choice, want) in
        [(json!("required"), None), (json!({"type": "function", "function": {"name": "get_time"}}), Some("get_time"))]
    {
        let body = json!({"messages": msgs, "tools": tools, "tool_choice": choice, "parallel_tool_calls": false, "seed": 2, "max_tokens": 100});
        let (st, r) = post(&s, "/v1/chat/completions", body).await;
        assert_eq!(st, 200, "{r}");
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{c}");
        let name = calls[0]["function"]["name"].as_str().unwrap();
        let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        match name {
            "get_weather" => assert!(args["city"] == "Paris" || args["city"] == "Oslo", "{args}"),
            "get_time" => assert!(args["utc"].is_boolean(), "{args}"),
            other => panic!("called {other}"),
        }
        if let Some(w) = want {
            assert_eq!(name, w);
        }
    }

    // Bad constraints: 400 naming the field.
    let bad = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$dynamicRef": "#a"}}}}),
            "response_format",
        ),
        (json!({"response_format": {"type": "yaml"}}), "response_format"),
        (json!({"guided_regex": "a(b"}), "guided_regex"),
        (json!({"guided_grammar": "root ::= \"a\""}), "guided_grammar"),
        (json!({"structured_outputs": {"structural_tag": {}}}), "structured_outputs"),
        (json!({"guided_json": person(), "guided_choice": ["a"]}), "guided_choice"),
        (json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": tools, "tool_choice": "required", "guided_choice": ["a", 1]}), "guided_choice"),
    ];
    for (extra, param) in bad {
        let mut body = json!({"messages": msgs, "max_tokens": 5});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, r) = post(&s, "/v1/chat/completions", body).await;
        assert_error(st, &r, 400, Some(param));
    }

    let (_, m) = get(&s, "/metrics").await;
    assert!(metric(&m, "flint:structured_output_mask_seconds_count") > 50.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_split_from_the_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    scripted(&model, "Plan: be brief.</think>\n\n{\"city\": \"Paris\"}");
    let s = start(&["--model", model.to_str().unwrap(), "--reasoning-parser", "deepseek_r1"], Some(tmp)).await;
    let msgs = json!([{"role": "user", "content": "Capital of France?"}]);

    let (st, r) = post(&s, "/v1/chat/completions", json!({"messages": msgs})).await;
    assert_eq!(st, 200, "{r}");
    let m = &r["choices"][0]["message"];
    assert_eq!(m["reasoning"], "Plan: be brief.");
    assert_eq!(m["reasoning_content"], "Plan: be brief.");
    assert_eq!(m["content"], "{\"city\": \"Paris\"}");
    let details = &r["usage"]["completion_tokens_details"]["reasoning_tokens"];
    assert!(details.as_u64().is_some_and(|n| n > 0 && n < r["usage"]["completion_tokens"].as_u64().unwrap()), "{r}");

    // Streamed: reasoning deltas, then content deltas; the same texts.
    let events = stream(&s, "/v1/chat/completions", json!({"messages": msgs, "stream": true})).await;
    let mut reasoning = String::new();
    for e in &events {
        if let Ok(c) = serde_json::from_str::<Value>(e) {
            if let Some(t) = c["choices"][0]["delta"]["reasoning"].as_str() {
                assert_eq!(c["choices"][0]["delta"]["reasoning_content"], t);
                reasoning.push_str(t);
            }
        }
    }
    assert_eq!(reasoning, "Plan: be brief.");
    assert_eq!(streamed_content(&events, 1)[0], "{\"city\": \"Paris\"}");

    // `</think>` never arrives (cut by max_tokens): all of it is reasoning.
    let (_, r) = post(&s, "/v1/chat/completions", json!({"messages": msgs, "max_tokens": 3})).await;
    assert!(r["choices"][0]["message"]["content"] == "" || r["choices"][0]["message"]["content"].is_null(), "{r}");
    assert!(r["choices"][0]["message"]["reasoning"].as_str().is_some_and(|t| t.starts_with("Plan")), "{r}");

    // A schema applies after the reasoning: the free-text plan passes, the answer follows it.
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "c", "schema": schema}});
    let (st, r) = post(&s, "/v1/chat/completions", json!({"messages": msgs, "response_format": rf})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["reasoning"], "Plan: be brief.");
    assert_eq!(r["choices"][0]["message"]["content"], "{\"city\": \"Paris\"}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
}

/// `tool_choice: "auto"` with a `strict` tool: the model may answer in text, but a call, once
/// started, follows the tool's schema (the scripted model would say Paris; the schema allows
/// only Oslo). Without `strict` the call comes back as the model wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_tools_constrain_a_call_once_it_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    scripted(&model, r#"<tool_call>{"name": "get_weather","arguments":{"city":"Paris"}}</tool_call>"#);
    let s = start(&["--model", model.to_str().unwrap()], Some(tmp)).await;
    let msgs = json!([{"role": "user", "content": "Weather?"}]);
    // No other properties and greedy: past the script, every allowed token scores the same.
    let params = json!({"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"], "additionalProperties": false});
    for (strict, city) in [(true, "Oslo"), (false, "Paris")] {
        let tools =
            json!([{"type": "function", "function": {"name": "get_weather", "strict": strict, "parameters": params}}]);
        let (st, r) = post(
            &s,
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": tools, "max_tokens": 60, "temperature": 0}),
        )
        .await;
        assert_eq!(st, 200, "{r}");
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let args: Value =
            serde_json::from_str(c["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args["city"], city, "strict {strict}");
    }
}
