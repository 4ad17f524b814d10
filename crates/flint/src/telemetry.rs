//! What the process reports about itself besides its answers: the log on stderr, a Chrome trace of
//! the engine's scopes (`--trace-dir`), and OpenTelemetry request spans sent to a collector
//! (`--otlp-traces-endpoint`).
//!
//! The engine and the model mark their scopes with `tracing` spans (engine step, scheduler,
//! forward, each layer's attention and MLP, the kernels). Nothing records them unless
//! `--trace-dir` is given: the log's filter never enables them, so an unrecorded span costs a
//! cached "not interested" check. With `--trace-dir`, [`crate::chrome_trace`] writes them as
//! Chrome-trace JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.
//!
//! Request spans are not `tracing` spans: vLLM's `llm_request` span starts at the request's
//! arrival and gets its attributes when it ends, which the OpenTelemetry API expresses directly.
//! The server builds them with that API; this module installs the SDK's exporter behind it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{filter_fn, EnvFilter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Keeps the trace file open; dropping it writes the file's end.
pub struct Telemetry {
    _chrome: Option<crate::chrome_trace::FlushGuard>,
}

/// Install the global subscriber: the log (RUST_LOG, default "info") on stderr, plus the engine's
/// spans into `trace_dir/flint-trace-<pid>.json` when asked.
pub fn init(trace_dir: Option<&Path>) -> Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let log = tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr).with_filter(filter);
    let Some(dir) = trace_dir else {
        let _ = tracing_subscriber::registry().with(log).try_init();
        return Ok(Telemetry { _chrome: None });
    };
    let path = trace_file(dir)?;
    // Spans only (log events stay in the log), and only flint's own: the scopes are what a
    // trace is for, and every other span would be noise and cost.
    let (chrome, guard) =
        crate::chrome_trace::layer(&path).with_context(|| format!("--trace-dir: cannot write {}", path.display()))?;
    let chrome = chrome.with_filter(filter_fn(|m| m.is_span() && m.target().starts_with("flint")));
    let _ = tracing_subscriber::registry().with(log).with(chrome).try_init();
    tracing::info!("writing a Chrome trace of the engine's scopes to {}", path.display());
    Ok(Telemetry { _chrome: Some(guard) })
}

fn trace_file(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("--trace-dir {}: cannot create it", dir.display()))?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let path = dir.join(format!("flint-trace-{stamp}-{}.json", std::process::id()));
    Ok(path)
}

/// The OTLP exporter for `--otlp-traces-endpoint`, installed as the global tracer provider the
/// server's request spans go to. Shut it down at exit so the last batch is sent.
pub fn otlp_provider(endpoint: &str, service_name: &str) -> Result<SdkTracerProvider> {
    let protocol = otlp_protocol()?;
    let url = otlp_url(endpoint)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .with_endpoint(url)
        .build()
        .with_context(|| format!("--otlp-traces-endpoint {endpoint}"))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service_name.to_string()))
        .build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    // W3C trace context: an incoming `traceparent` makes the request's span a child of it.
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    Ok(provider)
}

/// OTLP/HTTP with protobuf bodies, the protocol's default. vLLM's default is gRPC; a user who set
/// the standard variable to it is told what to change rather than exporting nothing.
fn otlp_protocol() -> Result<Protocol> {
    for var in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Ok(v) = std::env::var(var) {
            return match v.trim() {
                "http/protobuf" => Ok(Protocol::HttpBinary),
                other => bail!(
                    "{var}={other:?}: flint exports OTLP over HTTP with protobuf bodies only; set it to \
                     http/protobuf (or unset it) and point --otlp-traces-endpoint at the collector's \
                     HTTP port (usually 4318)"
                ),
            };
        }
    }
    Ok(Protocol::HttpBinary)
}

/// The collector URL: given with no path (`http://host:4318`), OTLP/HTTP's trace path is added.
fn otlp_url(endpoint: &str) -> Result<String> {
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        bail!("--otlp-traces-endpoint {endpoint:?}: expected an http:// or https:// URL, e.g. http://localhost:4318");
    };
    if scheme != "http" && scheme != "https" {
        bail!("--otlp-traces-endpoint {endpoint:?}: flint sends OTLP over HTTP; use an http:// or https:// URL");
    }
    Ok(match rest.find('/') {
        None => format!("{endpoint}/v1/traces"),
        Some(i) if rest[i..] == *"/" => format!("{scheme}://{}v1/traces", &rest[..=i]),
        Some(_) => endpoint.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_collector_address_gets_the_trace_path() {
        assert_eq!(otlp_url("http://localhost:4318").unwrap(), "http://localhost:4318/v1/traces");
        assert_eq!(otlp_url("http://localhost:4318/").unwrap(), "http://localhost:4318/v1/traces");
        assert_eq!(otlp_url("https://c.example/otlp/v1/traces").unwrap(), "https://c.example/otlp/v1/traces");
        assert!(otlp_url("localhost:4317").unwrap_err().to_string().contains("http://"));
        assert!(otlp_url("grpc://localhost:4317").unwrap_err().to_string().contains("over HTTP"));
    }
}
