//! `flint bench latency`: single-stream prompt processing and generation speed, reported as
//! llama-bench does (`pp512`, `tg128`, `pp512 @ d4096`, tokens/s as mean ± sd over `--reps`
//! runs), so the two can be compared side by side. Everything runs through the engine core
//! (paged cache, chunked prefill, sampler), greedy, EOS ignored; tokenization is not timed.
//!
//! At depth `d` (`--depth`, like llama-bench's `-d`), a `d`-token context is prefilled first
//! (timed and reported on its own, in `--max-num-batched-tokens` chunks as a server runs it) and
//! kept in the prefix cache; then each pp repetition prefills `--prompt-len` more tokens after it
//! in one step, and each tg repetition generates `--gen-len` tokens after it, one per step.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use flint_engine::engine_core::EventSink;
use flint_engine::{
    build_core, draft_kv_dtype, load_draft, plan, EngineConfig, EngineCore, LoadedModel, PagedModelRunner, Request,
    RequestParams,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use flint_model::kernels::read_probe::ReadProbe;

use crate::bandwidth_probe;
use crate::engine_args::{DeviceArg, KvDtypeArg, SpeculativeArg};

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
    /// Context already in the cache before pp and tg are measured (repeatable, or a list:
    /// `--depth 0,4096,16384`).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    depth: Vec<usize>,
    /// Chunk size for prefilling the depth context (as `serve`'s flag).
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
    /// Tokens per KV block (default: the cache dtype's).
    #[arg(long)]
    block_size: Option<usize>,
    #[command(flatten)]
    device: DeviceArg,
    #[command(flatten)]
    kv: KvDtypeArg,
    #[command(flatten)]
    spec: SpeculativeArg,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the results as JSON too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// After the timed runs, one more tg run with a read of a 1 GiB buffer before its first step
    /// and after each: every step's weight bytes a second against the memory bandwidth of its own
    /// moments (see `bandwidth_probe`). Costs the buffer and a read a step.
    #[arg(long)]
    bandwidth_probe: bool,
    /// Sequences the --bandwidth-probe run decodes together, each after its own prompt (a
    /// mixture's experts: those the batch chooses); counted are the steps that decode them all.
    #[arg(long, default_value_t = 1, requires = "bandwidth_probe")]
    probe_seqs: usize,
    /// Tokens of each --bandwidth-probe sequence's own prompt (after the --depth context): the
    /// KV cache its decode steps' attention reads, as in `bench throughput --input-len`.
    #[arg(long, default_value_t = 1, requires = "bandwidth_probe")]
    probe_prompt_len: usize,
}

/// Run one request to the end; returns (seconds to its first token, seconds for the rest, tokens).
fn run_request(core: &mut EngineCore<PagedModelRunner>, prompt: Vec<u32>, gen: usize) -> Result<(f64, f64, usize)> {
    let tokens = Arc::new(AtomicUsize::new(0));
    let t = tokens.clone();
    let sink: EventSink = Box::new(move |ev| {
        if let flint_engine::EngineEvent::Output(o) = ev {
            t.fetch_add(o.token_ids.len(), Ordering::Relaxed);
        }
        true
    });
    let params = RequestParams { max_tokens: gen, ignore_eos: true, ..Default::default() };
    core.add(Request { id: "latency".into(), prompt, params }, sink)?;
    let t0 = Instant::now();
    let mut first = None;
    while core.has_work() {
        core.step();
        if first.is_none() && tokens.load(Ordering::Relaxed) > 0 {
            first = Some(t0.elapsed().as_secs_f64());
        }
    }
    let total = t0.elapsed().as_secs_f64();
    let first = first.unwrap_or(total);
    Ok((first, total - first, tokens.load(Ordering::Relaxed)))
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

pub fn run(a: LatencyArgs) -> Result<()> {
    if [a.prompt_len, a.gen_len, a.reps, a.max_num_batched_tokens, a.probe_seqs, a.probe_prompt_len].contains(&0) {
        bail!(
            "--prompt-len, --gen-len, --reps, --max-num-batched-tokens, --probe-seqs and --probe-prompt-len must be \
             at least 1"
        );
    }
    let spec = a.spec.get()?;
    let lm = LoadedModel::load(a.model.as_deref(), &a.device.open()?, None)?;
    if let Some(note) = lm.bf16_note() {
        eprintln!("{note}");
    }
    let vocab = lm.ordinary_vocab();
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut prompt = |n: usize| (0..n).map(|_| rng.random_range(0..vocab)).collect::<Vec<u32>>();
    let model_len = lm.model.config().max_context_len();
    // One engine per depth, its pool sized for the context plus either test, with two blocks to
    // spare so the context's cached blocks are never evicted by a test's own.
    let draft = load_draft(&lm, &EngineConfig { speculative: spec.clone(), ..EngineConfig::default() })?;
    // The timed tests' tokens after the context (pp's prompt and one token, or tg's), and the
    // probe's (its prompt and the decode).
    let timed_tokens = a.prompt_len.max(a.gen_len) + 1;
    let probe_tokens = if a.bandwidth_probe { a.probe_prompt_len + a.gen_len } else { 0 };
    let core_for = |depth: usize, budget: usize, seqs: usize| -> Result<EngineCore<PagedModelRunner>> {
        let tokens = depth + timed_tokens.max(probe_tokens);
        if tokens > model_len {
            bail!("--depth {depth} plus the test needs {tokens} tokens; the model's context is {model_len}");
        }
        let mut ec = EngineConfig {
            block_size: a.block_size,
            kv_cache_dtype: a.kv.get(),
            max_num_seqs: seqs,
            max_num_batched_tokens: budget,
            max_model_len: Some(tokens),
            speculative: spec.clone(),
            ..EngineConfig::default()
        };
        let bs = ec.block_size();
        let draft_bytes =
            draft.as_ref().map_or(0, |d| draft_kv_dtype(ec.dtype()).bytes_per_block(d.model.config(), bs));
        let per_block = ec.dtype().bytes_per_block(lm.model.config(), bs) + draft_bytes;
        ec.kv_cache_memory = Some(seqs * (tokens.div_ceil(bs.max(1)) + 2) * per_block);
        let p = plan(&lm, draft.as_ref(), &ec)?;
        eprintln!("{}", p.describe());
        Ok(build_core(&lm, draft.as_ref(), &p)?)
    };
    // Warm-up (page in the weights, spin up the threads), as llama-bench does.
    let mut warm = core_for(0, 4096, 1)?;
    run_request(&mut warm, prompt(a.prompt_len.min(16)), 1)?;
    drop(warm);
    let probe = a.bandwidth_probe.then(|| ReadProbe::new(bandwidth_probe::PROBE_BYTES));
    let kv = a.kv.get().map_or("auto".to_string(), |d| d.to_string());
    let name = format!("{} ({:?} on {}, KV {kv})", lm.source, lm.model.dtype(), a.device.device);
    println!("| model | test | t/s |\n| --- | --- | ---: |");
    let mut results = Vec::new();
    for &depth in &a.depth {
        let budget = a.prompt_len.max(a.max_num_batched_tokens);
        let mut core = core_for(depth, budget, 1)?;
        let context = prompt(depth);
        let at = if depth > 0 { format!(" @ d{depth}") } else { String::new() };
        let mut prefill = None;
        if depth > 0 {
            // The context, chunked as a server would, then kept in the prefix cache.
            let (secs, _, _) = run_request(&mut core, context.clone(), 1)?;
            eprintln!(
                "context prefill: {depth} tokens in {secs:.2} s ({:.1} tok/s, {budget}-token chunks)",
                depth as f64 / secs
            );
            prefill = Some(secs);
        }
        let (mut pp, mut tg) = (Vec::new(), Vec::new());
        let progress = flint_model::progress::task(&format!("depth {depth}"), "repetitions", a.reps as u64);
        for _ in 0..a.reps {
            // pp: the prompt in one step after the cached context; only the prefill is timed.
            let mut p = context.clone();
            p.extend(prompt(a.prompt_len));
            let (first, _, _) = run_request(&mut core, p, 1)?;
            pp.push(a.prompt_len as f64 / first);
            // tg: one new token after the context, then gen_len - 1 more single-token steps.
            let mut p = context.clone();
            p.extend(prompt(1));
            let (first, rest, n) = run_request(&mut core, p, a.gen_len)?;
            tg.push(n as f64 / (first + rest));
            progress.inc(1);
        }
        drop(progress);
        let (pm, ps) = mean_sd(&pp);
        let (tm, ts) = mean_sd(&tg);
        println!("| {name} | pp{}{at} | {pm:.2} ± {ps:.2} |", a.prompt_len);
        println!("| {name} | tg{}{at} | {tm:.2} ± {ts:.2} |", a.gen_len);
        if core.speculative().is_some() {
            eprintln!("{}", core.spec_counters.log_line());
        }
        let mut probed = None;
        if let Some(probe) = &probe {
            let prompts: Vec<Vec<u32>> = (0..a.probe_seqs)
                .map(|_| {
                    let mut p = context.clone();
                    p.extend(prompt(a.probe_prompt_len));
                    p
                })
                .collect();
            // One sequence goes on in the engine whose cache holds the context; several get an
            // engine with room for them all.
            let run = if a.probe_seqs == 1 {
                bandwidth_probe::run(&mut core, prompts, a.gen_len, probe)?
            } else {
                let mut many = core_for(depth, budget, a.probe_seqs)?;
                bandwidth_probe::run(&mut many, prompts, a.gen_len, probe)?
            };
            probed = run.summary(a.probe_seqs);
            match &probed {
                Some(s) => eprintln!("{}", s.line(&format!("tg{}{at}", a.gen_len))),
                None => eprintln!(
                    "bandwidth probe: no decode step of all {} sequence(s) to measure (--gen-len {}, speculation, \
                     or kernels that count no weight bytes on this device)",
                    a.probe_seqs, a.gen_len
                ),
            }
        }
        results.push(serde_json::json!({
            "depth": depth,
            "context_prefill_s": prefill,
            "pp": {"n": a.prompt_len, "mean": pm, "sd": ps, "samples": pp},
            "tg": {"n": a.gen_len, "mean": tm, "sd": ts, "samples": tg},
            "bandwidth_probe": probed,
            "spec_decode": core.speculative().map(|_| serde_json::json!({
                "drafts": core.spec_counters.drafts,
                "draft_tokens": core.spec_counters.draft_tokens,
                "accepted_tokens": core.spec_counters.accepted_tokens,
                "mean_acceptance_length": core.spec_counters.mean_acceptance_length(),
            })),
        }));
    }
    if let Some(path) = &a.json {
        let first = results.first().cloned().unwrap_or_default();
        let v = serde_json::json!({
            "model": lm.source, "dtype": format!("{:?}", lm.model.dtype()),
            "device": a.device.device.to_string(),
            "kv_cache_dtype": kv,
            // Depth 0 (or the first depth) at the top level, as earlier versions wrote it.
            "pp": first.get("pp"), "tg": first.get("tg"),
            "depths": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}
