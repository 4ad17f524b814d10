//! The accept loop: HTTP/1.1 connections served by hyper with a header-read timeout (a client
//! that trickles its headers, or sits on an idle keep-alive connection, is dropped), a bound on
//! open connections (past it a connection gets a 503 in OpenAI's envelope and is closed, so
//! sockets cannot pile up to the file-descriptor limit), and a graceful close that lets every
//! response already started finish writing. axum's own `serve` has none of these knobs.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

use crate::error::ApiError;

#[derive(Debug, Clone, Copy)]
pub struct TransportConfig {
    /// A request's headers (and the wait for the next request on a kept-alive connection) must
    /// arrive within this.
    pub header_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

/// Accept and serve connections until `stop` turns true; returns the tracker of connections
/// still open, to be closed gracefully.
pub async fn accept_loop(
    listener: TcpListener,
    app: Router,
    cfg: TransportConfig,
    mut stop: watch::Receiver<bool>,
) -> GracefulShutdown {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(cfg.max_connections.max(1)));
    let mut builder = http1::Builder::new();
    // A 64 KiB read buffer (hyper lets it grow to about twice that): larger headers get hyper's
    // 431. Bodies stream through it whatever their size.
    builder.timer(TokioTimer::new()).header_read_timeout(cfg.header_timeout).max_buf_size(64 << 10);
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors or a connection reset before accept: not fatal. A short
                // pause keeps an exhausted process from spinning.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream, cfg.max_connections));
            continue;
        };
        let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended with an error: {e}");
            }
            drop(slot);
        });
    }
    graceful
}

/// Answer a connection over the limit with a 503 in OpenAI's envelope, without reading it.
async fn refuse(mut stream: TcpStream, limit: usize) {
    let e = ApiError::unavailable(format!("The server has {limit} connections open (--max-connections); retry later."));
    let body = e.body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), write).await;
}
