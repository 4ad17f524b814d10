//! flint's OpenAI-compatible HTTP server (axum + tokio). It knows the engine's request/event API
//! and the tokenizer, never tensors: the binary loads the model and hands over a
//! [`ServingModel`].

pub mod api_types;
pub mod body;
pub mod body_counts;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod error;
pub mod generation;
pub mod json;
pub mod limits;
pub mod metrics;
pub mod output;
pub mod prompt_tokens;
pub mod protocol;
pub mod reasoning;
pub mod request_span;
pub mod responses;
pub mod routes;
pub mod state;
pub mod structured;
pub mod tools;
pub mod transport;

use std::time::Duration;

pub use error::ApiError;
pub use state::{AppState, ServerConfig, ServingModel};
use transport::TransportConfig;

/// Bind, load the model in the background (`/health` answers 503 meanwhile), serve until
/// SIGINT/SIGTERM. Then new requests and `/health` get 503 while in-flight requests have
/// `shutdown_grace` to finish; those still running at the deadline end with an error their
/// client sees (a final SSE error event and `[DONE]`, or a 503). A model that fails to load ends
/// the server with that error.
/// vLLM's periodic speculative-decoding line, every 10 s while drafts are being verified.
async fn log_spec_decoding(engine: flint_engine::Router) {
    let mut last = 0;
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(10)).await;
        let Some(spec) = engine.stats().spec_counters() else { return };
        if spec.drafts != last {
            last = spec.drafts;
            tracing::info!("{}", spec.log_line());
        }
    }
}

pub async fn serve<F>(cfg: ServerConfig, load: F) -> Result<(), String>
where
    F: FnOnce() -> Result<ServingModel, String> + Send + 'static,
{
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let grace = cfg.shutdown_grace;
    let transport = TransportConfig { header_timeout: cfg.header_timeout, max_connections: cfg.max_connections };
    let state = AppState::new(cfg);
    tracing::info!("listening on http://{local} (model loading)");

    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
    let loader_state = state.clone();
    let loading = tokio::task::spawn_blocking(load);
    tokio::spawn(async move {
        // A loader that panics fails the server like one that returns an error.
        let outcome = loading.await.unwrap_or_else(|_| Err("the model loader panicked".into()));
        match outcome {
            Ok(m) => {
                let engine = m.router.clone();
                loader_state.set_model(m);
                tracing::info!("ready: serving {} at http://{local}", loader_state.cfg.served_model_name);
                tokio::spawn(log_spec_decoding(engine));
            }
            Err(e) => {
                loader_state.set_failed(e.clone());
                let _ = failed_tx.send(e);
            }
        }
    });

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let app = routes::router(state.clone());
    let accepting = tokio::spawn(transport::accept_loop(listener, app, transport, stop_rx));
    let result = tokio::select! {
        _ = shutdown_signal() => Ok(()),
        Ok(e) = failed_rx => Err(format!("the model failed to load: {e}")),
    };
    // From here new requests and /health get 503; the listener stays open so clients hear so.
    state.begin_shutdown();
    if result.is_ok() {
        tracing::info!(
            "shutting down: {} request(s) in flight, up to {}s to finish",
            state.in_flight(),
            grace.as_secs()
        );
    }
    if tokio::time::timeout(grace, state.until_idle()).await.is_err() {
        tracing::warn!("grace period over with {} request(s) unfinished; ending them with an error", state.in_flight());
        state.pass_deadline();
        // Their last events are queued at once; give the connections a moment to write them.
        let _ = tokio::time::timeout(Duration::from_secs(2), state.until_idle()).await;
    }
    let _ = stop_tx.send(true);
    if let Ok(open) = accepting.await {
        // Responses already under way finish writing; idle connections close.
        if tokio::time::timeout(Duration::from_secs(2), open.shutdown()).await.is_err() {
            tracing::warn!("some connections did not close in time");
        }
    }
    if let Ok(m) = state.model_for_shutdown() {
        m.router.shutdown();
    }
    result
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
