//! Running engine requests for an HTTP request and gathering their events: all of them for a
//! plain JSON response, or as one merged stream for SSE. Chat and completions differ only in how
//! they format what is gathered here.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use flint_engine::SampleOutput;
use serde::Serialize;

use flint_engine::sampler::TokenLogprobs;
use flint_engine::{EngineEvent, EventStream, Finished, Request, RequestParams};
use futures_util::stream::{self, Stream, StreamExt};

use crate::api_types::{NoChoice, StreamChunk, Usage};
use crate::error::{ApiError, ApiResult};
use crate::output::{Outcome, Timer};
use crate::state::{InFlight, ServingModel, SharedState};

/// One prompt's engine request; its samples are choices `offset .. offset + n`.
pub struct Job {
    pub prompt: Vec<u32>,
    pub offset: usize,
    pub stream: EventStream,
}

/// Submit one engine request per prompt for a request already admitted as `guard`.
pub fn submit(
    model: &ServingModel,
    request_id: &str,
    prompts: Vec<Vec<u32>>,
    params: &RequestParams,
    prompt_param: &str,
    guard: &mut InFlight,
) -> ApiResult<Vec<Job>> {
    guard.submitted();
    let mut jobs = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.into_iter().enumerate() {
        let req = Request { id: format!("{request_id}-{i}"), prompt: prompt.clone(), params: params.clone() };
        match model.router.submit(req) {
            Ok(stream) => jobs.push(Job { prompt, offset: i * params.n, stream }),
            Err(e) => {
                // Refused, not abandoned: jobs already queued are aborted as `jobs` drops.
                guard.finish();
                return Err(ApiError::from_engine(e, prompt_param));
            }
        }
    }
    Ok(jobs)
}

/// Everything one choice produced.
#[derive(Debug, Default, Clone)]
pub struct Choice {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub finished: Option<Finished>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub prompt_logprobs: Option<Vec<Option<TokenLogprobs>>>,
    /// An embedding request's vector.
    pub embedding: Option<Vec<f32>>,
}

/// Wait for every choice of every job (marking `guard` finished either way). Dropping the future
/// (client gone) aborts them all.
pub async fn collect(
    state: &SharedState,
    jobs: &mut [Job],
    n: usize,
    timer: &mut Timer,
    guard: &mut InFlight,
) -> ApiResult<Vec<Choice>> {
    let deadline = state.deadline_passed();
    let r = tokio::select! {
        r = collect_inner(state, jobs, n, timer) => r,
        _ = deadline => Err(shut_down()),
    };
    guard.finish();
    r
}

async fn collect_inner(state: &SharedState, jobs: &mut [Job], n: usize, timer: &mut Timer) -> ApiResult<Vec<Choice>> {
    let total = jobs.len() * n;
    let mut choices = vec![Choice::default(); total];
    for job in jobs.iter_mut() {
        while let Some(ev) = job.stream.next().await {
            match ev {
                EngineEvent::Output(o) => {
                    let idx = job.offset + o.index;
                    timer.on_output(&state.metrics, idx, &o);
                    let Some(c) = choices.get_mut(idx) else { continue };
                    c.text.push_str(&o.text);
                    c.token_ids.extend(&o.token_ids);
                    c.logprobs.extend(o.logprobs);
                    c.prompt_tokens = o.prompt_tokens;
                    c.cached_tokens = o.cached_tokens;
                    if o.embedding.is_some() {
                        c.embedding = o.embedding;
                    }
                    if o.prompt_logprobs.is_some() {
                        c.prompt_logprobs = o.prompt_logprobs;
                    }
                    if o.finished.is_some() {
                        c.finished = o.finished;
                    }
                }
                EngineEvent::Error(e) => return Err(ApiError::internal(e)),
                EngineEvent::Rejected(e) => return Err(ApiError::constraint_failed(e)),
                EngineEvent::Stopped(e) => return Err(ApiError::unavailable(e)),
            }
        }
    }
    Ok(choices)
}

/// What a request still running when the shutdown grace period ends is told.
fn shut_down() -> ApiError {
    ApiError::unavailable("The server shut down before the request finished.")
}

/// An engine event tagged with the job it came from.
pub type Tagged = (usize, EngineEvent);

/// The events of all jobs, merged in arrival order.
pub fn merged(jobs: Vec<Job>) -> Pin<Box<dyn Stream<Item = Tagged> + Send>> {
    let streams = jobs.into_iter().enumerate().map(|(i, job)| {
        stream::unfold(job, move |mut job| async move { job.stream.next().await.map(|ev| ((i, ev), job)) }).boxed()
    });
    stream::select_all(streams).boxed()
}

/// Shared, read-only context of a streaming response.
pub struct StreamCtx {
    pub state: SharedState,
    pub model: Arc<ServingModel>,
    pub id: String,
    pub created: u64,
    pub n: usize,
    pub include_usage: bool,
    /// Prompt tokens over all jobs (usage, log).
    pub prompt_tokens: usize,
    /// `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
}

impl StreamCtx {
    /// One SSE chunk: the envelope every chunk of this response shares, around `choices`.
    pub fn chunk<C>(&self, choices: Vec<C>) -> StreamChunk<'_, C> {
        StreamChunk {
            id: &self.id,
            object: self.object,
            created: self.created,
            model: &self.state.cfg.served_model_name,
            choices,
            usage: None,
        }
    }
}

/// One SSE event, serialized: its `data:` JSON and, where the API names its events, the
/// `event:` name.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    pub event: Option<&'static str>,
    pub data: String,
}

impl Chunk {
    pub fn new(body: &impl Serialize) -> Self {
        Self { event: None, data: to_json(body) }
    }

    pub fn named(event: &'static str, body: &impl Serialize) -> Self {
        Self { event: Some(event), data: to_json(body) }
    }
}

/// The bodies are plain structs with string keys, which always serialize; should one not, the
/// client gets an error event rather than a broken line.
fn to_json(body: &impl Serialize) -> String {
    serde_json::to_string(body)
        .unwrap_or_else(|e| ApiError::internal(format!("cannot serialize the response: {e}")).body().to_string())
}

/// How an endpoint turns engine output into SSE chunks.
pub trait Formatter: Send + 'static {
    /// Chunks sent before any output (chat: the role delta of every choice).
    fn prelude(&mut self, ctx: &StreamCtx) -> Vec<Chunk>;
    /// Chunks for one engine output of job `job`.
    fn on_output(&mut self, ctx: &StreamCtx, job: usize, o: SampleOutput) -> Vec<Chunk>;
    /// (completion tokens, cached tokens, first choice's finish reason) for usage, log, metrics.
    fn summary(&self) -> (usize, usize, &'static str);
    /// Tokens of reasoning, for usage, when a reasoning parser runs.
    fn reasoning_tokens(&self) -> Option<usize> {
        None
    }
    /// Events after the last output, given the usage (the Responses API's `response.completed`).
    fn epilogue(&mut self, _ctx: &StreamCtx, _usage: &Usage) -> Vec<Chunk> {
        Vec::new()
    }
    /// Whether the stream ends with `data: [DONE]` (chat and completions do).
    fn done_marker(&self) -> bool {
        true
    }
    /// The event that tells a client its stream failed after it began.
    fn error_event(&mut self, e: &ApiError) -> Chunk {
        Chunk::new(&e.body())
    }
}

/// Result of an endpoint's handler, as the response: errors counted once by their reason.
pub fn respond(state: &SharedState, result: ApiResult<Response>) -> Response {
    match result {
        Ok(r) => r,
        Err(e) => {
            state.metrics.failed(e.failure_reason());
            e.into_response()
        }
    }
}

struct Driver {
    ctx: StreamCtx,
    events: Pin<Box<dyn Stream<Item = Tagged> + Send>>,
    fmt: Box<dyn Formatter>,
    guard: InFlight,
    timer: Timer,
    /// Resolves when the shutdown grace period is over.
    deadline: Pin<Box<dyn Future<Output = ()> + Send>>,
    offsets: Vec<usize>,
    finished: usize,
    total: usize,
    pending: VecDeque<Event>,
    done: bool,
}

/// The SSE event of a chunk.
fn event(c: Chunk) -> Event {
    let e = match c.event {
        Some(name) => Event::default().event(name),
        None => Event::default(),
    };
    e.data(c.data)
}

impl Driver {
    fn push(&mut self, chunks: Vec<Chunk>) {
        self.pending.extend(chunks.into_iter().map(event));
    }

    fn end_marker(&mut self) {
        if self.fmt.done_marker() {
            self.pending.push_back(Event::default().data("[DONE]"));
        }
    }

    fn complete(&mut self) {
        let (completion, cached, reason) = self.fmt.summary();
        let u = Usage::new(self.ctx.prompt_tokens, completion, cached).with_reasoning(self.fmt.reasoning_tokens());
        if self.ctx.include_usage {
            let last = StreamChunk { usage: Some(u), ..self.ctx.chunk::<NoChoice>(Vec::new()) };
            self.push(vec![Chunk::new(&last)]);
        }
        let tail = self.fmt.epilogue(&self.ctx, &u);
        self.push(tail);
        self.end_marker();
        self.done = true;
        self.guard.finish();
        let outcome = Outcome {
            id: &self.ctx.id,
            prompt_tokens: self.ctx.prompt_tokens,
            completion_tokens: completion,
            cached_tokens: cached,
            sequences: self.total,
            reason,
        };
        self.timer.finish(&self.ctx.state.metrics, outcome);
    }

    fn fail(&mut self, e: ApiError) {
        // After the headers went out, an error is the stream's last event before `[DONE]`, so a
        // client always sees how its stream ended.
        let ev = self.fmt.error_event(&e);
        self.push(vec![ev]);
        self.end_marker();
        self.done = true;
        self.guard.finish();
        self.ctx.state.metrics.failed(e.failure_reason());
    }
}

/// The SSE response for `jobs`: prelude, chunks as outputs arrive, usage if asked, `[DONE]`.
pub fn sse(ctx: StreamCtx, jobs: Vec<Job>, guard: InFlight, timer: Timer, mut fmt: Box<dyn Formatter>) -> Response {
    let total = jobs.len() * ctx.n;
    let offsets = jobs.iter().map(|j| j.offset).collect();
    let pending = fmt.prelude(&ctx).into_iter().map(event).collect();
    let deadline = Box::pin(ctx.state.deadline_passed());
    let driver = Driver {
        ctx,
        events: merged(jobs),
        fmt,
        guard,
        timer,
        deadline,
        offsets,
        finished: 0,
        total,
        pending,
        done: false,
    };
    let body = stream::unfold(driver, |mut d| async move {
        loop {
            if let Some(p) = d.pending.pop_front() {
                return Some((Ok::<Event, Infallible>(p), d));
            }
            if d.done {
                return None;
            }
            let event = tokio::select! {
                ev = d.events.next() => ev,
                _ = d.deadline.as_mut() => {
                    d.fail(shut_down());
                    continue;
                }
            };
            match event {
                Some((job, EngineEvent::Output(o))) => {
                    let idx = d.offsets.get(job).copied().unwrap_or(0) + o.index;
                    d.timer.on_output(&d.ctx.state.metrics, idx, &o);
                    let last = o.finished.is_some();
                    let chunks = d.fmt.on_output(&d.ctx, job, o);
                    d.push(chunks);
                    if last {
                        d.finished += 1;
                        if d.finished == d.total {
                            d.complete();
                        }
                    }
                }
                Some((_, EngineEvent::Error(e))) => d.fail(ApiError::internal(e)),
                Some((_, EngineEvent::Rejected(e))) => d.fail(ApiError::constraint_failed(e)),
                Some((_, EngineEvent::Stopped(e))) => d.fail(ApiError::unavailable(e)),
                None => d.fail(ApiError::internal("the engine stopped before the request finished")),
            }
        }
    });
    Sse::new(body).keep_alive(KeepAlive::default()).into_response()
}
