//! Several CPU workers in one server (`--worker`, `--router`), against the real binary: the same
//! greedy outputs as one worker, both workers used, disconnects freeing blocks on the worker that
//! held them, and a worker whose step loop dies leaving the other serving.

mod common;

use std::time::{Duration, Instant};

use common::{get, metric, post, start, Server};
use futures_util::StreamExt;
use serde_json::{json, Value};

const TWO_WORKERS: &[&str] = &["--worker", "device=cpu,threads=1", "--worker", "device=cpu,threads=1"];

fn worker_metric(text: &str, name: &str, worker: &str) -> f64 {
    metric(text, &format!("{name}{{model_name=\"flint-demo\",worker=\"{worker}\"}}"))
}

async fn completion(s: &Server, prompt: &str) -> Value {
    let (status, body) =
        post(s, "/v1/completions", json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true}))
            .await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["text"].clone()
}

/// Wait until `ok(metrics text)`, or fail after 30 s with the text.
async fn until_metrics(s: &Server, what: &str, ok: impl Fn(&str) -> bool) {
    let t0 = Instant::now();
    loop {
        let (_, m) = get(s, "/metrics").await;
        if ok(&m) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}: {m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A streaming request that runs long; returns its byte stream once the first chunk arrived.
async fn long_stream(s: &Server) -> impl futures_util::Stream<Item = reqwest::Result<impl AsRef<[u8]>>> {
    let body = json!({"prompt": "Hello", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let r = reqwest::Client::new().post(format!("{}/v1/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut st = r.bytes_stream();
    st.next().await.expect("first chunk").unwrap();
    st
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_answer_like_one_and_both_serve() {
    let prompts = ["Hello there", "The capital of France is", "1, 2, 3, 4,", "def main():", "Once upon a time"];
    let one = start(&[], None).await;
    let mut want = Vec::new();
    for p in prompts {
        want.push(completion(&one, p).await);
    }
    drop(one);

    let mut args = TWO_WORKERS.to_vec();
    args.extend(["--router", "round-robin"]);
    let two = start(&args, None).await;
    // One at a time, then all at once (batched on both workers): the same greedy text.
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&completion(&two, p).await, w, "{p}");
    }
    let together = futures_util::future::join_all(prompts.iter().map(|p| completion(&two, p))).await;
    assert_eq!(together, want);
    let (_, m) = get(&two, "/metrics").await;
    let (d0, d1) = (
        worker_metric(&m, "flint:router_decisions_total", "cpu0"),
        worker_metric(&m, "flint:router_decisions_total", "cpu1"),
    );
    assert_eq!(d0 + d1, 10.0, "{m}");
    assert!(d0 >= 4.0 && d1 >= 4.0, "round-robin uses both workers: {d0} / {d1}");
    // The unlabeled totals are the sum of the workers'.
    let total = metric(&m, "vllm:generation_tokens_total{model_name=\"flint-demo\"}");
    let parts = worker_metric(&m, "flint:worker_generation_tokens_total", "cpu0")
        + worker_metric(&m, "flint:worker_generation_tokens_total", "cpu1");
    assert_eq!(total, parts, "{m}");
    assert!(total >= 120.0, "{m}");
    let (status, health) = get(&two, "/health").await;
    assert_eq!(status, 200);
    let health: Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["workers"].as_array().map(Vec::len), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnects_free_blocks_on_their_worker_and_a_dead_worker_leaves_the_other_serving() {
    let mut args = TWO_WORKERS.to_vec();
    args.extend(["--router", "round-robin", "--enable-test-hooks"]);
    let s = start(&args, None).await;

    // Round-robin puts one long stream on each worker; both hold blocks.
    let a = long_stream(&s).await;
    let b = long_stream(&s).await;
    until_metrics(&s, "both workers running", |m| {
        ["cpu0", "cpu1"].iter().all(|w| {
            worker_metric(m, "flint:worker_num_requests_running", w) == 1.0
                && worker_metric(m, "flint:worker_kv_cache_usage_perc", w) > 0.0
        })
    })
    .await;
    // The client of worker cpu0's stream goes away: cpu0's blocks come back, cpu1's stay.
    drop(a);
    until_metrics(&s, "cpu0 freed, cpu1 still running", |m| {
        worker_metric(m, "flint:worker_kv_cache_usage_perc", "cpu0") == 0.0
            && worker_metric(m, "flint:worker_num_requests_running", "cpu0") == 0.0
            && worker_metric(m, "flint:worker_num_requests_running", "cpu1") == 1.0
            && worker_metric(m, "flint:worker_kv_cache_usage_perc", "cpu1") > 0.0
    })
    .await;

    // Worker cpu1's step loop dies with a request in flight: that stream ends with a 503-class
    // error event; the server stays up, degraded.
    let (status, body) = post(&s, "/debug/workers/1/fault", json!({})).await;
    assert_eq!(status, 202, "{body}");
    let rest: Vec<_> = b.collect().await;
    let text: String = rest.into_iter().map(|c| String::from_utf8_lossy(c.unwrap().as_ref()).into_owned()).collect();
    assert!(text.contains("service_unavailable") && text.contains("stopped"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let (status, health) = get(&s, "/health").await;
    assert_eq!(status, 200, "{health}");
    let health: Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["status"], "degraded", "{health}");
    assert_eq!(health["workers"][1], json!({"name": "cpu1", "healthy": false}));
    // Every new request goes to the live worker.
    for p in ["one", "two", "three"] {
        assert!(completion(&s, p).await.is_string());
    }
    let (_, m) = get(&s, "/metrics").await;
    assert_eq!(worker_metric(&m, "flint:worker_healthy", "cpu1"), 0.0, "{m}");
    assert_eq!(worker_metric(&m, "flint:worker_healthy", "cpu0"), 1.0, "{m}");
    assert_eq!(worker_metric(&m, "flint:router_decisions_total", "cpu1"), 1.0, "{m}");

    // The last worker dies: 503 everywhere.
    post(&s, "/debug/workers/0/fault", json!({})).await;
    let t0 = Instant::now();
    while get(&s, "/health").await.0 != 503 {
        assert!(t0.elapsed() < Duration::from_secs(10), "/health never turned 503");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = post(&s, "/v1/completions", json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["type"], "service_unavailable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_hooks_are_off_unless_asked_for() {
    let s = start(&[], None).await;
    let (status, _) = post(&s, "/debug/workers/0/fault", json!({})).await;
    assert_eq!(status, 404);
    let (status, _) = get(&s, "/health").await;
    assert_eq!(status, 200);
}

#[test]
fn unsupported_worker_devices_and_oversubscribed_cores_are_start_up_errors() {
    for (args, want) in [
        // CI builds without the cuda feature: the error says how to rebuild, before any load.
        (vec!["--worker", "device=cuda:0"], "--worker 0: --device cuda:0: this flint was built without CUDA"),
        (vec!["--worker", "device=cpu", "--worker", "device=metal"], "--worker 1: --device metal: flint has no Metal"),
        (vec!["--device", "cuda:0", "--worker", "device=cpu"], "--device applies without --worker"),
        (vec!["--worker", "threads=64", "--worker", "threads=64"], "physical core(s)"),
        (vec!["--worker", "device=tpu"], "unknown device"),
        (vec!["--router", "fastest"], "unknown policy"),
    ] {
        let o = common::flint().args(["serve", "--port", "0"]).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} should fail: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
