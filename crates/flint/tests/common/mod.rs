//! What the integration tests against the real `flint serve` binary share: starting it on a free
//! port, waiting until it is ready, and small request helpers.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub struct Server {
    pub child: Child,
    pub base: String,
    /// /health answers seen before the first 200 (503 while the model loads).
    pub early_health: Vec<u16>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn flint() -> Command {
    // FLINT_TEST_BIN runs the suite against another build (e.g. an older commit's binary).
    let bin = std::env::var_os("FLINT_TEST_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_flint").into());
    let mut c = Command::new(bin);
    c.env("HF_HUB_OFFLINE", "1").env_remove("FLINT_API_KEY");
    c
}

/// Start `flint serve --port 0 ARGS`, read the bound address from its log, wait until ready.
pub async fn start(args: &[&str], dir: Option<tempfile::TempDir>) -> Server {
    start_with_env(args, &[], dir).await
}

/// [`start`] with extra environment variables.
pub async fn start_with_env(args: &[&str], env: &[(&str, &str)], dir: Option<tempfile::TempDir>) -> Server {
    let mut child = flint()
        .args(["serve", "--port", "0"])
        .args(args)
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start flint serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                let _ = tx.send(addr);
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(60)).expect("server did not start listening");
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let mut early_health = Vec::new();
    let t0 = Instant::now();
    loop {
        let status = client.get(format!("{base}/health")).send().await.map(|r| r.status().as_u16()).unwrap_or(0);
        if status == 200 {
            break;
        }
        early_health.push(status);
        assert!(t0.elapsed() < Duration::from_secs(120), "server never became ready: {early_health:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Server { child, base, early_health, _dir: dir }
}

pub async fn post(s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

pub async fn get(s: &Server, path: &str) -> (u16, String) {
    let r = reqwest::Client::new().get(format!("{}{path}", s.base)).send().await.expect("request");
    (r.status().as_u16(), r.text().await.unwrap_or_default())
}

/// SSE `data:` payloads of a streaming POST.
pub async fn stream(s: &Server, path: &str, body: Value) -> Vec<String> {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.expect("request");
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    text.split("\n\n").filter_map(|e| e.strip_prefix("data: ").map(str::to_string)).collect()
}

pub fn assert_error(status: u16, body: &Value, want_status: u16, param: Option<&str>) {
    assert_eq!(status, want_status, "{body}");
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(e["type"].is_string(), "{body}");
    if let Some(p) = param {
        assert_eq!(e["param"], json!(p), "{body}");
    }
}

pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Write a scripted checkpoint into `dir`: greedy, it answers every chat with `script`, then stops.
pub fn scripted(dir: &std::path::Path, script: &str) {
    let o = flint().args(["synth", "--shape", "scripted", "--script", script, "--out"]).arg(dir).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
