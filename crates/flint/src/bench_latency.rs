//! `flint bench latency`: single-stream prompt processing and generation speed, reported as
//! llama-bench does (`pp512`, `tg128`, tokens/s as mean ± sd over `--reps` runs), so the two can be
//! compared side by side. pp: one forward pass over `--prompt-len` random tokens from an empty
//! cache. tg: `--gen-len` tokens one at a time from an empty cache. Both run through the engine
//! core (paged cache, sampler), greedy, EOS ignored; tokenization is not timed.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Device;
use flint_engine::engine_core::EventSink;
use flint_engine::{build_core, plan, EngineConfig, LoadedModel, Request, RequestParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(clap::Args)]
pub struct LatencyArgs {
    /// Local directory, .gguf file, or hub id; omitted: the built-in demo model.
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    gen_len: usize,
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the results as JSON too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Run one request alone through a fresh engine core; returns (seconds to first token, seconds
/// for the rest, tokens generated).
fn run_once(lm: &LoadedModel, prompt: Vec<u32>, gen: usize, budget: usize) -> Result<(f64, f64, usize)> {
    let ec = EngineConfig { max_num_batched_tokens: budget, ..EngineConfig::single_request(lm, prompt.len() + gen) };
    let mut core = build_core(lm, &plan(lm, &ec)?)?;
    let tokens = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = tokens.clone();
    let sink: EventSink = Box::new(move |ev| {
        if let flint_engine::EngineEvent::Output(o) = ev {
            t.fetch_add(o.token_ids.len(), std::sync::atomic::Ordering::Relaxed);
        }
        true
    });
    let params = RequestParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
    core.add(Request { id: "latency".into(), prompt, params }, sink)?;
    let t0 = Instant::now();
    let mut first = None;
    while core.has_work() {
        core.step();
        if first.is_none() && tokens.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            first = Some(t0.elapsed().as_secs_f64());
        }
    }
    let total = t0.elapsed().as_secs_f64();
    let first = first.unwrap_or(total);
    Ok((first, total - first, tokens.load(std::sync::atomic::Ordering::Relaxed)))
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

pub fn run(a: LatencyArgs) -> Result<()> {
    if a.prompt_len == 0 || a.gen_len == 0 || a.reps == 0 {
        bail!("--prompt-len, --gen-len and --reps must be at least 1");
    }
    let lm = LoadedModel::load(a.model.as_deref(), &Device::Cpu, None)?;
    let vocab = lm.ordinary_vocab();
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut prompt = |n: usize| (0..n).map(|_| rng.random_range(0..vocab)).collect::<Vec<u32>>();
    // Warm-up (page in the weights, spin up the threads), as llama-bench does.
    run_once(&lm, prompt(16), 2, 4096)?;
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..a.reps {
        // pp: the whole prompt in one step; only the prefill is timed.
        let (first, _, _) = run_once(&lm, prompt(a.prompt_len), 1, a.prompt_len)?;
        pp.push(a.prompt_len as f64 / first);
        // tg: a one-token prompt, then gen_len - 1 more single-token steps.
        let (first, rest, n) = run_once(&lm, prompt(1), a.gen_len, a.prompt_len)?;
        tg.push(n as f64 / (first + rest));
    }
    let name = format!("{} ({:?})", lm.source, lm.model.dtype());
    let (pm, ps) = mean_sd(&pp);
    let (tm, ts) = mean_sd(&tg);
    println!("| model | test | t/s |\n| --- | --- | ---: |");
    println!("| {name} | pp{} | {pm:.2} ± {ps:.2} |", a.prompt_len);
    println!("| {name} | tg{} | {tm:.2} ± {ts:.2} |", a.gen_len);
    if let Some(path) = &a.json {
        let v = serde_json::json!({
            "model": lm.source, "dtype": format!("{:?}", lm.model.dtype()),
            "pp": {"n": a.prompt_len, "mean": pm, "sd": ps, "samples": pp},
            "tg": {"n": a.gen_len, "mean": tm, "sd": ts, "samples": tg},
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}
