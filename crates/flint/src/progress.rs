//! How the flint command shows long work (loading a checkpoint, `flint synth`, the benches): a
//! progress bar when stderr is a terminal, otherwise a log line every few seconds while a task
//! runs and one when it ends — what a log collector or `kubectl logs` can show. A task done
//! within the first interval logs nothing: a quick load, or a CLI error, stays one line.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use flint_model::progress::{set_sink, ProgressSink};
use indicatif::{ProgressBar, ProgressStyle};

/// A log line at most this often while a task runs.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// Install the process's progress display.
pub fn install() {
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        set_sink(Box::new(Bar(Mutex::new(None))));
    } else {
        set_sink(Box::new(Lines(Mutex::new(None))));
    }
}

struct Bar(Mutex<Option<ProgressBar>>);

impl ProgressSink for Bar {
    fn start(&self, name: &str, unit: &str, total: u64) {
        let style = ProgressStyle::with_template(&format!(
            "{{msg}} [{{bar:32}}] {{pos}}/{{len}} {unit} ({{elapsed}}, eta {{eta}})"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        let bar = ProgressBar::new(total).with_style(style).with_message(name.to_string());
        if let Ok(mut b) = self.0.lock() {
            *b = Some(bar);
        }
    }

    fn advance(&self, done: u64) {
        if let Ok(b) = self.0.lock() {
            if let Some(bar) = b.as_ref() {
                bar.set_position(done);
            }
        }
    }

    fn finish(&self) {
        if let Ok(mut b) = self.0.lock() {
            if let Some(bar) = b.take() {
                bar.finish_and_clear();
            }
        }
    }
}

struct Running {
    name: String,
    unit: String,
    total: u64,
    done: u64,
    started: Instant,
    /// When the last line was logged (`None`: none yet).
    logged: Option<Instant>,
}

struct Lines(Mutex<Option<Running>>);

impl ProgressSink for Lines {
    fn start(&self, name: &str, unit: &str, total: u64) {
        let started = Instant::now();
        if let Ok(mut r) = self.0.lock() {
            *r = Some(Running { name: name.into(), unit: unit.into(), total, done: 0, started, logged: None });
        }
    }

    fn advance(&self, done: u64) {
        let Ok(mut r) = self.0.lock() else { return };
        let Some(r) = r.as_mut() else { return };
        r.done = done;
        if r.logged.unwrap_or(r.started).elapsed() >= LOG_EVERY {
            r.logged = Some(Instant::now());
            let pct = done * 100 / r.total.max(1);
            tracing::info!("{}: {done}/{} {} ({pct}%)", r.name, r.total, r.unit);
        }
    }

    fn finish(&self) {
        let Ok(mut r) = self.0.lock() else { return };
        if let Some(r) = r.take().filter(|r| r.logged.is_some()) {
            let secs = r.started.elapsed().as_secs_f64();
            if r.done >= r.total {
                tracing::info!("{}: done in {secs:.1}s", r.name);
            } else {
                tracing::info!("{}: stopped at {}/{} {} after {secs:.1}s", r.name, r.done, r.total, r.unit);
            }
        }
    }
}
