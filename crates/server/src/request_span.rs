//! vLLM's OpenTelemetry request span (`--otlp-traces-endpoint`): one span named `llm_request`
//! per finished request, kind SERVER, starting at the request's arrival, a child of the client's
//! trace when the request carried a W3C `traceparent`, with vLLM's `gen_ai.*` attributes.
//!
//! The server uses only the OpenTelemetry API: the binary installs the exporter and the W3C
//! propagator as the global ones. Without the flag nothing here runs beyond one boolean check.

use std::time::{Duration, Instant, SystemTime};

use axum::http::HeaderMap;
use flint_engine::RequestParams;
use opentelemetry::propagation::Extractor;
use opentelemetry::trace::{SpanKind, Tracer};
use opentelemetry::{global, Context, KeyValue};

use crate::state::AppState;

/// When a request arrived, and the trace it belongs to if spans are exported.
pub struct Arrival {
    pub at: Instant,
    wall: SystemTime,
    /// `Some` when spans are exported: the caller's trace context (empty without `traceparent`).
    parent: Option<Context>,
}

impl Arrival {
    pub fn new(state: &AppState, headers: &HeaderMap) -> Self {
        let parent = state.cfg.otlp_traces.then(|| global::get_text_map_propagator(|p| p.extract(&Headers(headers))));
        Self { at: Instant::now(), wall: SystemTime::now(), parent }
    }
}

/// `traceparent` / `tracestate` as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The span of a request being served: what it asked for, filled in with what it got at the end.
pub struct RequestSpan {
    parent: Context,
    start: SystemTime,
    attributes: Vec<KeyValue>,
}

/// How a request went, as the span reports it (seconds from arrival).
pub struct SpanTiming {
    pub queue: Option<f64>,
    pub first_token: Option<f64>,
    pub e2e: f64,
}

/// What a request produced, as the span reports it.
pub struct SpanUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl RequestSpan {
    /// `None` unless spans are exported.
    pub fn new(arrival: &Arrival, id: &str, params: &RequestParams, model: &str) -> Option<Self> {
        let parent = arrival.parent.clone()?;
        let s = &params.sampling;
        let attributes = vec![
            KeyValue::new("gen_ai.request.id", id.to_string()),
            KeyValue::new("gen_ai.response.model", model.to_string()),
            KeyValue::new("gen_ai.request.n", params.n as i64),
            KeyValue::new("gen_ai.request.max_tokens", params.max_tokens as i64),
            KeyValue::new("gen_ai.request.temperature", f64::from(s.temperature)),
            KeyValue::new("gen_ai.request.top_p", f64::from(s.top_p)),
        ];
        Some(Self { parent, start: arrival.wall, attributes })
    }

    /// Export the span, ending now. vLLM's latency attributes: time in queue (arrival to first
    /// scheduled), to first token, end to end, and the model's share split at the first token
    /// (prefill: first scheduled to first token; decode: first token to the end).
    pub fn end(mut self, t: &SpanTiming, u: &SpanUsage, sequences: usize) {
        let a = &mut self.attributes;
        a.push(KeyValue::new("gen_ai.usage.prompt_tokens", u.prompt_tokens as i64));
        a.push(KeyValue::new("gen_ai.usage.completion_tokens", u.completion_tokens as i64));
        a.push(KeyValue::new("gen_ai.usage.num_sequences", sequences as i64));
        a.push(KeyValue::new("gen_ai.latency.e2e", t.e2e));
        let queue = t.queue.unwrap_or(0.0);
        if t.queue.is_some() {
            a.push(KeyValue::new("gen_ai.latency.time_in_queue", queue));
        }
        if let Some(ttft) = t.first_token {
            a.push(KeyValue::new("gen_ai.latency.time_to_first_token", ttft));
            a.push(KeyValue::new("gen_ai.latency.time_in_model_prefill", (ttft - queue).max(0.0)));
            a.push(KeyValue::new("gen_ai.latency.time_in_model_decode", (t.e2e - ttft).max(0.0)));
        }
        a.push(KeyValue::new("gen_ai.latency.time_in_model_inference", (t.e2e - queue).max(0.0)));
        let tracer = global::tracer("flint");
        let end = self.start + Duration::from_secs_f64(t.e2e.max(0.0));
        let mut span = tracer
            .span_builder("llm_request")
            .with_kind(SpanKind::Server)
            .with_start_time(self.start)
            .with_attributes(std::mem::take(&mut self.attributes))
            .start_with_context(&tracer, &self.parent);
        opentelemetry::trace::Span::end_with_timestamp(&mut span, end);
    }
}
