//! The real `flint serve` binary against a hostile client: a corpus of malformed requests on every
//! route (status, OpenAI's error envelope, and the server still alive afterwards), requests sized
//! to cost everyone else (huge prompts, stop lists, prompt lists, tool definitions), slow and
//! never-finished requests on raw sockets, too many connections, and shutdown with streams still
//! running at the deadline.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{metric, start, Server};
use serde_json::{json, Value};

const POST_ROUTES: [&str; 4] = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"];

/// POST raw bytes with a content type; (status, body as JSON or Null).
async fn send(s: &Server, path: &str, content_type: Option<&str>, body: Vec<u8>) -> (u16, Value) {
    let mut r = reqwest::Client::new().post(format!("{}{path}", s.base)).body(body);
    if let Some(ct) = content_type {
        r = r.header("content-type", ct);
    }
    let r = r.send().await.expect("request");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

async fn json_post(s: &Server, path: &str, body: &str) -> (u16, Value) {
    send(s, path, Some("application/json"), body.as_bytes().to_vec()).await
}

/// An error response in OpenAI's envelope with this status (and param, when given).
fn assert_envelope(what: &str, status: u16, body: &Value, want: u16, param: Option<&str>) {
    // A wrong answer may be a whole completion: show its start only.
    let shown: String = body.to_string().chars().take(400).collect();
    assert_eq!(status, want, "{what}: {shown}");
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: no envelope: {shown}");
    assert!(e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(), "{what}: {shown}");
    if let Some(p) = param {
        assert_eq!(e["param"], json!(p), "{what}: {shown}");
    }
}

async fn alive(s: &Server) {
    let r = reqwest::Client::new().get(format!("{}/health", s.base)).send().await.expect("server gone");
    assert_eq!(r.status(), 200);
}

fn addr(s: &Server) -> String {
    s.base.trim_start_matches("http://").to_string()
}

/// Write `bytes` on a fresh connection and read until the server closes it or `wait` passes:
/// (what came back, whether the server closed the connection, how long that took).
fn raw(addr: &str, bytes: &[u8], wait: Duration) -> (String, bool, Duration) {
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(wait)).expect("timeout");
    let t0 = Instant::now();
    let _ = c.write_all(bytes);
    let (mut out, mut buf) = (Vec::new(), [0u8; 4096]);
    let closed = loop {
        match c.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(_) => break false,
        }
    };
    (String::from_utf8_lossy(&out).into_owned(), closed, t0.elapsed())
}

fn status_of(response: &str) -> u16 {
    response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

fn body_of(response: &str) -> Value {
    response.split("\r\n\r\n").nth(1).and_then(|b| serde_json::from_str(b).ok()).unwrap_or(Value::Null)
}

/// Malformed bodies on every POST route, wrong methods, unknown routes, content types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_request_corpus() {
    let s = start(&["--served-model-name", "demo"], None).await;
    let deep = "[".repeat(10_000);
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("null", b"null".to_vec()),
        ("array", b"[]".to_vec()),
        ("string", b"\"x\"".to_vec()),
        ("truncated", b"{\"prompt\": \"a".to_vec()),
        ("invalid utf-8", b"{\"prompt\": \"\xff\xfe\"}".to_vec()),
        ("NaN literal", b"{\"temperature\": NaN}".to_vec()),
        ("deep nesting", deep.into_bytes()),
        ("trailing data", b"{\"prompt\": \"hi\", \"tokens\": [1]} trailing".to_vec()),
        ("two objects", b"{\"tokens\": [1]}{\"tokens\": [1]}".to_vec()),
        ("duplicate key", b"{\"prompt\": \"a\", \"prompt\": \"b\", \"tokens\": [1], \"tokens\": [2]}".to_vec()),
        (
            "nested duplicate",
            b"{\"messages\": [{\"role\": \"user\", \"role\": \"user\", \"content\": \"x\"}]}".to_vec(),
        ),
    ];
    for route in POST_ROUTES {
        for (what, body) in &bodies {
            let (st, b) = send(&s, route, Some("application/json"), body.clone()).await;
            assert_envelope(&format!("{route} {what}"), st, &b, 400, None);
        }
        // JSON is only taken as JSON: a cross-origin "simple" request (text/plain, form) is refused.
        for ct in [None, Some("text/plain"), Some("application/x-www-form-urlencoded"), Some("multipart/form-data")] {
            let (st, b) = send(&s, route, ct, br#"{"prompt": "hi", "tokens": [1]}"#.to_vec()).await;
            assert_envelope(&format!("{route} content-type {ct:?}"), st, &b, 415, None);
        }
        let (st, b) = send(&s, route, Some("application/json; charset=utf-8"), b"{}".to_vec()).await;
        assert_ne!(st, 415, "{route}: {b}");
    }
    // Wrong types name their field; bad tool definitions are refused.
    for (route, body, param) in [
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": "many"}"#, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": -1}"#, "max_tokens"),
        ("/v1/completions", r#"{"prompt": [-1, 2]}"#, "prompt"),
        ("/v1/completions", r#"{"prompt": "hi", "n": 1e9}"#, "n"),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "tools": [1]}"#, "tools"),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "banana"}]}"#,
            "tools",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]}"#,
            "tools",
        ),
        ("/tokenize", r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "banana"}]}"#, "tools"),
        ("/detokenize", r#"{"tokens": [-5]}"#, "tokens"),
    ] {
        let (st, b) = json_post(&s, route, body).await;
        assert_envelope(&format!("{route} {body}"), st, &b, 400, Some(param));
    }
    // Routes and methods.
    let c = reqwest::Client::new();
    for (method, path, want) in [
        ("GET", "/nope", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("PUT", "/tokenize", 405),
    ] {
        let r = c.request(method.parse().unwrap(), format!("{}{path}", s.base)).send().await.unwrap();
        let st = r.status().as_u16();
        let b: Value = r.json().await.unwrap_or(Value::Null);
        assert_envelope(&format!("{method} {path}"), st, &b, want, None);
    }
    // Transport-level: a bad chunk size is a 400 in the envelope, not plain text.
    let a = addr(&s);
    let (resp, _, _) = tokio::task::spawn_blocking(move || {
        raw(
            &a,
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
            Duration::from_secs(10),
        )
    })
    .await
    .unwrap();
    assert_envelope("bad chunk size", status_of(&resp), &body_of(&resp), 400, None);
    alive(&s).await;
}

/// Requests sized to cost everyone else are refused before the cost is paid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_refused_up_front() {
    let s = start(&["--max-num-seqs", "2", "--max-queued-requests", "2"], None).await;
    // Finding 1: a 15 MB prompt is refused as over the context without tokenizing all of it;
    // /tokenize too (before: 200 with a 3-million-token count and gigabytes of memory).
    let huge = "lorem ipsum dolor sit amet ".repeat(555_000);
    for (route, body) in [
        ("/tokenize", json!({"prompt": huge})),
        ("/v1/completions", json!({"prompt": huge, "max_tokens": 1})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 1})),
    ] {
        let (st, b) = json_post(&s, route, &body.to_string()).await;
        assert_envelope(route, st, &b, 400, None);
        assert_eq!(b["error"]["code"], "context_length_exceeded", "{route}: {b}");
        let counted = b["error"]["message"].as_str().unwrap_or("");
        assert!(counted.contains("maximum context length is 4096"), "{route}: {b}");
    }
    // Finding 2: /tokenize runs off the async workers: /health and a small chat answer while two
    // of those run (before: stalled for seconds behind them).
    let (s2, h2) = (s.base.clone(), huge.clone());
    let big = (0..2)
        .map(|_| {
            let (base, text) = (s2.clone(), h2.clone());
            tokio::spawn(async move {
                reqwest::Client::new().post(format!("{base}/tokenize")).json(&json!({"prompt": text})).send().await
            })
        })
        .collect::<Vec<_>>();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let t0 = Instant::now();
    alive(&s).await;
    let health = t0.elapsed();
    for b in big {
        assert_eq!(b.await.unwrap().unwrap().status(), 400);
    }
    assert!(health < Duration::from_secs(3), "/health took {health:?} behind two big /tokenize requests");

    // Finding 3: one request larger than its share of what the server holds (prompts × n; half
    // of running + queued, here 2 of 4) is refused, whatever the load; before, it was admitted
    // into an idle server and locked everyone else out.
    let many = json!({"prompt": vec![vec![5, 6, 7]; 50_000], "max_tokens": 1});
    let (st, b) = json_post(&s, "/v1/completions", &many.to_string()).await;
    assert_envelope("50,000 prompts", st, &b, 400, Some("prompt"));
    let three = json!({"prompt": vec![vec![5, 6, 7]; 3], "max_tokens": 1});
    let (st, b) = json_post(&s, "/v1/completions", &three.to_string()).await;
    assert_envelope("3 prompts over a share of 2", st, &b, 400, Some("prompt"));
    let (st, b) =
        json_post(&s, "/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "x"}], "n": 3}"#).await;
    assert_envelope("n = 3 over a share of 2", st, &b, 400, Some("n"));
    let two = json!({"prompt": vec![vec![5, 6, 7]; 2], "max_tokens": 1});
    let (st, b) = json_post(&s, "/v1/completions", &two.to_string()).await;
    assert_eq!(st, 200, "a request of exactly its share runs: {b}");

    // Finding 4: stop lists and the rest of the per-request costs are bounded.
    let stops = json!({"prompt": "hi", "max_tokens": 2, "stop": vec!["x".repeat(1024); 15_000]});
    let (st, b) = json_post(&s, "/v1/completions", &stops.to_string()).await;
    assert_envelope("15,000 stop strings", st, &b, 400, Some("stop"));
    let long_stop = json!({"prompt": "hi", "max_tokens": 2, "stop": ["y".repeat(5000)]});
    let (st, b) = json_post(&s, "/v1/completions", &long_stop.to_string()).await;
    assert_envelope("a 5 KB stop string", st, &b, 400, Some("stop"));
    let bias: serde_json::Map<String, Value> = (0..5000).map(|i| (i.to_string(), json!(1))).collect();
    let (st, b) = json_post(&s, "/v1/completions", &json!({"prompt": "hi", "logit_bias": bias}).to_string()).await;
    assert_envelope("5,000 logit_bias entries", st, &b, 400, Some("logit_bias"));
    let tools: Vec<Value> =
        (0..200).map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}})).collect();
    let body = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools});
    let (st, b) = json_post(&s, "/v1/chat/completions", &body.to_string()).await;
    assert_envelope("200 tools", st, &b, 400, Some("tools"));
    alive(&s).await;
}

/// Slow, unfinished and too many connections (finding 6), and aborts counted as vLLM counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_dropped_and_connections_bounded() {
    let s = start(&["--header-timeout", "1", "--body-timeout", "1", "--max-connections", "6"], None).await;
    let a = addr(&s);
    let cases = tokio::task::spawn_blocking(move || {
        // Half-sent headers: closed after the header timeout.
        let headers = raw(&a, b"POST /tokenize HTTP/1.1\r\nHost: x\r\n", Duration::from_secs(10));
        // Headers, then a body that never completes: 408 in the envelope after the body timeout.
        let body = raw(
            &a,
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pr",
            Duration::from_secs(10),
        );
        // A declared length past the limit: 413 at once, nothing read.
        let declared = raw(
            &a,
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 99999999999\r\n\r\n{\"pr",
            Duration::from_secs(10),
        );
        (headers, body, declared)
    })
    .await
    .unwrap();
    let (headers, body, declared) = cases;
    assert!(headers.1 && headers.2 < Duration::from_secs(8), "half-sent headers kept open: {headers:?}");
    assert_envelope("unfinished body", status_of(&body.0), &body_of(&body.0), 408, None);
    assert!(body.2 < Duration::from_secs(8), "{body:?}");
    assert_envelope("declared 100 GB", status_of(&declared.0), &body_of(&declared.0), 413, None);

    // Slowloris, one byte every 100 ms: dropped at the header timeout, not served forever.
    let a = addr(&s);
    let slow = tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(&a).expect("connect");
        let t0 = Instant::now();
        for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ".iter().chain(std::iter::repeat(&b'a')) {
            if c.write_all(&[*b]).is_err() || t0.elapsed() > Duration::from_secs(10) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        t0.elapsed()
    })
    .await
    .unwrap();
    assert!(slow < Duration::from_secs(8), "a slowloris client was served for {slow:?}");

    // More connections than --max-connections: the extra one is told so in the envelope.
    let idle: Vec<TcpStream> = (0..6).map(|_| TcpStream::connect(addr(&s)).expect("connect")).collect();
    let a = addr(&s);
    let (resp, closed, _) = tokio::task::spawn_blocking(move || {
        raw(&a, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", Duration::from_secs(5))
    })
    .await
    .unwrap();
    assert_envelope("connection over the limit", status_of(&resp), &body_of(&resp), 503, None);
    assert!(closed);
    drop(idle);
    tokio::time::sleep(Duration::from_millis(200)).await;
    alive(&s).await;

    // A client that goes away mid-stream: counted as finished with reason abort, as vLLM does.
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{}/v1/completions", s.base))
        .json(&json!({"prompt": "Hello", "max_tokens": 2000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    drop(r);
    let t0 = Instant::now();
    loop {
        let text = c.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
        let aborted = metric(&text, "vllm:request_success_total{model_name=\"flint-demo\",finished_reason=\"abort\"}");
        if aborted == 1.0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "abort not counted: {aborted}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Finding 5: during the grace period new requests and /health get 503 in the envelope (not a
/// refused connection), and streams still running at the deadline end with an error event and
/// `[DONE]`, never a cut connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_tells_every_client_what_happened() {
    let mut s = start(&["--shutdown-grace", "2"], None).await;
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let url = format!("{}/v1/completions", s.base);
            tokio::spawn(async move {
                let body = json!({"prompt": "Hello", "max_tokens": 4000, "ignore_eos": true, "stream": true});
                let r = reqwest::Client::new().post(url).json(&body).send().await.expect("stream");
                assert_eq!(r.status(), 200);
                r.text().await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = reqwest::Client::new();
    let r = c.get(format!("{}/health", s.base)).send().await.expect("/health refused during the grace period");
    let st = r.status().as_u16();
    assert_envelope("/health in the grace period", st, &r.json().await.unwrap_or(Value::Null), 503, None);
    let (st, b) = json_post(&s, "/v1/completions", r#"{"prompt": "hi", "max_tokens": 1}"#).await;
    assert_envelope("a new request in the grace period", st, &b, 503, None);
    for h in streams {
        let text = h.await.unwrap().expect("the stream was cut instead of ended");
        let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
        let n = events.len();
        assert!(n >= 2 && events[n - 1] == "[DONE]", "no [DONE] at the end: {:?}", &events[n.saturating_sub(3)..]);
        let err: Value = serde_json::from_str(events[n - 2]).unwrap_or(Value::Null);
        assert_eq!(err["error"]["code"], "service_unavailable", "{}", events[n - 2]);
    }
    let t0 = Instant::now();
    while s.child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(20), "the server did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}
