//! flint's OpenAI-compatible HTTP server (axum + tokio). It knows the engine's request/event API
//! and the tokenizer, never tensors: the binary loads the model and hands over a
//! [`ServingModel`].

pub mod chat;
pub mod completions;
pub mod error;
pub mod generation;
pub mod metrics;
pub mod output;
pub mod protocol;
pub mod routes;
pub mod state;
pub mod tools;

use std::future::IntoFuture;

pub use error::ApiError;
pub use state::{AppState, ServerConfig, ServingModel};

/// Bind, load the model in the background (`/health` answers 503 meanwhile), serve until
/// SIGINT/SIGTERM, then stop accepting and give in-flight requests `shutdown_grace` to finish.
/// A model that fails to load ends the server with that error.
pub async fn serve<F>(cfg: ServerConfig, load: F) -> Result<(), String>
where
    F: FnOnce() -> Result<ServingModel, String> + Send + 'static,
{
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let grace = cfg.shutdown_grace;
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
                loader_state.set_model(m);
                tracing::info!("ready: serving {} at http://{local}", loader_state.cfg.served_model_name);
            }
            Err(e) => {
                loader_state.set_failed(e.clone());
                let _ = failed_tx.send(e);
            }
        }
    });

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = routes::router(state.clone());
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.await;
            })
            .into_future(),
    );
    let result = tokio::select! {
        _ = shutdown_signal() => Ok(()),
        Ok(e) = failed_rx => Err(format!("the model failed to load: {e}")),
    };
    state.begin_shutdown();
    if result.is_ok() {
        tracing::info!(
            "shutting down: {} request(s) in flight, up to {}s to finish",
            state.in_flight(),
            grace.as_secs()
        );
    }
    let _ = stop_tx.send(());
    if tokio::time::timeout(grace, server).await.is_err() {
        tracing::warn!("grace period over with {} request(s) unfinished; exiting", state.in_flight());
    }
    if let Ok(m) = state.model_for_shutdown() {
        m.engine.shutdown();
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
