//! The real `flint serve` binary against the second hardening round's requests: nested tool
//! schemas (Pydantic's `$defs`), bodies of hundreds of thousands of messages, forced tool calls
//! with an output format, one request sized to take the whole queue, tool arguments as the model
//! wrote them, gauges that a `sum()` doubled, and the small refusals that answered 200.

mod common;

use common::{assert_error, get, post, scripted, start, Server};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";

fn user() -> Value {
    json!([{"role": "user", "content": "Go."}])
}

/// What `openai.pydantic_function_tool` sends for a model with a nested model and a list of an
/// enum: the nested parts are `$defs` the parameters refer to.
fn nested_tool() -> Value {
    json!({"type": "function", "function": {"name": "save_order", "strict": true, "parameters": {
        "type": "object",
        "properties": {
            "customer": {"$ref": "#/$defs/Customer"},
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2}
        },
        "required": ["customer", "items"],
        "additionalProperties": false,
        "$defs": {
            "Customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                         "required": ["name"], "additionalProperties": false},
            "Item": {"type": "object", "properties": {"sku": {"enum": ["A1", "B2"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                     "required": ["sku", "qty"], "additionalProperties": false}
        }
    }}})
}

fn check_order(arguments: &str) {
    let v: Value = serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments}"));
    assert!(v["customer"]["name"].as_str().is_some_and(|n| n.chars().count() <= 8), "{v}");
    for item in v["items"].as_array().unwrap_or_else(|| panic!("{v}")) {
        assert!(item["sku"] == "A1" || item["sku"] == "B2", "{v}");
        assert!(item["qty"].as_u64().is_some_and(|q| (1..=9).contains(&q)), "{v}");
    }
}

async fn alive(s: &Server) {
    assert_eq!(get(s, "/health").await.0, 200, "the server is gone");
}

/// Findings 2 and 6: a nested tool schema works forced (required, named) and under strict
/// `auto`, and a forced call wins over `response_format` (before: 400 for each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_tool_schemas_and_forced_calls_with_a_format() {
    let s = start(&[], None).await;
    let named = json!({"type": "function", "function": {"name": "save_order"}});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
    for (choice, format) in
        [(json!("required"), None), (named.clone(), None), (json!("required"), Some(rf.clone())), (named, Some(rf))]
    {
        let mut body = json!({"messages": user(), "tools": [nested_tool()], "tool_choice": choice, "max_tokens": 120});
        if let Some(f) = format {
            body["response_format"] = f;
        }
        let (st, b) = post(&s, CHAT, body).await;
        assert_eq!(st, 200, "{b}");
        let calls = b["choices"][0]["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{b}"));
        assert_eq!(calls[0]["function"]["name"], "save_order");
        check_order(calls[0]["function"]["arguments"].as_str().unwrap());
    }
    alive(&s).await;
}

/// Finding 4: a 13.6 MB body of 420,000 messages is refused by count before it is built, off
/// the async workers (before: /health stalled 4.4 s, and 8.5 s and 0.74 GB per request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_conversations_are_refused_by_count() {
    let s = start(&[], None).await;
    let mut body = String::from("{\"temperature\": 9, \"messages\": [");
    for i in 0..420_000 {
        body.push_str(if i == 0 {
            "{\"role\":\"user\",\"content\":\"x\"}"
        } else {
            ",{\"role\":\"user\",\"content\":\"x\"}"
        });
    }
    body.push_str("]}");
    assert!(body.len() > 12 << 20);
    let big: Vec<_> = (0..2)
        .map(|_| {
            let (url, body) = (format!("{}{CHAT}", s.base), body.clone());
            tokio::spawn(async move {
                let r = reqwest::Client::new().post(url).header("content-type", "application/json").body(body);
                let r = r.send().await.expect("request");
                (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
            })
        })
        .collect();
    for h in big {
        let (st, b) = h.await.unwrap();
        assert_error(st, &b, 400, Some("messages"));
        assert!(b["error"]["message"].as_str().unwrap().contains("420000 messages"), "{b}");
    }
    // The Responses API counts its `input` the same way, and names it.
    let items = vec![json!({"role": "user", "content": "x"}); 9000];
    let (st, b) = post(&s, "/v1/responses", json!({"input": items})).await;
    assert_error(st, &b, 400, Some("input"));
    // /detokenize counts its ids before building them.
    let ids = format!("{{\"tokens\": [{}]}}", vec!["1"; (1 << 20) + 1].join(","));
    let r = reqwest::Client::new().post(format!("{}/detokenize", s.base)).header("content-type", "application/json");
    let r = r.body(ids).send().await.unwrap();
    let st = r.status().as_u16();
    assert_error(st, &r.json().await.unwrap(), 400, Some("tokens"));
    alive(&s).await;
}

/// Finding 7: one request may hold at most half of what the server admits, so others still get
/// in; `--max-seqs-per-request` sets the share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_cannot_take_the_whole_queue() {
    let s = start(&["--max-num-seqs", "4", "--max-queued-requests", "4"], None).await;
    let prompts = |n: usize| json!({"prompt": vec![vec![5, 6, 7]; n], "max_tokens": 1});
    let (st, b) = post(&s, "/v1/completions", prompts(5)).await;
    assert_error(st, &b, 400, Some("prompt"));
    assert!(b["error"]["message"].as_str().unwrap().contains("at most 4"), "{b}");
    let (st, b) = post(&s, "/v1/completions", prompts(4)).await;
    assert_eq!(st, 200, "{b}");
    let (st, b) = post(&s, CHAT, json!({"messages": user(), "n": 5, "max_tokens": 1})).await;
    assert_error(st, &b, 400, Some("n"));
    drop(s);
    let s = start(&["--max-num-seqs", "4", "--max-queued-requests", "4", "--max-seqs-per-request", "6"], None).await;
    let (st, b) = post(&s, "/v1/completions", prompts(6)).await;
    assert_eq!(st, 200, "{b}");
}

/// Finding 8: arguments come back as the model wrote them (before, `1.50` came back `1.5`, and
/// a 26-digit integer as a float).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_arguments_are_the_models_text() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    scripted(&model, r#"<tool_call>{"name":"f","arguments":{"x":1.50}}</tool_call>"#);
    let s = start(&["--model", model.to_str().unwrap()], Some(dir)).await;
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let (st, b) = post(&s, CHAT, json!({"messages": user(), "tools": tools, "max_tokens": 40})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], r#"{"x":1.50}"#, "{b}");
    let (st, b) =
        post(&s, "/v1/responses", json!({"input": "Go.", "tools": [{"type": "function", "name": "f"}]})).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["output"][0]["arguments"], r#"{"x":1.50}"#, "{b}");
}

/// Finding 9: vLLM's series are the server's totals alone; per-worker series have names of
/// their own, so a `sum()` over vLLM's name counts each request once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_are_not_doubled() {
    let s = start(&[], None).await;
    let (_, text) = get(&s, "/metrics").await;
    let vllm: Vec<&str> = text.lines().filter(|l| l.starts_with("vllm:num_requests_running")).collect();
    assert_eq!(vllm.len(), 1, "{vllm:?}");
    assert!(text.lines().any(|l| l.starts_with("flint:worker_num_requests_running{") && l.contains("worker=")));
    assert!(!text.lines().any(|l| l.starts_with("vllm:") && l.contains("worker=\"")), "{text}");
}

/// Finding 10: small requests that answered 200, and the route lm-eval's remote tokenizer needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_refusals_and_tokenizer_info() {
    let s = start(&[], None).await;
    let (st, b) = post(&s, "/detokenize", json!({})).await;
    assert_error(st, &b, 400, None);
    let (st, b) = post(&s, "/v1/completions", json!({"prompt": "hi", "max_tokens": 1, "logit_bias": {"+5": 1}})).await;
    assert_error(st, &b, 400, Some("logit_bias"));
    let (st, b) = post(
        &s,
        CHAT,
        json!({"messages": user(), "continue_final_message": true, "add_generation_prompt": false, "max_tokens": 1}),
    )
    .await;
    assert_error(st, &b, 400, Some("continue_final_message"));
    let (st, b) = post(&s, "/v1/responses", json!({"input": "hi", "max_output_tokens": 0})).await;
    assert_error(st, &b, 400, Some("max_output_tokens"));
    let m = b["error"]["message"].as_str().unwrap();
    assert!(m.contains("max_output_tokens") && !m.contains("`max_tokens`"), "{m}");
    let (st, text) = get(&s, "/tokenizer_info").await;
    assert_eq!(st, 200, "{text}");
    let info: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(info["eos_token"], "<|im_end|>");
    assert!(info["chat_template"].as_str().is_some_and(|t| t.contains("im_start")), "{info}");
    assert!(info["model_max_length"].as_u64().is_some_and(|n| n > 0));
    // What the remote tokenizer then does: encode with /tokenize and find EOS among the ids.
    let (st, b) = post(&s, "/tokenize", json!({"prompt": "<|im_end|>", "add_special_tokens": false})).await;
    assert_eq!(st, 200, "{b}");
    assert!(info["eos_token_ids"].as_array().unwrap().contains(&b["tokens"][0]), "{info} {b}");
    alive(&s).await;
}
