//! Observability against the real binary: request spans exported over OTLP/HTTP to a collector
//! (a minimal one in this test) with vLLM's name and attributes, children of the client's
//! `traceparent`; and `--trace-dir` writing a Chrome trace whose scopes nest as the engine runs.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use common::{flint, post, start_with_env, stream};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::{json, Value};

/// An OTLP/HTTP collector: every POST body to /v1/traces, decoded, goes down the channel.
fn collector() -> (String, Receiver<ExportTraceServiceRequest>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for conn in listener.incoming().map_while(Result::ok) {
            let tx = tx.clone();
            std::thread::spawn(move || serve_connection(conn, tx));
        }
    });
    (format!("http://{addr}"), rx)
}

fn serve_connection(conn: TcpStream, tx: Sender<ExportTraceServiceRequest>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line.trim().is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap();
                }
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        assert!(request_line.starts_with("POST /v1/traces "), "{request_line}");
        let _ = tx.send(ExportTraceServiceRequest::decode(body.as_slice()).expect("an OTLP protobuf body"));
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n");
    }
}

/// The `llm_request` spans received until `want` of them arrived, keyed by `gen_ai.request.id`.
fn spans(rx: &Receiver<ExportTraceServiceRequest>, want: usize) -> (HashMap<String, Span>, Vec<String>) {
    let (mut out, mut services) = (HashMap::new(), Vec::new());
    while out.len() < want {
        let req = rx.recv_timeout(Duration::from_secs(30)).expect("the collector got no spans within 30 s");
        for rs in req.resource_spans {
            let resource = rs.resource.unwrap_or_default();
            services
                .extend(resource.attributes.iter().filter(|a| a.key == "service.name").map(|a| text(a.value.as_ref())));
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                assert_eq!(span.name, "llm_request");
                let id = text(attr(&span, "gen_ai.request.id"));
                out.insert(id, span);
            }
        }
    }
    (out, services)
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a opentelemetry_proto::tonic::common::v1::AnyValue> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref())
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        other => panic!("expected a string attribute, got {other:?}"),
    }
}

fn int(span: &Span, key: &str) -> i64 {
    match attr(span, key).and_then(|v| v.value.as_ref()) {
        Some(AnyValue::IntValue(i)) => *i,
        other => panic!("{key}: expected an int, got {other:?}"),
    }
}

fn float(span: &Span, key: &str) -> f64 {
    match attr(span, key).and_then(|v| v.value.as_ref()) {
        Some(AnyValue::DoubleValue(f)) => *f,
        other => panic!("{key}: expected a double, got {other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn request_spans_reach_the_collector_with_vllm_attributes() {
    let (endpoint, rx) = collector();
    let server = start_with_env(
        &["--otlp-traces-endpoint", &endpoint],
        &[("OTEL_BSP_SCHEDULE_DELAY", "50"), ("OTEL_SERVICE_NAME", "flint-under-test")],
        None,
    )
    .await;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let parent = "b7ad6b7169203331";
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .header("traceparent", format!("00-{trace_id}-{parent}-01"))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.5,
            "top_p": 0.9, "n": 2, "seed": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let chat: Value = r.json().await.unwrap();
    let (status, plain) = post(&server, "/v1/completions", json!({"prompt": "one two", "max_tokens": 3})).await;
    assert_eq!(status, 200, "{plain}");
    let streamed =
        stream(&server, "/v1/completions", json!({"prompt": "three", "max_tokens": 2, "stream": true})).await;
    let stream_id = serde_json::from_str::<Value>(&streamed[0]).unwrap()["id"].as_str().unwrap().to_string();

    let (spans, services) = spans(&rx, 3);
    assert!(services.iter().all(|s| s == "flint-under-test"), "{services:?}");
    let span = &spans[chat["id"].as_str().unwrap()];
    // A child of the caller's span, in the caller's trace, as a server span.
    assert_eq!(hex(&span.trace_id), trace_id);
    assert_eq!(hex(&span.parent_span_id), parent);
    assert_eq!(span.kind, 2, "SPAN_KIND_SERVER");
    assert_eq!(text(attr(span, "gen_ai.response.model")), "flint-demo");
    assert_eq!(int(span, "gen_ai.request.n"), 2);
    assert_eq!(int(span, "gen_ai.usage.num_sequences"), 2);
    assert_eq!(int(span, "gen_ai.request.max_tokens"), 5);
    assert!((float(span, "gen_ai.request.temperature") - 0.5).abs() < 1e-6);
    assert!((float(span, "gen_ai.request.top_p") - 0.9).abs() < 1e-6);
    assert_eq!(int(span, "gen_ai.usage.prompt_tokens"), chat["usage"]["prompt_tokens"].as_i64().unwrap());
    assert_eq!(int(span, "gen_ai.usage.completion_tokens"), chat["usage"]["completion_tokens"].as_i64().unwrap());
    let (queue, ttft, e2e) = (
        float(span, "gen_ai.latency.time_in_queue"),
        float(span, "gen_ai.latency.time_to_first_token"),
        float(span, "gen_ai.latency.e2e"),
    );
    assert!(0.0 <= queue && queue <= ttft && ttft <= e2e && e2e > 0.0, "{queue} {ttft} {e2e}");
    let (prefill, decode) =
        (float(span, "gen_ai.latency.time_in_model_prefill"), float(span, "gen_ai.latency.time_in_model_decode"));
    assert!((queue + prefill + decode - e2e).abs() < 1e-6, "{queue} + {prefill} + {decode} != {e2e}");
    // The span lasts from arrival to the end: its duration is the e2e latency.
    let duration = (span.end_time_unix_nano - span.start_time_unix_nano) as f64 / 1e9;
    assert!((duration - e2e).abs() < 1e-3, "{duration} vs {e2e}");

    // Without `traceparent`: a root span of a trace of its own.
    let root = &spans[plain["id"].as_str().unwrap()];
    assert!(root.parent_span_id.is_empty());
    assert_ne!(hex(&root.trace_id), trace_id);
    assert_eq!(int(root, "gen_ai.usage.completion_tokens"), plain["usage"]["completion_tokens"].as_i64().unwrap());
    // A streamed request is traced as well.
    assert_eq!(int(&spans[&stream_id], "gen_ai.request.max_tokens"), 2);
}

#[test]
fn an_unsupported_otlp_protocol_is_one_clear_error() {
    let o = flint()
        .args(["serve", "--port", "0", "--otlp-traces-endpoint", "http://127.0.0.1:4317"])
        .env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("error: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=\"grpc\"") && err.contains("http/protobuf"),
        "{err}"
    );
}

/// One B/E pair per recorded scope; returns, for each scope name, the names of the scopes it ran
/// inside (its ancestors), checking that every thread's B/E events nest properly.
fn nesting(events: &[Value]) -> HashMap<String, Vec<Vec<String>>> {
    let mut stacks: HashMap<u64, Vec<String>> = HashMap::new();
    let mut out: HashMap<String, Vec<Vec<String>>> = HashMap::new();
    for e in events {
        let name = e["name"].as_str().unwrap_or_default().to_string();
        let stack = stacks.entry(e["tid"].as_u64().unwrap()).or_default();
        match e["ph"].as_str() {
            Some("B") => {
                out.entry(name.clone()).or_default().push(stack.clone());
                stack.push(name);
            }
            Some("E") => assert_eq!(stack.pop().as_deref(), Some(name.as_str()), "unbalanced trace"),
            _ => {}
        }
    }
    assert!(stacks.values().all(Vec::is_empty), "scopes left open: {stacks:?}");
    out
}

#[test]
fn trace_dir_writes_a_chrome_trace_of_nested_engine_scopes() {
    let dir = tempfile::tempdir().unwrap();
    let o = flint()
        .args(["generate", "--prompt", "The capital of France is", "--max-tokens", "3", "--trace-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let trace: Value = serde_json::from_slice(&std::fs::read(&files[0]).unwrap()).expect("valid JSON");
    let events = trace.as_array().expect("Chrome's JSON array format");
    assert!(events.iter().all(|e| e["ts"].is_number() || e["ph"] == "M"), "every event has a timestamp");
    let within = nesting(events);
    let inside = |scope: &str, parent: &str| {
        let seen = within.get(scope).unwrap_or_else(|| panic!("no {scope} scope in the trace: {:?}", within.keys()));
        seen.iter().all(|stack| stack.iter().any(|s| s == parent))
    };
    // Three decode steps and a prefill: one engine step each, every forward inside one.
    assert!(within["engine_step"].len() >= 3);
    assert!(inside("schedule", "engine_step"));
    assert!(inside("forward", "engine_step"));
    assert!(inside("sample", "engine_step"));
    assert!(inside("layer", "forward"));
    assert!(inside("attention", "layer"));
    assert!(inside("mlp", "layer"));
    for kernel in ["qkv_proj", "paged_attention", "o_proj"] {
        assert!(inside(kernel, "attention"), "{kernel}");
    }
    for kernel in ["gate_up_proj", "down_proj"] {
        assert!(inside(kernel, "mlp"), "{kernel}");
    }
    assert!(inside("lm_head", "forward"));
    // The layer scope carries its index.
    assert!(events.iter().any(|e| e["name"] == "layer" && e["args"]["layer"] == 1), "layer args");
    // Each forward runs every layer once.
    let forwards = within["forward"].len();
    assert!(within["layer"].len() >= forwards && within["layer"].len().is_multiple_of(forwards));
}
