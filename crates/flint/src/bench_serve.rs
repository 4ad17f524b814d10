//! `flint bench serve`: an online benchmark against any OpenAI-compatible server, printing the
//! same result block as `vllm bench serve` (random dataset: prompts of exactly
//! `--random-input-len` random token ids, `--random-output-len` tokens each, EOS ignored).
//! Definitions as vLLM's: TTFT = send → first streamed chunk with output; TPOT = (E2EL − TTFT) /
//! (output tokens − 1) per request; ITL = gaps between successive chunks, pooled; E2EL = send →
//! last chunk.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct ServeBenchArgs {
    /// The server, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    base_url: String,
    /// Model name to send; default: the first of GET /v1/models.
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 100)]
    num_prompts: usize,
    #[arg(long, default_value_t = 1024)]
    random_input_len: usize,
    #[arg(long, default_value_t = 128)]
    random_output_len: usize,
    /// A random prefix of this many tokens shared by every prompt, before its own
    /// --random-input-len tokens (vLLM's flag).
    #[arg(long, default_value_t = 0)]
    random_prefix_len: usize,
    /// Untimed requests sent all at once before the benchmark (the shared prefix and a suffix
    /// of their own, one output token each): they warm the server's prefix caches.
    #[arg(long, default_value_t = 0)]
    warmup_requests: usize,
    /// Most requests in flight at once; default: no limit.
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Requests per second, Poisson arrivals; default: all at once (inf).
    #[arg(long)]
    request_rate: Option<f64>,
    /// Token ids are drawn below this bound (ordinary tokens of Qwen vocabularies).
    #[arg(long, default_value_t = 151_643)]
    vocab_size: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sampling temperature of the timed requests (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus share of the timed requests (1: off); with --temperature, what the sampler costs.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Write the result (and per-request timings) as JSON.
    #[arg(long)]
    save_result: Option<PathBuf>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "FLINT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    ok: bool,
    error: String,
    ttft: f64,
    e2el: f64,
    itl: Vec<f64>,
    output_tokens: usize,
    /// (time since benchmark start, tokens) per chunk, for the peak throughput.
    chunks: Vec<(f64, usize)>,
    start: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    // numpy's default (linear interpolation), as vLLM computes it.
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    (mean, percentile(&v, 50.0), percentile(&v, 99.0))
}

async fn one_request(client: &reqwest::Client, url: &str, key: Option<&str>, body: Value, t0: Instant) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome { start: start.duration_since(t0).as_secs_f64(), ..Default::default() };
    let mut req = client.post(url).json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = e.to_string();
            return out;
        }
    };
    if !resp.status().is_success() {
        out.error = format!("HTTP {}: {}", resp.status(), resp.text().await.unwrap_or_default());
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut last = start;
    let mut chunk_count = 0usize;
    while let Some(piece) = stream.next().await {
        let Ok(piece) = piece else {
            out.error = "the stream broke".into();
            return out;
        };
        buf.push_str(&String::from_utf8_lossy(&piece));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
            if data.trim() == "[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
            if let Some(e) = v.get("error") {
                out.error = e.to_string();
                return out;
            }
            let now = Instant::now();
            if let Some(u) = v.get("usage").and_then(|u| u.get("completion_tokens")).and_then(Value::as_u64) {
                out.output_tokens = u as usize;
            }
            let has_choice = v.get("choices").and_then(Value::as_array).is_some_and(|c| !c.is_empty());
            if has_choice {
                if chunk_count == 0 {
                    out.ttft = now.duration_since(start).as_secs_f64();
                } else {
                    out.itl.push(now.duration_since(last).as_secs_f64());
                }
                out.chunks.push((now.duration_since(t0).as_secs_f64(), 1));
                chunk_count += 1;
                last = now;
            }
        }
    }
    out.e2el = last.duration_since(start).as_secs_f64();
    if out.output_tokens == 0 {
        out.output_tokens = chunk_count;
    }
    out.ok = chunk_count > 0;
    if !out.ok {
        out.error = "no output".into();
    }
    out
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    if a.num_prompts == 0 || a.random_input_len == 0 || a.random_output_len == 0 {
        bail!("--num-prompts, --random-input-len and --random-output-len must be at least 1");
    }
    if a.max_concurrency == Some(0) || a.request_rate.is_some_and(|r| r.is_nan() || r <= 0.0) {
        bail!("--max-concurrency and --request-rate must be positive");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(bench(a))
}

async fn bench(a: ServeBenchArgs) -> Result<()> {
    let base = a.base_url.trim_end_matches('/').to_string();
    let client = reqwest::Client::builder().build()?;
    let key = a.api_key.clone();
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            let mut req = client.get(format!("{base}/v1/models"));
            if let Some(k) = &key {
                req = req.bearer_auth(k);
            }
            let v: Value = req.send().await.with_context(|| format!("GET {base}/v1/models"))?.json().await?;
            v.pointer("/data/0/id").and_then(Value::as_str).context("the server lists no model")?.to_string()
        }
    };
    let mut rng = StdRng::seed_from_u64(a.seed);
    let prefix: Vec<u32> = (0..a.random_prefix_len).map(|_| rng.random_range(0..a.vocab_size)).collect();
    let prompt = |rng: &mut StdRng| -> Vec<u32> {
        let mut p = prefix.clone();
        p.extend((0..a.random_input_len).map(|_| rng.random_range(0..a.vocab_size)));
        p
    };
    let prompts: Vec<Vec<u32>> = (0..a.num_prompts).map(|_| prompt(&mut rng)).collect();
    let warmups: Vec<Vec<u32>> = (0..a.warmup_requests).map(|_| prompt(&mut rng)).collect();
    let url = format!("{base}/v1/completions");
    if !warmups.is_empty() {
        let t = Instant::now();
        let runs = warmups.into_iter().map(|p| {
            let body = json!({"model": model, "prompt": p, "max_tokens": 1, "stream": true, "temperature": 0.0});
            let (client, url, key) = (client.clone(), url.clone(), key.clone());
            async move { one_request(&client, &url, key.as_deref(), body, t).await }
        });
        let done = futures_util::future::join_all(runs).await;
        if let Some(e) = done.iter().find(|o| !o.ok) {
            bail!("a warm-up request failed: {}", e.error);
        }
        println!("Warm-up: {} requests in {:.2} s", done.len(), t.elapsed().as_secs_f64());
    }
    let sem = a.max_concurrency.map(|c| Arc::new(tokio::sync::Semaphore::new(c)));
    println!(
        "Starting benchmark: {} prompts, input {} / output {} tokens, model {model}",
        a.num_prompts, a.random_input_len, a.random_output_len
    );
    let spec_before = spec_metrics(&client, &base, key.as_deref()).await;
    let routed_before = router_decisions(&client, &base, key.as_deref()).await;
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(prompts.len());
    for p in prompts {
        if let Some(rate) = a.request_rate {
            // Poisson arrivals: exponential gaps with mean 1/rate.
            let gap = -(1.0 - rng.random::<f64>()).ln() / rate;
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
        let body = json!({
            "model": model, "prompt": p, "max_tokens": a.random_output_len, "ignore_eos": true,
            "temperature": a.temperature, "top_p": a.top_p, "stream": true,
            "stream_options": {"include_usage": true},
        });
        let (client, url, key, sem) = (client.clone(), url.clone(), key.clone(), sem.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = match &sem {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            one_request(&client, &url, key.as_deref(), body, t0).await
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    // Counted in submission order: a lower bound on how many have finished.
    let progress = flint_model::progress::task("benchmark", "requests", tasks.len() as u64);
    for t in tasks {
        outcomes.push(t.await.unwrap_or_else(|e| Outcome { error: e.to_string(), ..Default::default() }));
        progress.inc(1);
    }
    drop(progress);
    let duration = t0.elapsed().as_secs_f64();
    let spec = match (spec_before, spec_metrics(&client, &base, key.as_deref()).await) {
        (Some(b), Some(e)) => Some(e.since(&b)),
        _ => None,
    };
    let routed: Vec<(String, f64)> = router_decisions(&client, &base, key.as_deref())
        .await
        .into_iter()
        .map(|(w, n)| {
            let before = routed_before.iter().find(|(b, _)| *b == w).map_or(0.0, |b| b.1);
            (w, n - before)
        })
        .collect();
    report(&a, &model, &outcomes, duration, spec.as_ref(), &routed)
}

/// A flint server's `flint:router_decisions_total` per worker label (empty for other servers).
async fn router_decisions(client: &reqwest::Client, base: &str, key: Option<&str>) -> Vec<(String, f64)> {
    let mut req = client.get(format!("{base}/metrics"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let Some(text) = (async { req.send().await.ok()?.text().await.ok() }).await else { return Vec::new() };
    text.lines()
        .filter(|l| l.starts_with("flint:router_decisions_total{"))
        .filter_map(|l| {
            let worker = l.split("worker=\"").nth(1)?.split('"').next()?.to_string();
            Some((worker, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// The server's speculative-decoding counters (vLLM's names in `/metrics`), if it exposes them.
#[derive(Debug, Clone, Default)]
struct SpecMetrics {
    drafts: f64,
    draft_tokens: f64,
    accepted: f64,
    per_pos: Vec<f64>,
}

impl SpecMetrics {
    fn since(&self, before: &SpecMetrics) -> SpecMetrics {
        let per_pos =
            self.per_pos.iter().enumerate().map(|(i, &x)| x - before.per_pos.get(i).copied().unwrap_or(0.0)).collect();
        SpecMetrics {
            drafts: self.drafts - before.drafts,
            draft_tokens: self.draft_tokens - before.draft_tokens,
            accepted: self.accepted - before.accepted,
            per_pos,
        }
    }
}

async fn spec_metrics(client: &reqwest::Client, base: &str, key: Option<&str>) -> Option<SpecMetrics> {
    let mut req = client.get(format!("{base}/metrics"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let text = req.send().await.ok()?.text().await.ok()?;
    let mut m = SpecMetrics::default();
    let mut seen = false;
    for line in text.lines().filter(|l| l.starts_with("vllm:spec_decode_")) {
        let (Some(name), Some(value)) = (line.split('{').next(), line.rsplit(' ').next()) else { continue };
        let Ok(v) = value.parse::<f64>() else { continue };
        seen = true;
        match name.trim_end_matches("_total") {
            "vllm:spec_decode_num_drafts" => m.drafts = v,
            "vllm:spec_decode_num_draft_tokens" => m.draft_tokens = v,
            "vllm:spec_decode_num_accepted_tokens" => m.accepted = v,
            "vllm:spec_decode_num_accepted_tokens_per_pos" => {
                let pos = line.split("position=\"").nth(1).and_then(|r| r.split('"').next()?.parse::<usize>().ok());
                if let Some(p) = pos {
                    if m.per_pos.len() <= p {
                        m.per_pos.resize(p + 1, 0.0);
                    }
                    m.per_pos[p] = v;
                }
            }
            _ => {}
        }
    }
    seen.then_some(m)
}

fn report(
    a: &ServeBenchArgs,
    model: &str,
    outcomes: &[Outcome],
    duration: f64,
    spec: Option<&SpecMetrics>,
    routed: &[(String, f64)],
) -> Result<()> {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let completed = ok.len();
    let total_input = completed * (a.random_prefix_len + a.random_input_len);
    let total_output: usize = ok.iter().map(|o| o.output_tokens).sum();
    let ttft = stats(ok.iter().map(|o| o.ttft).collect());
    let tpot = stats(
        ok.iter().filter(|o| o.output_tokens > 1).map(|o| (o.e2el - o.ttft) / (o.output_tokens - 1) as f64).collect(),
    );
    let itl = stats(ok.iter().flat_map(|o| o.itl.iter().copied()).collect());
    let e2el = stats(ok.iter().map(|o| o.e2el).collect());
    // Peak: the most chunks in any one-second window, and the most requests in flight at once.
    let mut secs = vec![0usize; duration.ceil() as usize + 1];
    for o in &ok {
        for &(t, k) in &o.chunks {
            if let Some(s) = secs.get_mut(t as usize) {
                *s += k;
            }
        }
    }
    let peak_output = secs.iter().copied().max().unwrap_or(0);
    let mut edges: Vec<(f64, i64)> = ok.iter().flat_map(|o| [(o.start, 1), (o.start + o.e2el, -1)]).collect();
    edges.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
    let (mut cur, mut peak_conc) = (0i64, 0i64);
    for (_, d) in edges {
        cur += d;
        peak_conc = peak_conc.max(cur);
    }
    let ms = |x: f64| x * 1000.0;
    let line = |k: &str, v: String| println!("{k:<40} {v:<10}");
    println!("{:=^50}", " Serving Benchmark Result ");
    line("Successful requests:", completed.to_string());
    line("Failed requests:", (outcomes.len() - completed).to_string());
    if let Some(c) = a.max_concurrency {
        line("Maximum request concurrency:", c.to_string());
    }
    line("Benchmark duration (s):", format!("{duration:.2}"));
    line("Total input tokens:", total_input.to_string());
    line("Total generated tokens:", total_output.to_string());
    line("Request throughput (req/s):", format!("{:.2}", completed as f64 / duration));
    line("Output token throughput (tok/s):", format!("{:.2}", total_output as f64 / duration));
    line("Peak output token throughput (tok/s):", format!("{:.2}", peak_output as f64));
    line("Peak concurrent requests:", format!("{:.2}", peak_conc as f64));
    line("Total Token throughput (tok/s):", format!("{:.2}", (total_input + total_output) as f64 / duration));
    for (title, name, short, (mean, median, p99)) in [
        ("Time to First Token", "TTFT", "TTFT", ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", "TPOT", tpot),
        ("Inter-token Latency", "ITL", "ITL", itl),
        ("End-to-end Latency", "E2EL", "E2EL", e2el),
    ] {
        let _ = name;
        println!("{:-^50}", title);
        line(&format!("Mean {short} (ms):"), format!("{:.2}", ms(mean)));
        line(&format!("Median {short} (ms):"), format!("{:.2}", ms(median)));
        line(&format!("P99 {short} (ms):"), format!("{:.2}", ms(p99)));
    }
    if let Some(s) = spec {
        // vLLM's block, from the server's counters over this run.
        println!("{:-^50}", "Speculative Decoding");
        line("Acceptance rate (%):", format!("{:.2}", 100.0 * s.accepted / s.draft_tokens.max(1.0)));
        line("Acceptance length:", format!("{:.2}", 1.0 + s.accepted / s.drafts.max(1.0)));
        line("Drafts:", format!("{}", s.drafts));
        line("Draft tokens:", format!("{}", s.draft_tokens));
        line("Accepted tokens:", format!("{}", s.accepted));
        let per: Vec<String> = s.per_pos.iter().map(|&x| format!("{:.2}", 100.0 * x / s.drafts.max(1.0))).collect();
        line("Per-position acceptance (%):", per.join(", "));
    }
    if routed.len() > 1 {
        println!("{:-^50}", "Router");
        for (w, n) in routed {
            line(&format!("Requests to worker {w}:"), format!("{n}"));
        }
    }
    println!("{}", "=".repeat(50));
    if let Some(e) = outcomes.iter().find(|o| !o.ok) {
        eprintln!("first failure: {}", e.error);
    }
    if let Some(path) = &a.save_result {
        let v = json!({
            "backend": "openai",
            "model_id": model,
            "num_prompts": a.num_prompts,
            "request_rate": a.request_rate.map_or(json!("inf"), |r| json!(r)),
            "max_concurrency": a.max_concurrency,
            "duration": duration,
            "completed": completed,
            "failed": outcomes.len() - completed,
            "total_input_tokens": total_input,
            "total_output_tokens": total_output,
            "request_throughput": completed as f64 / duration,
            "output_throughput": total_output as f64 / duration,
            "total_token_throughput": (total_input + total_output) as f64 / duration,
            "mean_ttft_ms": ms(ttft.0), "median_ttft_ms": ms(ttft.1), "p99_ttft_ms": ms(ttft.2),
            "mean_tpot_ms": ms(tpot.0), "median_tpot_ms": ms(tpot.1), "p99_tpot_ms": ms(tpot.2),
            "mean_itl_ms": ms(itl.0), "median_itl_ms": ms(itl.1), "p99_itl_ms": ms(itl.2),
            "mean_e2el_ms": ms(e2el.0), "median_e2el_ms": ms(e2el.1), "p99_e2el_ms": ms(e2el.2),
            "output_lens": ok.iter().map(|o| o.output_tokens).collect::<Vec<_>>(),
            "ttfts": ok.iter().map(|o| o.ttft).collect::<Vec<_>>(),
            "itls": ok.iter().map(|o| o.itl.clone()).collect::<Vec<_>>(),
            "errors": outcomes.iter().map(|o| o.error.clone()).collect::<Vec<_>>(),
            "requests_per_worker": routed.iter().map(|(w, n)| (w.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "spec_decode": spec.map(|s| json!({
                "drafts": s.drafts, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted,
                "accepted_per_pos": s.per_pos,
            })),
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if completed == 0 {
        bail!("every request failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-9);
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
