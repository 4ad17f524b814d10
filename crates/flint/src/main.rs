//! `flint`: generate text, benchmark the engine, synthesize random checkpoints with real shapes,
//! inspect checkpoints.
//! Every failure ends with one `error: …` line on stderr and a non-zero exit.

mod bandwidth_probe;
mod bench;
mod bench_latency;
mod bench_serve;
mod chrome_trace;
mod engine_args;
mod inspect;
mod plot;
mod pooler_config;
mod progress;
mod serve;
mod stand_in_tokenizer;
mod telemetry;
mod workers;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::{Parser, Subcommand};
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{generate, GenerateRequest, LoadedModel, RequestParams, SamplingParams};
use flint_model::config::Family;
use flint_model::gguf_export::GgufType;
use flint_model::synth::{synth, SynthOptions, SHAPES};

#[derive(Parser)]
#[command(name = "flint", version, about = "An inference server for Qwen2-family models")]
struct Cli {
    /// Threads for the CPU kernels, the calling thread included (default: FLINT_THREADS, else
    /// the physical cores this process may use).
    #[arg(long, global = true, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Write a Chrome trace (open it in ui.perfetto.dev) of the engine's scopes — step,
    /// scheduler, forward, each layer's attention and MLP, kernels — into this directory.
    #[arg(long, global = true, value_name = "DIR")]
    trace_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API (no --model: the built-in demo model).
    Serve(Box<serve::ServeArgs>),
    /// Generate text from a prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a random-weight checkpoint with the exact shapes of a real model.
    Synth(SynthArgs),
    /// Print a checkpoint's geometry, tensors and memory needs.
    Inspect(inspect::InspectArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Offline throughput: random prompts, all submitted at once, EOS ignored.
    Throughput(bench::ThroughputArgs),
    /// Online serving benchmark against a running server; prints vLLM's result block.
    Serve(bench_serve::ServeBenchArgs),
    /// Single-stream prompt processing and generation speed (llama-bench's pp/tg).
    Latency(bench_latency::LatencyArgs),
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// Local directory, .gguf file, or hub id; omitted: the built-in demo model.
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Compute dtype of dense weights: auto = f32 unless that does not fit in memory.
    #[arg(long, default_value = "auto", value_parser = ["auto", "f32", "bf16", "f16"])]
    dtype: String,
    #[command(flatten)]
    device: engine_args::DeviceArg,
    #[command(flatten)]
    kv: engine_args::KvDtypeArg,
    #[command(flatten)]
    spec: engine_args::SpeculativeArg,
}

#[derive(clap::Args)]
struct SynthArgs {
    /// One of the known shapes (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, deepseek-r1-distill-qwen-1.5b, tiny).
    #[arg(long)]
    shape: String,
    #[arg(long)]
    out: PathBuf,
    /// Safetensors dtype.
    #[arg(long, default_value = "bf16", value_parser = ["f32", "bf16", "f16"])]
    dtype: String,
    /// Write one GGUF file of this type instead of safetensors.
    #[arg(long)]
    gguf: Option<GgufType>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// With --shape scripted: the text the model answers every prompt ending in --trigger with
    /// (greedy), then <|im_end|>. A test double for clients: tool calls, stop strings.
    #[arg(long)]
    script: Option<String>,
    /// With --shape scripted: the prompt's last token that starts the script (default: a
    /// newline, which ends every chat prompt's assistant header).
    #[arg(long, default_value = "\n")]
    trigger: String,
}

/// Keep freed activation buffers in the heap for the next step. Each matrix product returns a
/// fresh output (megabytes for a prompt chunk or a batch's logits); above glibc's default mmap
/// threshold every one was a new mapping, page-faulted and zeroed by the kernel, then unmapped:
/// about 4% of a 1.5B prefill profile, and prefill ran 10–15% faster with these settings. Below
/// 32 MiB (glibc's ceiling for the threshold) allocations now come from the heap, and up to
/// 256 MiB of free heap is kept rather than trimmed. An environment's `MALLOC_*_` tunables win.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            // SAFETY: `mallopt` only sets allocator parameters; called before any other thread
            // exists.
            unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) };
        }
        if std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_none() {
            // SAFETY: as above.
            unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20) };
        }
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    // Logs (the server's request lines, start-up banner) go to stderr; RUST_LOG overrides "info".
    // The guard lives until `main` returns, so the trace file is complete.
    let _telemetry = match telemetry::init(cli.trace_dir.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            return ExitCode::FAILURE;
        }
    };
    progress::install();
    if let Some(n) = cli.threads {
        flint_model::kernels::pool::set_threads(n as usize);
    }
    if let Ok(v) = std::env::var("FLINT_THREADS") {
        if cli.threads.is_none() && !v.parse::<u32>().is_ok_and(|n| (1..=1024).contains(&n)) {
            eprintln!("error: FLINT_THREADS={v:?}: expected a thread count from 1 to 1024");
            return ExitCode::FAILURE;
        }
    }
    if let Ok(v) = std::env::var("FLINT_CPU_ISA") {
        if let Err(e) = v.parse::<flint_model::kernels::Isa>() {
            eprintln!("error: FLINT_CPU_ISA: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Ok(v) = std::env::var("FLINT_BF16_COMPUTE") {
        if let Err(e) = v.parse::<flint_model::kernels::matmul_f32::Bf16Compute>() {
            eprintln!("error: FLINT_BF16_COMPUTE: {e}");
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Serve(a) => serve::run(*a),
        Command::Generate(a) => run_generate(a),
        Command::Bench(BenchCommand::Throughput(a)) => bench::throughput(a),
        Command::Bench(BenchCommand::Serve(a)) => bench_serve::run(a),
        Command::Bench(BenchCommand::Latency(a)) => bench_latency::run(a),
        Command::Synth(a) => run_synth(a),
        Command::Inspect(a) => inspect::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the chain of contexts joined, newlines flattened.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        ..Default::default()
    };
    sampling.validate()?;
    let speculative = a.spec.get()?;
    let dtype = engine_args::parse_dtype(&a.dtype);
    let device = a.device.open()?;
    let lm = LoadedModel::load(a.model.as_deref(), &device, dtype)?;
    let kv = match a.device.device {
        flint_model::device::DeviceSpec::Cpu => a.kv.get().unwrap_or(flint_model::KvCacheDtype::F32).to_string(),
        d => format!("{} on {d}", lm.model.dtype().as_str()),
    };
    eprintln!("loaded {} on {} ({:?} compute, {kv} KV cache)", lm.source, a.device.device, lm.model.dtype());
    if let Some(note) = lm.bf16_note() {
        eprintln!("{note}");
    }
    let prompt_ids = if a.chat {
        let template = lm
            .chat_template
            .as_ref()
            .context("--chat: the model has no chat template (no tokenizer_config.json chat_template or GGUF tokenizer.chat_template)")?;
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": a.prompt}));
        let text = template.render(&messages, None, true, &serde_json::Map::new())?;
        lm.tokenizer.encode(&text, false)?
    } else {
        lm.tokenizer.encode(&a.prompt, false)?
    };
    if prompt_ids.is_empty() {
        bail!("--prompt encodes to no tokens");
    }
    let req = GenerateRequest {
        prompt_ids,
        params: RequestParams { sampling, max_tokens: a.max_tokens, ignore_eos: a.ignore_eos, ..Default::default() },
        kv_cache_dtype: a.kv.get(),
        speculative,
    };
    let stdout = std::io::stdout();
    let out = generate(&lm, &req, |piece| {
        let mut lock = stdout.lock();
        // A closed pipe (e.g. `| head`) must not abort generation with a panic.
        let _ = lock.write_all(piece.as_bytes());
        let _ = lock.flush();
    })?;
    println!();
    eprintln!(
        "prefill: {} tokens in {:.3}s ({:.1} tok/s) | decode: {} tokens in {:.3}s ({:.1} tok/s) | generated {} tokens, finish: {}",
        out.prompt_tokens,
        out.prefill_secs,
        out.prefill_tok_per_s(),
        out.decode_steps,
        out.decode_secs,
        out.decode_tok_per_s(),
        out.token_ids.len(),
        out.finished.reason.as_str(),
    );
    if let Some(spec) = &out.speculative {
        eprintln!("{}", spec.log_line());
    }
    Ok(())
}

fn run_synth(a: SynthArgs) -> Result<()> {
    if a.shape == "scripted" {
        return run_scripted(a);
    }
    if a.script.is_some() {
        bail!("--script needs --shape scripted");
    }
    if !SHAPES.contains(&a.shape.as_str()) {
        bail!("--shape {:?} is not known; choose one of {}, scripted", a.shape, SHAPES.join(", "));
    }
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "f16" => DType::F16,
        _ => DType::BF16,
    };
    let tok = Tokenizer::builtin_qwen()?;
    let cfg = flint_model::synth::shape_config(&a.shape)?;
    // The one tokenizer flint ships is Qwen's: it fits the Qwen families' vocabulary, not Llama
    // 3's (128,256 ids) or Mistral's (32,000), whose tokenizers are not in any package we may
    // ship. A Llama GGUF gets a stand-in laid out as Llama 3's (so `flint bench` and llama.cpp
    // load it); safetensors Llama and Mistral shapes are written without one.
    let qwen_vocab = matches!(cfg.family, Family::Qwen2 | Family::Qwen3);
    let stand_in = a.gguf.is_some() && cfg.family == Family::Llama;
    if stand_in {
        eprintln!(
            "note: {} carries a stand-in tokenizer laid out as Llama 3's (Qwen's merges): for benchmarks, \
             not for text",
            a.shape
        );
    } else if !qwen_vocab {
        eprintln!(
            "note: {} is written without a tokenizer (flint ships only Qwen's); copy the real model's \
             tokenizer.json and tokenizer_config.json beside it to serve it",
            a.shape
        );
    }
    let gguf_tokenizer = match a.gguf {
        Some(_) if stand_in => Some(stand_in_tokenizer::llama3_stand_in(&tok, cfg.vocab_size)?),
        Some(_) if qwen_vocab => {
            // The GGUF carries the chat template too, as llama.cpp's converter writes it.
            let mut meta = tok.to_gguf_meta(cfg.vocab_size)?;
            let tc: serde_json::Value = serde_json::from_str(flint_engine::loader::QWEN_TOKENIZER_CONFIG)?;
            meta.chat_template = tc.get("chat_template").and_then(|t| t.as_str()).map(String::from);
            meta.padding_token_id = tc.get("pad_token").and_then(|t| t.as_str()).and_then(|t| tok.token_to_id(t));
            Some(meta)
        }
        _ => None,
    };
    let (tokenizer_json, tokenizer_config_json) = if qwen_vocab {
        (Some(Tokenizer::builtin_qwen_json()?), Some(flint_engine::loader::QWEN_TOKENIZER_CONFIG.as_bytes().to_vec()))
    } else {
        (None, None)
    };
    let started = std::time::Instant::now();
    let report = synth(&SynthOptions {
        shape: a.shape.clone(),
        out: a.out.clone(),
        dtype,
        gguf: a.gguf,
        seed: a.seed,
        tokenizer_json,
        tokenizer_config_json,
        gguf_tokenizer,
    })?;
    eprintln!("wrote {} ({report:?}) in {:.1}s", a.out.display(), started.elapsed().as_secs_f64());
    Ok(())
}

fn run_scripted(a: SynthArgs) -> Result<()> {
    let script = a.script.as_deref().context("--shape scripted needs --script TEXT")?;
    let tok = Tokenizer::builtin_qwen()?;
    let ids = tok.encode(script, false)?;
    if ids.is_empty() {
        bail!("--script encodes to no tokens");
    }
    let trigger_text = a.trigger.replace("\\n", "\n");
    let trigger = match tok.encode(&trigger_text, false)?.as_slice() {
        [t] => *t,
        other => bail!("--trigger {:?} must be exactly one token, it is {}", a.trigger, other.len()),
    };
    let end = tok.token_to_id("<|im_end|>").context("the tokenizer has no <|im_end|>")?;
    // A scripted model is a bigram table: say which token of the script needs two successors, in
    // text, so the script can be rephrased.
    let mut chain = vec![trigger];
    chain.extend(&ids);
    chain.push(end);
    let mut successor = std::collections::HashMap::new();
    for w in chain.windows(2) {
        if let Some(&first) = successor.get(&w[0]).filter(|&&s| s != w[1]) {
            let text = |t: u32| format!("{:?}", tok.decode(&[t], false).unwrap_or_default());
            bail!(
                "--script repeats the token {} followed first by {} and later by {}: a scripted model follows each \
                 token with one token only (it is a bigram table), so scripts that need context, such as a tool call \
                 with two arguments, cannot be written; rephrase (spacing changes the tokens) or script one argument",
                text(w[0]),
                text(first),
                text(w[1])
            );
        }
        successor.insert(w[0], w[1]);
    }
    if a.out.exists() && std::fs::read_dir(&a.out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("{}: output directory is not empty", a.out.display());
    }
    flint_model::scripted::write_scripted(&a.out, 151_936, trigger, &ids, end)?;
    std::fs::write(a.out.join("tokenizer.json"), Tokenizer::builtin_qwen_json()?)?;
    std::fs::write(a.out.join("tokenizer_config.json"), flint_engine::loader::QWEN_TOKENIZER_CONFIG)?;
    eprintln!("wrote {} (a scripted model: {} tokens after token {trigger})", a.out.display(), ids.len());
    Ok(())
}
