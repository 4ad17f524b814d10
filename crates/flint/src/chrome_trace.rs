//! `--trace-dir`: the engine's `tracing` spans as a Chrome trace (JSON array format, which
//! Perfetto and chrome://tracing open), written cheaply enough to leave on.
//!
//! Hand-written rather than `tracing-chrome` because of what it cost here. That crate builds a
//! JSON value per event and sends each through a channel to a writer thread; with ~200 scopes a
//! decode step (every layer's attention and MLP and their kernels) it took qwen2.5-0.5b Q4_0 from
//! 77 to 56 tok/s on 2 cores: the writer thread steals a core from kernels that wait for each
//! other. Here an event is a 32-byte record pushed onto its thread's own buffer; full buffers go
//! to a writer thread that formats 16k events at a time, and what is left is written at exit.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Events a thread buffers before handing them to the writer.
const BATCH: usize = 16 * 1024;

/// One begin or end of a scope.
struct Event {
    begin: bool,
    name: &'static str,
    /// Microseconds since the trace started.
    ts: f64,
    tid: u64,
    /// The span's integer field, if it has one (`layer = 3`).
    arg: Option<(&'static str, i64)>,
}

enum Msg {
    Events(Vec<Event>),
    ThreadName(u64, String),
}

struct Shared {
    start: Instant,
    tx: Mutex<Option<Sender<Msg>>>,
    /// Every thread's buffer, so the guard can write what is left in them at exit.
    buffers: Mutex<Vec<Buffer>>,
}

static NEXT_TID: AtomicU64 = AtomicU64::new(1);

/// One thread's events, shared with the guard that writes what is left at exit.
type Buffer = Arc<Mutex<Vec<Event>>>;

thread_local! {
    /// This thread's id in the trace and its buffer.
    static LOCAL: RefCell<Option<(u64, Buffer)>> = const { RefCell::new(None) };
}

/// Records spans; see the module docs.
pub struct ChromeLayer {
    shared: Arc<Shared>,
}

/// Writes the rest of the trace and closes the file when dropped.
pub struct FlushGuard {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
}

/// A layer writing to `path` (created already) and the guard that finishes the file.
pub fn layer(path: &Path) -> std::io::Result<(ChromeLayer, FlushGuard)> {
    let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
    let (tx, rx) = channel::<Msg>();
    let shared = Arc::new(Shared { start: Instant::now(), tx: Mutex::new(Some(tx)), buffers: Mutex::default() });
    let writer = std::thread::Builder::new().name("flint-trace".into()).spawn(move || {
        let mut line = String::with_capacity(160);
        let mut first = true;
        let _ = out.write_all(b"[\n");
        for msg in rx {
            match msg {
                Msg::Events(events) => {
                    for e in &events {
                        line.clear();
                        format_event(&mut line, e);
                        let _ = out.write_all(if first { b"" } else { b",\n" });
                        let _ = out.write_all(line.as_bytes());
                        first = false;
                    }
                }
                Msg::ThreadName(tid, name) => {
                    let _ = out.write_all(if first { b"" } else { b",\n" });
                    let name = serde_json::Value::String(name);
                    let _ = write!(
                        out,
                        r#"{{"ph":"M","pid":1,"tid":{tid},"name":"thread_name","args":{{"name":{name}}}}}"#
                    );
                    first = false;
                }
            }
        }
        let _ = out.write_all(b"\n]\n");
        let _ = out.flush();
    })?;
    Ok((ChromeLayer { shared: shared.clone() }, FlushGuard { shared, writer: Some(writer) }))
}

fn format_event(line: &mut String, e: &Event) {
    let ph = if e.begin { 'B' } else { 'E' };
    let _ = write!(line, r#"{{"ph":"{ph}","pid":1,"tid":{},"ts":{:.3},"name":"{}""#, e.tid, e.ts, e.name);
    if let Some((k, v)) = e.arg {
        let _ = write!(line, r#","args":{{"{k}":{v}}}"#);
    }
    line.push('}');
}

impl Shared {
    fn send(&self, msg: Msg) {
        if let Ok(tx) = self.tx.lock() {
            if let Some(tx) = tx.as_ref() {
                let _ = tx.send(msg);
            }
        }
    }

    fn push(&self, mut event: Event) {
        LOCAL.with(|local| {
            let mut local = local.borrow_mut();
            let (tid, buf) = local.get_or_insert_with(|| {
                let tid = NEXT_TID.fetch_add(1, Ordering::Relaxed);
                let name = std::thread::current().name().unwrap_or("thread").to_string();
                self.send(Msg::ThreadName(tid, name));
                let buf = Arc::new(Mutex::new(Vec::with_capacity(BATCH)));
                if let Ok(mut all) = self.buffers.lock() {
                    all.push(buf.clone());
                }
                (tid, buf)
            });
            event.tid = *tid;
            let full = match buf.lock() {
                Ok(mut b) => {
                    b.push(event);
                    (b.len() >= BATCH).then(|| std::mem::replace(&mut *b, Vec::with_capacity(BATCH)))
                }
                Err(_) => None,
            };
            if let Some(events) = full {
                self.send(Msg::Events(events));
            }
        });
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_nanos() as f64 / 1e3
    }
}

/// The span's first integer field.
struct IntArg(Option<(&'static str, i64)>);

impl tracing::field::Visit for IntArg {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.get_or_insert((field.name(), value as i64));
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.get_or_insert((field.name(), value));
    }
    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for ChromeLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.fields().is_empty() {
            return;
        }
        let mut arg = IntArg(None);
        attrs.record(&mut arg);
        if let (Some(a), Some(span)) = (arg.0, ctx.span(id)) {
            span.extensions_mut().insert(a);
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        self.record(true, id, &ctx);
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        self.record(false, id, &ctx);
    }
}

impl ChromeLayer {
    fn record<S: Subscriber + for<'a> LookupSpan<'a>>(&self, begin: bool, id: &Id, ctx: &Context<'_, S>) {
        let ts = self.shared.now();
        let Some(span) = ctx.span(id) else { return };
        let arg = span.extensions().get::<(&'static str, i64)>().copied();
        self.shared.push(Event { begin, name: span.metadata().name(), ts, tid: 0, arg });
    }
}

impl Drop for FlushGuard {
    fn drop(&mut self) {
        // Whatever the threads still hold, then end the writer's input so it closes the array.
        let rest: Vec<Vec<Event>> = match self.shared.buffers.lock() {
            Ok(all) => all.iter().filter_map(|b| b.lock().ok().map(|mut b| std::mem::take(&mut *b))).collect(),
            Err(_) => Vec::new(),
        };
        for events in rest {
            self.shared.send(Msg::Events(events));
        }
        if let Ok(mut tx) = self.shared.tx.lock() {
            tx.take();
        }
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
