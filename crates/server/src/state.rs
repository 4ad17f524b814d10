//! What every handler shares: the configuration, the model once loaded, the admission counter
//! and the metrics.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use flint_engine::chat_template::ChatTemplate;
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{CacheInfo, Router};

use crate::error::ApiError;
use crate::metrics::Metrics;

/// The loaded model as the server sees it: its workers behind a router, and how to talk to them.
/// No tensors.
pub struct ServingModel {
    pub router: Router,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub max_model_len: usize,
    /// The KV cache's type and geometry (for `/metrics`).
    pub cache: CacheInfo,
    /// Where the model runs, one entry per worker (`cpu`, `cuda:0`), for `/version`.
    pub devices: Vec<String>,
    /// The width of the model's hidden states: an embedding's full size.
    pub hidden_size: usize,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Required as `Authorization: Bearer <key>` on every route but `/health` and `/metrics`.
    pub api_key: Option<String>,
    pub served_model_name: String,
    /// Requests accepted beyond those the engine runs at once; more get 429.
    pub max_queued_requests: usize,
    pub max_body_bytes: usize,
    /// After SIGINT/SIGTERM, how long in-flight requests may take to finish.
    pub shutdown_grace: Duration,
    /// A request's headers must arrive within this (also the idle limit of a kept-alive connection).
    pub header_timeout: Duration,
    /// A POST body must arrive within this once its headers have.
    pub body_timeout: Duration,
    /// Connections open at once; more get a 503 and are closed.
    pub max_connections: usize,
    /// Most top logprobs a request may ask for per token (`--max-logprobs`, vLLM's default 20).
    pub max_logprobs: usize,
    /// Most sequences (prompts × n) one request may hold (`--max-seqs-per-request`; `None`: half
    /// of what the server holds, running and queued), so one request cannot fill the queue that
    /// everyone shares.
    pub max_seqs_per_request: Option<usize>,
    /// Constraints compiled at once (`--grammar-compile-threads`; `None`: one per four cores).
    pub grammar_compile_threads: Option<usize>,
    /// How long a constraint may take to compile, queue included, before the request gets a 400.
    pub grammar_compile_timeout: Duration,
    /// Split a reasoning model's chain of thought from its answer (`--reasoning-parser`).
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// Test-only routes (`POST /debug/workers/{i}/fault`): never on in production.
    pub test_hooks: bool,
    /// Export an OpenTelemetry span per request (`--otlp-traces-endpoint`; the binary installs
    /// the exporter).
    pub otlp_traces: bool,
    /// Serve `/v1/embeddings`, pooling this way (`--runner pooling`); `None`: generation only.
    pub pooler: Option<flint_engine::pooling::PoolerConfig>,
}

/// The 503 while the model loads says how far loading is (`loading weights: 12/28 layers (42%)`).
fn loading_message() -> String {
    match flint_engine::progress::current() {
        Some(p) => format!("The model is still loading ({p})."),
        None => "The model is still loading.".to_string(),
    }
}

const LOADING: u8 = 0;
const READY: u8 = 1;
const FAILED: u8 = 2;
const SHUTTING_DOWN: u8 = 3;

pub struct AppState {
    pub cfg: ServerConfig,
    pub metrics: Metrics,
    model: OnceLock<Arc<ServingModel>>,
    status: AtomicU8,
    load_error: OnceLock<String>,
    in_flight: AtomicUsize,
    /// Turns true when the shutdown grace period is over: requests still running end now, each
    /// with an error its client can see.
    deadline: tokio::sync::watch::Sender<bool>,
    pub started: Instant,
    pub started_unix: u64,
}

pub type SharedState = Arc<AppState>;

impl AppState {
    pub fn new(cfg: ServerConfig) -> SharedState {
        let metrics = Metrics::new(&cfg.served_model_name);
        Arc::new(Self {
            cfg,
            metrics,
            model: OnceLock::new(),
            status: AtomicU8::new(LOADING),
            load_error: OnceLock::new(),
            in_flight: AtomicUsize::new(0),
            deadline: tokio::sync::watch::Sender::new(false),
            started: Instant::now(),
            started_unix: crate::output::now_unix(),
        })
    }

    pub fn set_model(&self, m: ServingModel) {
        if let Some(n) = self.cfg.grammar_compile_threads {
            m.router.grammars().set_compile_threads(n);
        }
        let _ = self.model.set(Arc::new(m));
        self.status.store(READY, Ordering::SeqCst);
    }

    pub fn set_failed(&self, e: String) {
        let _ = self.load_error.set(e);
        self.status.store(FAILED, Ordering::SeqCst);
    }

    pub fn begin_shutdown(&self) {
        self.status.store(SHUTTING_DOWN, Ordering::SeqCst);
    }

    /// The grace period is over: running requests are to end now.
    pub fn pass_deadline(&self) {
        self.deadline.send_replace(true);
    }

    /// Resolves once the shutdown deadline has passed (never, while the server runs normally).
    pub fn deadline_passed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.deadline.subscribe();
        async move {
            if rx.wait_for(|passed| *passed).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// The model, or why requests cannot be served now (503).
    pub fn model(&self) -> Result<Arc<ServingModel>, ApiError> {
        match self.status.load(Ordering::SeqCst) {
            READY => {}
            LOADING => return Err(ApiError::unavailable(loading_message())),
            SHUTTING_DOWN => return Err(ApiError::unavailable("The server is shutting down.")),
            _ => {
                let why = self.load_error.get().map_or("unknown error", String::as_str);
                return Err(ApiError::unavailable(format!("The model failed to load: {why}")));
            }
        }
        let m = self.model.get().cloned().ok_or_else(|| ApiError::unavailable(loading_message()))?;
        if !m.router.is_healthy() {
            return Err(ApiError::unavailable("No worker is running: every engine has stopped."));
        }
        Ok(m)
    }

    /// The model whatever the status (to stop its engine at exit).
    pub fn model_for_shutdown(&self) -> Result<Arc<ServingModel>, ApiError> {
        self.model.get().cloned().ok_or_else(|| ApiError::unavailable("no model"))
    }

    /// Admit a request of `seqs` engine sequences (prompts × n), before any of its work is done,
    /// or 429 when running + queued sequences would pass `max_num_seqs + max_queued_requests`.
    /// A request larger than that limit on its own could only ever run by locking everyone else
    /// out, so it is refused (400 naming `param`) whatever the server is doing.
    pub fn admit(self: &Arc<Self>, m: &ServingModel, seqs: usize, param: &str) -> Result<InFlight, ApiError> {
        let running = m.router.max_num_seqs();
        let limit = running + self.cfg.max_queued_requests;
        let (share, flag) = match self.cfg.max_seqs_per_request {
            Some(n) => (n, "--max-seqs-per-request"),
            None => (limit.div_ceil(2), "half of --max-num-seqs over the live workers + --max-queued-requests"),
        };
        let share = share.min(limit);
        if seqs > share {
            return Err(ApiError::invalid(
                param,
                format!(
                    "This request asks for {seqs} sequences (prompts × n); one request may hold at most {share} \
                     ({flag}), so that others still get in. Split it into smaller requests."
                ),
            ));
        }
        let prev = self.in_flight.fetch_add(seqs, Ordering::SeqCst);
        if prev + seqs > limit {
            self.in_flight.fetch_sub(seqs, Ordering::SeqCst);
            return Err(ApiError::overloaded(prev.saturating_sub(running)));
        }
        Ok(InFlight { state: self.clone(), seqs, submitted: false, done: false })
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Resolves when no admitted request is left.
    pub async fn until_idle(&self) {
        while self.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One admitted request. Dropped without [`finish`](Self::finish) means the client went away.
pub struct InFlight {
    state: SharedState,
    seqs: usize,
    /// Its engine requests were submitted (before that, a drop is not an abort of anything).
    submitted: bool,
    done: bool,
}

impl InFlight {
    /// The engine has the request: from now on, a drop without `finish` is an abort.
    pub fn submitted(&mut self) {
        self.submitted = true;
    }

    /// The request ended (answered, or failed with an error response): not an abort.
    pub fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(self.seqs, Ordering::SeqCst);
        if self.submitted && !self.done {
            self.state.metrics.aborted();
            tracing::info!("request aborted: the client disconnected");
        }
    }
}
