//! `flint bench throughput`: offline throughput through the real engine (step thread, paged cache,
//! scheduler), vLLM's `benchmark_throughput` in spirit: random prompts of a fixed length, EOS
//! ignored so every request makes exactly `--output-len` tokens, all submitted at once.
//! `--sweep` repeats that at concurrency 1, 2, 4, 8, 16, 32 and writes JSON and an SVG plot.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use flint_engine::{build_core, load_draft, plan, Engine, EngineEvent, LoadedModel, Request, RequestParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::engine_args::EngineArgs;
use crate::plot::{render_svg, Chart, Series};

#[derive(clap::Args)]
pub struct ThroughputArgs {
    /// Local directory, .gguf file, or hub id; omitted: the built-in demo model.
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value_t = 32)]
    num_prompts: usize,
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run concurrency 1, 2, 4, 8, 16, 32 (max-num-seqs at each; `--waves` × concurrency prompts).
    #[arg(long)]
    sweep: bool,
    /// With --sweep: prompts per level = waves × concurrency.
    #[arg(long, default_value_t = 1)]
    waves: usize,
    /// Constrain every request, as vLLM's `structured_outputs` field does: a JSON object with one
    /// of json (a schema), regex, choice, grammar (Lark) or json_object. Samples end where the
    /// grammar completes, so choose one that runs for --output-len tokens to time decoding.
    #[arg(long)]
    structured_output: Option<String>,
    /// Where --sweep writes throughput-sweep.json and throughput-sweep.svg.
    #[arg(long, default_value = "bench-results")]
    out_dir: PathBuf,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Debug, Clone, serde::Serialize)]
struct Level {
    concurrency: usize,
    num_prompts: usize,
    elapsed_s: f64,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    total_tokens_per_s: f64,
    mean_ttft_s: f64,
    /// Output tokens/s once every request had its first token (all prompts ingested): the
    /// batched-decode rate, without the prefill phase that dominates short runs.
    decode_tokens_per_s: f64,
    preemptions: u64,
    /// Speculative decoding: draft tokens proposed and accepted, and tokens per verification.
    #[serde(skip_serializing_if = "Option::is_none")]
    spec_decode: Option<SpecSummary>,
    /// Structured output: what the grammar masks cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    grammar_masks: Option<MaskSummary>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct MaskSummary {
    masks: u64,
    mean_us: f64,
    /// The histogram bucket bound at or below which 99% of the masks fall.
    p99_bound_us: f64,
    /// Seconds of mask computation per second of the run (summed over the kernel threads).
    share_of_elapsed: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
struct SpecSummary {
    draft_tokens: u64,
    accepted_tokens: u64,
    mean_acceptance_length: f64,
}

pub fn throughput(a: ThroughputArgs) -> Result<()> {
    if a.num_prompts == 0 || a.input_len == 0 || a.output_len == 0 || a.waves == 0 {
        bail!("--num-prompts, --input-len, --output-len and --waves must be at least 1");
    }
    let lm = LoadedModel::load(a.model.as_deref(), &a.engine.device.open()?, None)?;
    // A draft model (speculative decoding) is loaded once for every level.
    let draft = load_draft(&lm, &a.engine.config()?)?;
    let vocab = lm.ordinary_vocab();
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut prompt = || (0..a.input_len).map(|_| rng.random_range(0..vocab)).collect::<Vec<u32>>();
    eprintln!("model {} ({:?}), input {} / output {} tokens", lm.source, lm.model.dtype(), a.input_len, a.output_len);
    if !a.sweep {
        let prompts: Vec<Vec<u32>> = (0..a.num_prompts).map(|_| prompt()).collect();
        let level = run_level(&lm, draft.as_ref(), &a, a.engine.max_num_seqs, prompts)?;
        print_level(&level);
        return Ok(());
    }
    let mut levels = Vec::new();
    for c in [1usize, 2, 4, 8, 16, 32] {
        let prompts: Vec<Vec<u32>> = (0..c * a.waves).map(|_| prompt()).collect();
        let level = run_level(&lm, draft.as_ref(), &a, c, prompts)?;
        print_level(&level);
        levels.push(level);
    }
    std::fs::create_dir_all(&a.out_dir).with_context(|| format!("creating {}", a.out_dir.display()))?;
    let json = serde_json::json!({
        "model": lm.source,
        "dtype": format!("{:?}", lm.model.dtype()),
        "input_len": a.input_len,
        "output_len": a.output_len,
        "waves": a.waves,
        "max_num_batched_tokens": a.engine.max_num_batched_tokens,
        "levels": levels,
    });
    let json_path = a.out_dir.join("throughput-sweep.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let chart = Chart {
        title: format!("flint throughput vs concurrency, input {} / output {} tokens", a.input_len, a.output_len),
        x_label: "concurrent sequences".into(),
        y_label: "tokens/s".into(),
        log2_x: true,
        series: vec![
            Series {
                label: "output tok/s".into(),
                points: levels.iter().map(|l| (l.concurrency as f64, l.output_tokens_per_s)).collect(),
            },
            Series {
                label: "decode-phase tok/s".into(),
                points: levels.iter().map(|l| (l.concurrency as f64, l.decode_tokens_per_s)).collect(),
            },
            Series {
                label: "total tok/s (prompt + output)".into(),
                points: levels.iter().map(|l| (l.concurrency as f64, l.total_tokens_per_s)).collect(),
            },
        ],
    };
    let svg_path = a.out_dir.join("throughput-sweep.svg");
    std::fs::write(&svg_path, render_svg(&chart)?).with_context(|| format!("writing {}", svg_path.display()))?;
    eprintln!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

fn run_level(
    lm: &LoadedModel,
    draft: Option<&LoadedModel>,
    a: &ThroughputArgs,
    concurrency: usize,
    prompts: Vec<Vec<u32>>,
) -> Result<Level> {
    let mut ec = a.engine.config()?;
    ec.max_num_seqs = concurrency;
    let pool = plan(lm, draft, &ec)?;
    if !pool.batch_invariant && concurrency == 1 {
        eprintln!("warning: {:?} compute is not batch-invariant: outputs may vary with the batch", lm.model.dtype());
    }
    let engine = Engine::start(build_core(lm, draft, &pool)?);
    let n = prompts.len();
    let mut params = RequestParams { max_tokens: a.output_len, ignore_eos: true, ..Default::default() };
    if let Some(spec) = &a.structured_output {
        let v: serde_json::Value = serde_json::from_str(spec).context("--structured-output is not JSON")?;
        let c = flint_server::structured::structured_outputs(&v)
            .map_err(|e| anyhow::anyhow!("--structured-output: {}", e.message))?
            .context("--structured-output sets no constraint")?;
        // On the compile queue's threads, whose stacks the constraint bounds are sized for.
        let grammar =
            engine.grammars().submit(c).wait_blocking().map_err(|e| anyhow::anyhow!("--structured-output: {e}"))?;
        params.structured = Some(flint_engine::structured::StructuredOutput { grammar, after: None });
    }
    let t0 = Instant::now();
    let mut streams = Vec::with_capacity(n);
    for (i, p) in prompts.into_iter().enumerate() {
        streams.push(engine.submit(Request { id: format!("bench-{i}"), prompt: p, params: params.clone() })?);
    }
    // Poll every stream so each first token is timed when it arrives, not when it is read.
    let (mut out_tokens, mut ttft_sum) = (0usize, 0f64);
    let mut first: Vec<Option<f64>> = vec![None; n];
    let mut open: Vec<bool> = vec![true; n];
    let mut arrivals: Vec<(f64, usize)> = Vec::new();
    let progress = flint_model::progress::task(&format!("concurrency {concurrency}"), "requests", n as u64);
    while open.iter().any(|&o| o) {
        let mut idle = true;
        for (i, s) in streams.iter_mut().enumerate() {
            if !open[i] {
                continue;
            }
            match s.try_next() {
                Ok(Some(EngineEvent::Output(o))) => {
                    idle = false;
                    let now = t0.elapsed().as_secs_f64();
                    first[i].get_or_insert(now);
                    out_tokens += o.token_ids.len();
                    arrivals.push((now, o.token_ids.len()));
                }
                Ok(Some(EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e))) => {
                    bail!("request {} failed: {e}", s.id())
                }
                Ok(None) => {}
                Err(()) => {
                    open[i] = false;
                    progress.inc(1);
                }
            }
        }
        if idle {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    drop(progress);
    ttft_sum += first.iter().map(|f| f.unwrap_or(0.0)).sum::<f64>();
    let elapsed = t0.elapsed().as_secs_f64();
    let all_started = first.iter().map(|f| f.unwrap_or(0.0)).fold(0.0, f64::max);
    let decode_tokens: usize = arrivals.iter().filter(|(t, _)| *t > all_started).map(|(_, k)| k).sum();
    let preemptions = engine.stats().num_preemptions;
    let spec_decode = engine.stats().spec_counters().map(|c| SpecSummary {
        draft_tokens: c.draft_tokens,
        accepted_tokens: c.accepted_tokens,
        mean_acceptance_length: c.mean_acceptance_length(),
    });
    let h = engine.stats().grammar_masks;
    let grammar_masks = (h.count > 0).then(|| MaskSummary {
        masks: h.count,
        mean_us: h.mean_secs() * 1e6,
        p99_bound_us: h.quantile_bound(0.99) * 1e6,
        share_of_elapsed: h.sum_secs / elapsed,
    });
    engine.shutdown();
    Ok(Level {
        concurrency,
        num_prompts: n,
        elapsed_s: elapsed,
        requests_per_s: n as f64 / elapsed,
        output_tokens_per_s: out_tokens as f64 / elapsed,
        total_tokens_per_s: (out_tokens + n * a.input_len) as f64 / elapsed,
        mean_ttft_s: ttft_sum / n as f64,
        decode_tokens_per_s: decode_tokens as f64 / (elapsed - all_started).max(1e-9),
        preemptions,
        spec_decode,
        grammar_masks,
    })
}

fn print_level(l: &Level) {
    println!(
        "concurrency {:>2}: {} requests in {:.2}s | {:.3} requests/s, {:.2} output tok/s, {:.2} total tok/s | mean TTFT {:.2}s | decode phase {:.2} tok/s | preemptions {}",
        l.concurrency,
        l.num_prompts,
        l.elapsed_s,
        l.requests_per_s,
        l.output_tokens_per_s,
        l.total_tokens_per_s,
        l.mean_ttft_s,
        l.decode_tokens_per_s,
        l.preemptions
    );
    if let Some(s) = &l.spec_decode {
        println!(
            "  speculative decoding: {} of {} draft tokens accepted, mean acceptance length {:.2}",
            s.accepted_tokens, s.draft_tokens, s.mean_acceptance_length
        );
    }
    if let Some(m) = &l.grammar_masks {
        println!(
            "  structured output: {} masks, mean {:.1} µs, p99 <= {:.0} µs, {:.1}% of the run's time",
            m.masks,
            m.mean_us,
            m.p99_bound_us,
            100.0 * m.share_of_elapsed
        );
    }
}
