//! The real `flint serve` binary over HTTP: every endpoint, streaming and not, each error status,
//! API keys, the bounded queue (429), client disconnects (blocks back in the pool), a scripted
//! model's tool calls and stop strings, and graceful shutdown.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{assert_error, flint, get, metric, post, scripted, start, stream};
use futures_util::StreamExt;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_streaming_and_errors_on_the_demo_model() {
    let s = start(&["--served-model-name", "demo"], None).await;
    assert!(s.early_health.contains(&503), "/health must say 503 while loading: {:?}", s.early_health);

    let (st, models) = get(&s, "/v1/models").await;
    assert_eq!(st, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "demo");
    assert!(models["data"][0]["max_model_len"].as_u64().unwrap() > 0);
    let (st, v) = get(&s, "/version").await;
    assert_eq!(st, 200);
    assert!(v.contains("version"));
    assert!(v.contains(r#""devices":["cpu"]"#), "{v}");

    // Chat, non-streaming, n = 2, seeded sampling, logprobs.
    let body = json!({"model": "demo", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 1, "logprobs": true, "top_logprobs": 2, "user": "ignored", "store": false});
    let (st, a) = post(&s, "/v1/chat/completions", body.clone()).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"].as_array().unwrap().len(), 2);
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["choices"][0]["logprobs"]["content"].as_array().unwrap().len(), 6);
    assert_eq!(a["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(a["usage"]["completion_tokens"], 12);
    assert_eq!(a["usage"]["total_tokens"], a["usage"]["prompt_tokens"].as_u64().unwrap() + 12);
    assert!(a["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    let (_, b) = post(&s, "/v1/chat/completions", body).await;
    assert_eq!(a["choices"][1]["message"], b["choices"][1]["message"], "a seed reproduces the samples");

    // Chat, streaming with include_usage: role first, one id, finish on the last content chunk,
    // usage chunk with empty choices, then [DONE].
    let events = stream(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"] && c["object"] == "chat.completion.chunk"));
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    let last_content = &chunks[chunks.len() - 2];
    assert_eq!(last_content["choices"][0]["finish_reason"], "length");
    let finishes =
        chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null() && c["choices"] != json!([])).count();
    assert_eq!(finishes, 1);
    // Without include_usage: no usage chunk.
    let events = stream(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": true}),
    )
    .await;
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));

    // Completions: token-id prompt list, echo + logprobs (prompt logprobs), n.
    let (st, c) = post(&s, "/v1/completions", json!({"prompt": [[9707, 1879, 11], [3838]], "max_tokens": 3, "logprobs": 1, "echo": true, "n": 2, "temperature": 0})).await;
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["choices"].as_array().unwrap().len(), 4);
    let lp = &c["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3 + 3);
    assert!(lp["token_logprobs"][0].is_null(), "the first prompt token has no logprob");
    assert!(lp["token_logprobs"][1].is_f64());
    assert!(c["choices"][0]["text"].as_str().unwrap().starts_with("Hello world,"));
    assert_eq!(c["choices"][0]["text"], c["choices"][1]["text"], "greedy samples agree");
    assert_eq!(c["usage"]["prompt_tokens"], 4);
    let events = stream(
        &s,
        "/v1/completions",
        json!({"prompt": "Once", "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 3);

    // Tokenize (text and chat), detokenize.
    let (st, t) = post(&s, "/tokenize", json!({"prompt": "Hello world"})).await;
    assert_eq!((st, t["tokens"].clone()), (200, json!([9707, 1879])));
    let (_, t) = post(&s, "/tokenize", json!({"messages": [{"role": "user", "content": "Hi"}]})).await;
    assert!(t["prompt"].as_str().unwrap().contains("<|im_start|>user\nHi<|im_end|>"), "{t}");
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    let (st, d) = post(&s, "/detokenize", json!({"tokens": [9707, 1879]})).await;
    assert_eq!((st, d["prompt"].clone()), (200, json!("Hello world")));

    // Errors: 400 naming the parameter, context overflow in vLLM's words, 404 model and route.
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    for (extra, param) in [
        (json!({"temperature": -1}), "temperature"),
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"n": 0}), "n"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"logit_bias": {"nope": 1}}), "logit_bias"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages"),
        (
            json!({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tool_choice",
        ),
    ] {
        let (st, e) = post(&s, "/v1/chat/completions", chat(extra.clone())).await;
        assert_error(st, &e, 400, Some(param));
    }
    let (st, e) = post(&s, "/v1/chat/completions", chat(json!({"max_tokens": 100000}))).await;
    assert_error(st, &e, 400, Some("messages"));
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("This model's maximum context length is 4096 tokens. However, you requested"), "{msg}");
    let (st, e) = post(&s, "/v1/completions", json!({"prompt": "x", "max_tokens": 2, "echo": "yes"})).await;
    assert_error(st, &e, 400, Some("echo"));
    let (st, e) = post(&s, "/v1/completions", json!({"prompt": [], "max_tokens": 2})).await;
    assert_error(st, &e, 400, Some("prompt"));
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let (st, e) = post(&s, "/v1/chat/completions", chat(json!({"model": "gpt-4"}))).await;
    assert_error(st, &e, 404, Some("model"));
    assert_eq!(e["error"]["code"], "model_not_found");
    let (st, e) = post(&s, "/v1/nothing", json!({})).await;
    assert_error(st, &e, 404, None);

    // Metrics with vLLM's names.
    let (st, m) = get(&s, "/metrics").await;
    assert_eq!(st, 200);
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "flint:request_failure_total",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics");
    }
    assert!(metric(&m, "flint:request_failure_total{model_name=\"demo\",reason=\"validation\"}") >= 14.0, "{m}");
    assert_eq!(
        metric(&m, "flint:request_failure_total{model_name=\"demo\",reason=\"aborted\"}"),
        0.0,
        "refusals are not client aborts: {m}"
    );
    let (st, _) = get(&s, "/v1/models/demo").await;
    assert_eq!(st, 200);
    let (st, body) = get(&s, "/v1/models/other").await;
    assert_eq!(st, 404, "{body}");
    let (st, body) = get(&s, "/v1/chat/completions").await;
    assert_eq!(st, 405);
    assert!(body.contains("\"error\""), "{body}");
    assert!(metric(&m, "vllm:request_success_total{model_name=\"demo\",finished_reason=\"length\"}") >= 5.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_body_limit_queue_and_disconnects() {
    let s = start(
        &[
            "--api-key",
            "sekret",
            "--max-num-seqs",
            "1",
            "--max-queued-requests",
            "1",
            "--max-seqs-per-request",
            "2",
            "--max-request-body",
            "2K",
        ],
        None,
    )
    .await;
    let c = reqwest::Client::new();
    // /health and /metrics need no key (probes and scrapers); everything else does.
    assert_eq!(c.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(c.get(format!("{}/metrics", s.base)).send().await.unwrap().status(), 200);
    for auth in [None, Some("Bearer wrong"), Some("sekret")] {
        let mut r = c.get(format!("{}/v1/models", s.base));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 401);
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "invalid_api_key");
    }
    let authed = |path: &str| c.post(format!("{}{path}", s.base)).bearer_auth("sekret");
    assert_eq!(c.get(format!("{}/v1/models", s.base)).bearer_auth("sekret").send().await.unwrap().status(), 200);

    // 413 past --max-request-body.
    let big = json!({"prompt": "x".repeat(4000), "max_tokens": 1});
    let r = authed("/v1/completions").json(&big).send().await.unwrap();
    assert_eq!(r.status(), 413);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "request_too_large");

    // One running + one queued; the third gets 429 with Retry-After.
    let long = json!({"prompt": "Hello", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let first = authed("/v1/completions").json(&long).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let mut first = first.bytes_stream();
    first.next().await.expect("first chunk").unwrap();
    // The limit counts engine sequences: two more samples do not fit beside the running one.
    let mut two = long.clone();
    two["n"] = json!(2);
    let r = authed("/v1/completions").json(&two).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let second = authed("/v1/completions").json(&long).send().await.unwrap();
    assert_eq!(second.status(), 200);
    let third = authed("/v1/completions").json(&long).send().await.unwrap();
    assert_eq!(third.status(), 429);
    assert!(third.headers().contains_key("retry-after"));
    let e: Value = third.json().await.unwrap();
    assert_eq!(e["error"]["type"], "server_overloaded");

    // Both clients walk away mid-stream: their requests are aborted, the blocks come back.
    drop(first);
    drop(second);
    let t0 = Instant::now();
    loop {
        let m = c.get(format!("{}/metrics", s.base)).bearer_auth("sekret").send().await.unwrap().text().await.unwrap();
        let running = metric(&m, "vllm:num_requests_running");
        let usage = metric(&m, "vllm:kv_cache_usage_perc");
        let aborted = metric(&m, "flint:request_failure_total{model_name=\"flint-demo\",reason=\"aborted\"}");
        if running == 0.0 && usage == 0.0 && aborted >= 2.0 {
            assert_eq!(metric(&m, "vllm:num_requests_waiting"), 0.0);
            assert!(metric(&m, "flint:request_failure_total{model_name=\"flint-demo\",reason=\"overloaded\"}") >= 1.0);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "blocks not freed after disconnect: {m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A non-streaming request whose client times out is aborted too.
    let r = c
        .post(format!("{}/v1/completions", s.base))
        .bearer_auth("sekret")
        .timeout(Duration::from_millis(300))
        .json(&json!({"prompt": "Hello", "max_tokens": 3000, "ignore_eos": true}))
        .send()
        .await;
    assert!(r.is_err(), "the request should have timed out");
    let t0 = Instant::now();
    loop {
        let m = c.get(format!("{}/metrics", s.base)).bearer_auth("sekret").send().await.unwrap().text().await.unwrap();
        if metric(&m, "vllm:num_requests_running") == 0.0 && metric(&m, "vllm:kv_cache_usage_perc") == 0.0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "non-streaming abort did not free blocks: {m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_model_tool_calls_and_stop_strings() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    scripted(&model, r#"<tool_call>{"name": "get_weather","arguments":{"city":"Paris"}}</tool_call>"#);
    let s = start(&["--model", model.to_str().unwrap(), "--served-model-name", "scripted"], Some(tmp)).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let msgs = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let (st, r) = post(&s, "/v1/chat/completions", json!({"messages": msgs, "tools": tools})).await;
    assert_eq!(st, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(choice["message"]["content"].is_null());
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    // Streamed: a tool-call delta, never the raw tag as content.
    let events = stream(&s, "/v1/chat/completions", json!({"messages": msgs, "tools": tools, "stream": true})).await;
    assert!(events.iter().all(|e| !e.contains("<tool_call>")), "{events:?}");
    assert!(events.iter().any(|e| e.contains("\"tool_calls\"") && e.contains("get_weather")));
    assert!(events.iter().any(|e| e.contains("\"finish_reason\":\"tool_calls\"")));
    // Without tools, the text comes back as content.
    let (_, r) = post(&s, "/v1/chat/completions", json!({"messages": msgs})).await;
    assert!(r["choices"][0]["message"]["content"].as_str().unwrap().starts_with("<tool_call>"));
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // The tool result rendered back into the prompt (tool role, assistant tool_calls).
    let follow = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22C and sunny"}
    ]);
    let (st, t) = post(&s, "/tokenize", json!({"messages": follow, "tools": tools})).await;
    assert_eq!(st, 200, "{t}");
    let prompt = t["prompt"].as_str().unwrap();
    assert!(prompt.contains("22C and sunny") && prompt.contains("get_weather"), "{prompt}");
    // Stop strings: cut before the match (or including it), and never streamed in part.
    let (_, r) = post(&s, "/v1/chat/completions", json!({"messages": msgs, "stop": ["weather\",\"arg"]})).await;
    assert_eq!(r["choices"][0]["message"]["content"], "<tool_call>{\"name\": \"get_");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["choices"][0]["stop_reason"], "weather\",\"arg");
    let events =
        stream(&s, "/v1/chat/completions", json!({"messages": msgs, "stop": "weather\",\"arg", "stream": true})).await;
    let text: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "<tool_call>{\"name\": \"get_");
    let (_, r) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": msgs, "stop": ["Paris"], "include_stop_str_in_output": true}),
    )
    .await;
    assert!(r["choices"][0]["message"]["content"].as_str().unwrap().ends_with("Paris"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_then_exits() {
    let mut s = start(&[], None).await;
    let c = reqwest::Client::new();
    let url = format!("{}/v1/completions", s.base);
    let req = tokio::spawn(async move {
        let r =
            c.post(url).json(&json!({"prompt": "Hello", "max_tokens": 40, "ignore_eos": true})).send().await.unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let (st, body) = req.await.unwrap();
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 40, "the in-flight request completes");
    let t0 = Instant::now();
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status:?}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `--kv-cache-dtype int8`: requests long enough to fill several 128-token blocks (and hit the
/// prefix cache) are served, greedy output repeats, `/metrics` reports the cache's type, bytes per
/// token and capacity; vLLM's fp8 is refused at start-up with the values flint takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn int8_kv_cache_serves_and_reports_itself() {
    let s = start(&["--served-model-name", "demo", "--kv-cache-dtype", "int8", "--kv-cache-memory", "32M"], None).await;
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let body = json!({"prompt": long, "max_tokens": 40, "ignore_eos": true, "temperature": 0});
    let (st, a) = post(&s, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{a}");
    assert!(a["usage"]["prompt_tokens"].as_u64().unwrap() > 300, "{a}");
    assert_eq!(a["usage"]["completion_tokens"], 40);
    let (_, b) = post(&s, "/v1/completions", body).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "greedy output changed on a prefix-cache hit");
    assert!(b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) >= 256, "{b}");
    let (_, m) = get(&s, "/metrics").await;
    let info = m.lines().find(|l| l.starts_with("vllm:cache_config_info{")).unwrap_or("");
    assert!(info.contains("cache_dtype=\"int8\"") && info.contains("block_size=\"128\""), "{info}");
    let bytes = metric(&m, "flint:kv_cache_bytes_per_token{model_name=\"demo\"}");
    let capacity = metric(&m, "flint:kv_cache_capacity_tokens{model_name=\"demo\"}");
    assert!(bytes > 0.0 && capacity >= 32.0 * 1048576.0 / bytes - 128.0, "{bytes} bytes/token, {capacity} tokens");
    drop(s);

    let out = flint().args(["serve", "--port", "0", "--kv-cache-dtype", "fp8"]).output().unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fp8") && err.contains("auto, f32, bf16, int8"), "{err}");
}

/// `--speculative-config` with n-gram lookup: a repetitive prompt's greedy completion is the
/// same text as without speculation, `/metrics` reports vLLM's `spec_decode` counters with
/// drafts accepted, and a bad config is one line at start-up naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ngram_speculation_serves_the_same_greedy_text_and_reports_acceptance() {
    let body = json!({"prompt": "one two three four five six seven eight one two three four five six seven eight one two",
                      "max_tokens": 64, "ignore_eos": true, "temperature": 0});
    let plain = start(&["--served-model-name", "demo"], None).await;
    let (st, want) = post(&plain, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{want}");
    drop(plain);
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}"#;
    let s = start(&["--served-model-name", "demo", "--speculative-config", spec], None).await;
    let (st, got) = post(&s, "/v1/completions", body).await;
    assert_eq!(st, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "speculation changed greedy text");
    assert_eq!(got["usage"]["completion_tokens"], 64);
    let (_, m) = get(&s, "/metrics").await;
    let drafts = metric(&m, "vllm:spec_decode_num_drafts_total{model_name=\"demo\"}");
    let drafted = metric(&m, "vllm:spec_decode_num_draft_tokens_total{model_name=\"demo\"}");
    let accepted = metric(&m, "vllm:spec_decode_num_accepted_tokens_total{model_name=\"demo\"}");
    let first = metric(&m, "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"demo\",position=\"0\"}");
    assert!(drafts > 0.0 && accepted > 0.0 && accepted <= drafted && first <= drafts, "{m}");
    // `bench serve` reports the counters over its run, as vLLM's does.
    let out = flint()
        .args(["bench", "serve", "--base-url", &s.base, "--num-prompts", "2", "--random-input-len", "16"])
        .args(["--random-output-len", "24"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("Speculative Decoding") && text.contains("Acceptance length:"), "{text}");
    drop(s);

    let out = flint()
        .args(["serve", "--port", "0", "--speculative-config", r#"{"method": "ngram", "num_speculative_tokens": 0}"#])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("num_speculative_tokens") && err.lines().filter(|l| !l.trim().is_empty()).count() <= 3,
        "{err}"
    );
}

/// Prompt scoring as evaluation harnesses do it (`echo` with `max_tokens: 0`), vLLM's
/// `prompt_logprobs`, and `--max-logprobs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_scoring_prompt_logprobs_and_max_logprobs() {
    let s = start(&["--max-logprobs", "5"], None).await;
    let (st, r) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "Hello world, again", "echo": true, "max_tokens": 0, "logprobs": 1}),
    )
    .await;
    assert_eq!(st, 200, "{r}");
    let c = &r["choices"][0];
    assert_eq!(c["text"], "Hello world, again");
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 0);
    let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len() as u64, r["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(lps[0].is_null() && lps[1..].iter().all(|l| l.as_f64().is_some_and(|l| l <= 0.0)), "{c}");
    let (st, r) = post(&s, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 0})).await;
    assert_error(st, &r, 400, Some("max_tokens"));

    // --max-logprobs 5: 5 is fine, 6 names its field.
    let (st, r) = post(&s, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 1, "logprobs": 5})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["logprobs"]["top_logprobs"][0].as_object().unwrap().len(), 5);
    let (st, r) = post(&s, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 1, "logprobs": 6})).await;
    assert_error(st, &r, 400, Some("logprobs"));
    let body =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": true, "top_logprobs": 6});
    let (st, r) = post(&s, "/v1/chat/completions", body).await;
    assert_error(st, &r, 400, Some("top_logprobs"));

    // prompt_logprobs: per choice on completions, at the top on chat; not with streaming.
    let (st, r) =
        post(&s, "/v1/completions", json!({"prompt": [11, 22, 33, 44], "max_tokens": 2, "prompt_logprobs": 2})).await;
    assert_eq!(st, 200, "{r}");
    let pl = r["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(pl.len(), 4);
    assert!(pl[0].is_null());
    for (i, id) in [(1, "22"), (2, "33"), (3, "44")] {
        let e = pl[i].as_object().unwrap();
        assert!(e.contains_key(id) && e.len() <= 3, "{e:?}");
        assert!(e[id]["logprob"].as_f64().is_some_and(|l| l <= 0.0));
    }
    let (st, r) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}),
    )
    .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["prompt_logprobs"].as_array().unwrap().len() as u64, r["usage"]["prompt_tokens"].as_u64().unwrap());
    let (st, r) = post(&s, "/v1/completions", json!({"prompt": "Hi", "prompt_logprobs": 1, "stream": true})).await;
    assert_error(st, &r, 400, Some("prompt_logprobs"));
}
