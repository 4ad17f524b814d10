//! `flint serve`: load the model (in the background, so `/health` can say 503 meanwhile), start
//! the engine and hand it to the HTTP server.

use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device};
use flint_engine::{build_core, load_draft, plan, Engine, LoadedModel, RoutePolicy, Router};
use flint_server::{ServerConfig, ServingModel};

use crate::engine_args::{parse_bytes, parse_dtype, EngineArgs};
use crate::workers::{self, WorkerSpec};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Local directory, .gguf file, or hub id; omitted: the built-in demo model.
    #[arg(long)]
    model: Option<String>,
    /// Address to bind; 127.0.0.1 keeps the server local, 0.0.0.0 exposes it.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, env = "FLINT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The name clients pass as `model`; default: --model as given (or "flint-demo").
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests accepted beyond --max-num-seqs before new ones get 429.
    #[arg(long, default_value_t = 256)]
    max_queued_requests: usize,
    /// Largest request body (suffixes K, M, G).
    #[arg(long, default_value = "16M", value_parser = parse_bytes)]
    max_request_body: usize,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    /// Seconds a client has to send a request's headers (and to start the next request on a
    /// kept-alive connection) before the connection is closed.
    #[arg(long, default_value_t = 10.0, value_parser = parse_secs)]
    header_timeout: f64,
    /// Seconds a client has to send a POST body once its headers arrived (408 otherwise).
    #[arg(long, default_value_t = 60.0, value_parser = parse_secs)]
    body_timeout: f64,
    /// Connections open at once; more get a 503 and are closed.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Compute dtype of dense weights: auto = f32 unless that does not fit in memory.
    #[arg(long, default_value = "auto", value_parser = ["auto", "f32", "bf16", "f16"])]
    dtype: String,
    /// Most top logprobs a request may ask for per token (logprobs, top_logprobs, prompt_logprobs).
    #[arg(long, default_value_t = flint_engine::request::DEFAULT_MAX_LOGPROBS as u32,
          value_parser = clap::value_parser!(u32).range(0..=flint_engine::request::MAX_LOGPROBS as i64))]
    max_logprobs: u32,
    /// Most sequences (prompts × n) one request may hold; default: half of what the server holds
    /// (--max-num-seqs over the live workers + --max-queued-requests), so others still get in.
    #[arg(long)]
    max_seqs_per_request: Option<usize>,
    /// Constraints (JSON schemas, grammars, tool schemas) compiled at once, on threads that run
    /// below the step loop's priority; default one per four cores, at least one.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    grammar_compile_threads: Option<u16>,
    /// Seconds a constraint may take to compile, waiting for a compile thread included, before
    /// its request gets a 400.
    #[arg(long, default_value_t = 10.0, value_parser = parse_secs)]
    grammar_compile_timeout: f64,
    /// Return a reasoning model's chain of thought (up to `</think>`) as `message.reasoning`,
    /// apart from its answer: deepseek_r1 (R1-Distill-Qwen) or qwen3.
    #[arg(long, value_parser = ["deepseek_r1", "qwen3"])]
    reasoning_parser: Option<String>,
    /// A device worker (repeatable): `device=cpu,threads=N` with optional `kv-cache-memory=`,
    /// `max-num-seqs=`, `dtype=` and `model=` (other weights of the same model, e.g. another
    /// quantization). Each worker is a whole engine; CPU workers get cores of their own. Absent:
    /// one CPU worker with --threads.
    #[arg(long = "worker", value_parser = clap::value_parser!(WorkerSpec))]
    workers: Vec<WorkerSpec>,
    /// How requests are spread over workers: cost (prices prefill and decode per worker, knows
    /// each prefix cache), least-load or round-robin.
    #[arg(long, default_value = "cost", value_parser = clap::value_parser!(RoutePolicy))]
    router: RoutePolicy,
    /// Send one OpenTelemetry span per request (vLLM's `llm_request`, `gen_ai.*` attributes) to
    /// this OTLP/HTTP collector, e.g. http://localhost:4318; an incoming `traceparent` header
    /// makes it a child of the client's trace. OTEL_SERVICE_NAME names the service (default
    /// flint).
    #[arg(long, value_name = "URL")]
    otlp_traces_endpoint: Option<String>,
    /// What the server is for, as vLLM's flag: generate (text), or pooling (also serves
    /// /v1/embeddings: the prompt's final hidden states pooled into one vector).
    #[arg(long, default_value = "generate", value_parser = ["generate", "pooling"])]
    runner: String,
    /// With --runner pooling, e.g. '{"pooling_type": "MEAN", "normalize": true}' (LAST, MEAN or
    /// CLS). Default: the model directory's modules.json (sentence-transformers), else LAST,
    /// normalised.
    #[arg(long, value_name = "JSON")]
    pooler_config: Option<String>,
    /// Test-only routes (POST /debug/workers/N/fault makes worker N's step loop panic).
    #[arg(long, hide = true)]
    enable_test_hooks: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Sends the request spans still batched when the server exits.
struct FlushSpans(opentelemetry_sdk::trace::SdkTracerProvider);

impl Drop for FlushSpans {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            tracing::warn!("OTLP exporter: the last spans were not sent: {e}");
        }
    }
}

/// A positive, finite number of seconds.
fn parse_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

pub fn run(a: ServeArgs) -> Result<()> {
    if a.api_key.as_deref().is_some_and(str::is_empty) {
        bail!("--api-key / FLINT_API_KEY is set but empty");
    }
    let cfg = ServerConfig {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        served_model_name: a
            .served_model_name
            .clone()
            .unwrap_or_else(|| a.model.clone().unwrap_or_else(|| "flint-demo".into())),
        max_queued_requests: a.max_queued_requests,
        max_body_bytes: a.max_request_body,
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        header_timeout: Duration::from_secs_f64(a.header_timeout),
        body_timeout: Duration::from_secs_f64(a.body_timeout),
        max_connections: a.max_connections,
        max_logprobs: a.max_logprobs as usize,
        max_seqs_per_request: a.max_seqs_per_request,
        grammar_compile_threads: a.grammar_compile_threads.map(usize::from),
        grammar_compile_timeout: Duration::from_secs_f64(a.grammar_compile_timeout),
        reasoning_parser: a.reasoning_parser.as_deref().map(str::parse).transpose().map_err(|e: String| anyhow!(e))?,
        test_hooks: a.enable_test_hooks,
        otlp_traces: a.otlp_traces_endpoint.is_some(),
        pooler: crate::pooler_config::resolve(&a.runner, a.pooler_config.as_deref(), a.model.as_deref())?,
    };
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    if a.max_seqs_per_request == Some(0) {
        bail!("--max-seqs-per-request must be at least 1");
    }
    // Built before the runtime: the exporter's blocking HTTP client must not live inside it.
    let otlp = a.otlp_traces_endpoint.as_deref().map(|e| crate::telemetry::otlp_provider(e, "flint")).transpose()?;
    let _flush = otlp.map(FlushSpans);
    let dtype = parse_dtype(&a.dtype);
    let (model, engine_cfg) = (a.model.clone(), a.engine.config()?);
    if !a.workers.is_empty() && a.engine.device.device != flint_model::device::DeviceSpec::Cpu {
        bail!("--device applies without --worker; give each worker its device (--worker device=cuda:0,...)");
    }
    let device = if a.workers.is_empty() { Some(a.engine.device.open()?) } else { None };
    // After the arguments are known to be good: a refusal stays one line.
    tracing::info!("{}", flint_model::kernels::describe());
    if let Some(p) = cfg.pooler {
        let norm = if p.normalize { ", L2-normalised" } else { "" };
        tracing::info!("runner pooling: /v1/embeddings pools the {} hidden state{norm}", p.pooling_type.as_str());
    }
    if !a.workers.is_empty() {
        let (specs, policy) = (a.workers.clone(), a.router);
        let load =
            move || load_workers(&specs, model.as_deref(), dtype, &engine_cfg, policy).map_err(|e| format!("{e:#}"));
        return run_server(cfg, load);
    }
    let load = move || -> Result<ServingModel, String> {
        let device = device.unwrap_or(Device::Cpu);
        let lm = LoadedModel::load(model.as_deref(), &device, dtype).map_err(|e| e.to_string())?;
        let draft = load_draft(&lm, &engine_cfg).map_err(|e| e.to_string())?;
        let pool = plan(&lm, draft.as_ref(), &engine_cfg).map_err(|e| e.to_string())?;
        let core = build_core(&lm, draft.as_ref(), &pool).map_err(|e| e.to_string())?;
        let c = lm.model.config();
        if let Some(note) = lm.bf16_note() {
            tracing::info!("{note}");
        }
        tracing::info!(
            "model {} | {} | {:?} compute | {} layers, hidden {}, {}/{} heads | RoPE theta {} scaling {:?} | max model len {}",
            lm.source,
            flint_model::device::DeviceSpec::of(&device),
            lm.model.dtype(),
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.rope.theta,
            c.rope.scaling,
            pool.sched.max_model_len
        );
        tracing::info!(
            "{} | max-num-seqs {} | max-num-batched-tokens {} | prefix caching {}",
            pool.describe(),
            pool.sched.max_num_seqs,
            pool.sched.max_num_batched_tokens,
            if pool.sched.enable_prefix_caching { "on" } else { "off" }
        );
        if let Some(s) = &pool.speculative {
            let proposer = match &s.draft_model {
                Some(m) => format!("draft model {m}"),
                None => format!("n-gram lookup (window {}..={})", s.prompt_lookup_min, s.prompt_lookup_max),
            };
            tracing::info!(
                "speculative decoding: {proposer}, up to {} tokens per step{}",
                s.num_speculative_tokens,
                s.disable_by_batch_size.map_or(String::new(), |b| format!(", paused above {b} running sequences"))
            );
        }
        if !pool.batch_invariant {
            tracing::warn!(
                "{:?} compute is not batch-invariant: a request's tokens may vary with its batch",
                lm.model.dtype()
            );
        }
        let max_model_len = pool.sched.max_model_len;
        let hidden_size = lm.model.config().hidden_size;
        let LoadedModel { tokenizer, chat_template, .. } = lm;
        Ok(ServingModel {
            hidden_size,
            router: Router::single(Engine::start(core)),
            tokenizer,
            chat_template,
            max_model_len,
            cache: pool.cache_info(),
            devices: vec![flint_model::device::DeviceSpec::of(&device).to_string()],
        })
    };
    run_server(cfg, load)
}

/// Several workers behind the router: build them, profile their rates, log what each is.
fn load_workers(
    specs: &[WorkerSpec],
    model: Option<&str>,
    dtype: Option<DType>,
    base: &flint_engine::EngineConfig,
    policy: RoutePolicy,
) -> Result<ServingModel> {
    let (lm, built) = workers::build(specs, model, dtype, base)?;
    let c = lm.model.config();
    tracing::info!(
        "model {} | {} layers, hidden {}, {}/{} heads | RoPE theta {} scaling {:?}",
        lm.source,
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.rope.theta,
        c.rope.scaling
    );
    for w in &built {
        tracing::info!("{}", w.describe);
        if !w.pool.batch_invariant {
            tracing::warn!("worker {}: this compute dtype is not batch-invariant", w.name);
        }
    }
    let cache = built[0].pool.cache_info();
    let router = Router::new(built.into_iter().map(|w| (w.name, w.engine)).collect(), policy)?;
    if router.num_workers() > 1 {
        // A short profile prices each worker's phases before the first request; the rates then
        // follow real step times.
        // A 512-token context (the batch phase decodes there), or what the model allows.
        let prompt = 512.min(router.max_model_len().saturating_sub(64)).max(8);
        for (name, r) in router.profile(prompt, 16) {
            match r {
                Ok(r) => tracing::info!(
                    "worker {name}: profiled prefill {:.1} tok/s; decode step {:.1} ms + {:.2} ms per sequence \
                     ({:.1} tok/s alone, {:.1} at 32; {prompt}-token context)",
                    r.prefill,
                    r.decode.base_secs * 1e3,
                    r.decode.per_row_secs * 1e3,
                    r.decode.rate_at(1),
                    r.decode.rate_at(32)
                ),
                Err(e) => tracing::warn!("worker {name}: profile failed ({e}); its rates start unmeasured"),
            }
        }
    }
    tracing::info!("router: {} over {} worker(s)", router.policy(), router.num_workers());
    let max_model_len = router.max_model_len();
    let LoadedModel { tokenizer, chat_template, .. } = lm;
    let devices = specs.iter().map(|s| s.device.to_string()).collect();
    let hidden_size = lm.model.config().hidden_size;
    Ok(ServingModel { router, tokenizer, chat_template, max_model_len, cache, devices, hidden_size })
}

fn run_server<F>(cfg: ServerConfig, load: F) -> Result<()>
where
    F: FnOnce() -> Result<ServingModel, String> + Send + 'static,
{
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = rt.block_on(flint_server::serve(cfg, load));
    // Do not wait for a model load still running (a signal during loading): exit now.
    rt.shutdown_background();
    result.map_err(|e| anyhow!(e))
}
