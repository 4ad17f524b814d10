//! Several engines (workers) behind one front door: each request goes, whole, to the worker a
//! [`RoutePolicy`] picks, and stays there; its `n` samples stay together (they are one engine
//! request). Each worker is a complete engine — scheduler, KV pool, prefix cache, kernel threads —
//! so a worker whose step loop dies takes only its own requests down: they end with
//! [`EngineEvent::Stopped`](crate::EngineEvent::Stopped), and the router sends it nothing more.
//!
//! The cost policy ([`cost`]) needs three things per worker: the work already routed there (the
//! [`ledger`]), its prefill and decode rates (a short profile at start-up, then tracked from real
//! step times: [`rates`]), and how much of the incoming prompt its prefix cache holds, computed
//! from the hash chain the cache publishes, without touching its LRU order.

pub mod cost;
pub mod ledger;
pub mod rates;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::{EngineStats, EventStream};
use crate::kv_manager::{cached_prefix_tokens, salt_hash};
use crate::request::{EngineEvent, Request, RequestParams};
use crate::structured::GrammarCompiler;
use crate::{Engine, EngineError, ModelInfo};
use cost::{choose, score, Candidate, Incoming, Rates};
use ledger::{Ledger, Progress};

pub use cost::RoutePolicy;

struct Worker {
    name: String,
    engine: Engine,
    ledger: Ledger,
    decisions: AtomicU64,
}

/// One worker's state, for `/metrics` and `/health`.
#[derive(Debug, Clone)]
pub struct WorkerStatus {
    pub name: String,
    pub healthy: bool,
    pub stats: EngineStats,
    /// Requests the router has sent it.
    pub decisions: u64,
}

/// What one routing decision saw of one worker (logged at debug, one line per worker).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerScore {
    pub worker: String,
    pub eligible: bool,
    pub cached_tokens: usize,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    pub rates: Rates,
    pub live_seqs: usize,
    pub score_secs: f64,
}

/// Cheap to clone; every clone routes over the same workers.
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

struct Inner {
    workers: Vec<Worker>,
    policy: RoutePolicy,
    /// Round-robin's next turn.
    turn: AtomicUsize,
    /// One decision at a time: two requests arriving together must not both see the same idle
    /// worker.
    deciding: Mutex<()>,
}

impl Router {
    /// Route over `workers` (name, engine), in order; at least one.
    pub fn new(workers: Vec<(String, Engine)>, policy: RoutePolicy) -> Result<Self, EngineError> {
        if workers.is_empty() {
            return Err(EngineError::Internal("a router needs at least one worker".into()));
        }
        let workers = workers
            .into_iter()
            .map(|(name, engine)| Worker { name, engine, ledger: Ledger::default(), decisions: AtomicU64::new(0) })
            .collect();
        Ok(Self { inner: Arc::new(Inner { workers, policy, turn: AtomicUsize::new(0), deciding: Mutex::new(()) }) })
    }

    /// One engine (`flint serve` without `--worker`: one CPU worker), nothing to choose between.
    pub fn single(engine: Engine) -> Self {
        let w = Worker { name: "cpu0".into(), engine, ledger: Ledger::default(), decisions: AtomicU64::new(0) };
        Self {
            inner: Arc::new(Inner {
                workers: vec![w],
                policy: RoutePolicy::Cost,
                turn: AtomicUsize::new(0),
                deciding: Mutex::new(()),
            }),
        }
    }

    pub fn policy(&self) -> RoutePolicy {
        self.inner.policy
    }

    pub fn num_workers(&self) -> usize {
        self.inner.workers.len()
    }

    fn first(&self) -> &Engine {
        &self.inner.workers[0].engine
    }

    /// The model's vocabulary and stop ids (every worker serves the same tokenizer).
    pub fn model_info(&self) -> &ModelInfo {
        self.first().model_info()
    }

    /// The structured-output compiler (grammars compile against the shared tokenizer, so any
    /// worker can run them).
    pub fn grammars(&self) -> &Arc<GrammarCompiler> {
        self.first().grammars()
    }

    /// Sequences the live workers run at once, together.
    pub fn max_num_seqs(&self) -> usize {
        self.live().map(|w| w.engine.scheduler_config().max_num_seqs).sum()
    }

    /// The longest prompt + output some live worker accepts.
    pub fn max_model_len(&self) -> usize {
        self.live().map(|w| w.engine.scheduler_config().max_model_len).max().unwrap_or(0)
    }

    fn live(&self) -> impl Iterator<Item = &Worker> {
        self.inner.workers.iter().filter(|w| w.engine.is_healthy())
    }

    /// At least one worker's step loop runs.
    pub fn is_healthy(&self) -> bool {
        self.live().next().is_some()
    }

    /// (live workers, all workers).
    pub fn live_workers(&self) -> (usize, usize) {
        (self.live().count(), self.inner.workers.len())
    }

    /// Every worker's state, in order.
    pub fn workers(&self) -> Vec<WorkerStatus> {
        self.inner
            .workers
            .iter()
            .map(|w| WorkerStatus {
                name: w.name.clone(),
                healthy: w.engine.is_healthy(),
                stats: w.engine.stats(),
                decisions: w.decisions.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// The whole server's stats: counts summed, cache usage over all blocks, healthy while any
    /// worker is.
    pub fn stats(&self) -> EngineStats {
        let all: Vec<EngineStats> = self.inner.workers.iter().map(|w| w.engine.stats()).collect();
        total(&all)
    }

    /// Choose a worker for `req` and queue it there. Invalid requests fail here, before any
    /// event; with no live worker, [`EngineError::Unavailable`].
    pub fn submit(&self, req: Request) -> Result<EventStream, EngineError> {
        let inner = &self.inner;
        if let [only] = inner.workers.as_slice() {
            let stream = only.engine.submit(req)?;
            only.decisions.fetch_add(1, Ordering::Relaxed);
            return Ok(stream);
        }
        let _deciding = inner.deciding.lock().map_err(|_| EngineError::Internal("router lock poisoned".into()))?;
        let incoming = incoming(&req.prompt, &req.params);
        let salt = req.params.cache_salt.as_deref().map(salt_hash);
        let cands: Vec<Candidate> = inner
            .workers
            .iter()
            .map(|w| {
                let eligible = w.engine.is_healthy() && w.engine.validate(&req).is_ok();
                let sched = w.engine.scheduler_config();
                // Prompt logprobs need every prompt row computed: no prefix is reused.
                let cached = if sched.enable_prefix_caching && req.params.prompt_logprobs.is_none() {
                    cached_prefix_tokens(w.engine.prefix_index(), sched.block_size, &req.prompt, salt)
                } else {
                    0
                };
                let (load, live_seqs) = w.ledger.load();
                let st = w.engine.stats();
                // Decode priced at the batch the worker would run with this request in it.
                let batch = (live_seqs + incoming.seqs).min(sched.max_num_seqs);
                Candidate {
                    eligible,
                    rates: Rates { prefill: st.prefill_rate, decode: st.decode_cost.rate_at(batch) },
                    load,
                    live_seqs,
                    cached_tokens: cached,
                }
            })
            .collect();
        let turn = inner.turn.load(Ordering::Relaxed);
        let Some(i) = choose(inner.policy, &cands, &incoming, turn) else {
            // No worker takes it: a request invalid everywhere gets the first live worker's
            // reason; with none live, the server is unavailable.
            return match self.live().next() {
                Some(w) => w.engine.submit(req),
                None => Err(EngineError::Unavailable("no worker is running".into())),
            };
        };
        if inner.policy == RoutePolicy::RoundRobin {
            inner.turn.store(i + 1, Ordering::Relaxed);
        }
        if tracing::enabled!(target: "flint::router", tracing::Level::DEBUG) {
            let table = self.scores(&cands, &incoming);
            tracing::debug!(
                target: "flint::router",
                "request {} ({} prompt tokens, decode budget {}) -> worker {} by {}: {}",
                req.id,
                incoming.prompt_tokens,
                incoming.decode_budget,
                inner.workers[i].name,
                inner.policy,
                table.iter().map(WorkerScore::log_line).collect::<Vec<_>>().join("; ")
            );
        }
        let progress = Progress::new(
            incoming.prompt_tokens.saturating_sub(cands[i].cached_tokens),
            incoming.decode_budget,
            incoming.seqs,
        );
        let w = &inner.workers[i];
        // Eligible means validated against this worker already.
        let mut stream = w.engine.submit_validated(req)?;
        w.ledger.add(&progress);
        stream.track_progress(progress);
        w.decisions.fetch_add(1, Ordering::Relaxed);
        Ok(stream)
    }

    /// Each worker as the decision for `incoming` saw it, with its cost score.
    fn scores(&self, cands: &[Candidate], incoming: &Incoming) -> Vec<WorkerScore> {
        self.inner
            .workers
            .iter()
            .zip(cands)
            .map(|(w, c)| {
                let work = c.load + incoming.work_on(c.cached_tokens);
                WorkerScore {
                    worker: w.name.clone(),
                    eligible: c.eligible,
                    cached_tokens: c.cached_tokens,
                    prefill_tokens: work.prefill,
                    decode_tokens: work.decode,
                    rates: c.rates,
                    live_seqs: c.live_seqs,
                    score_secs: score(c, incoming),
                }
            })
            .collect()
    }

    /// Abort every live request with client id `id`, on whichever worker has it.
    pub fn abort(&self, id: &str) {
        for w in &self.inner.workers {
            w.engine.abort(id);
        }
    }

    /// Test hook: make worker `i`'s step loop panic (see [`Engine::inject_fault`]).
    pub fn inject_fault(&self, i: usize) -> Result<(), EngineError> {
        let w = self.inner.workers.get(i).ok_or_else(|| {
            EngineError::InvalidRequest(format!("no worker {i}; there are {}", self.inner.workers.len()))
        })?;
        w.engine.inject_fault();
        Ok(())
    }

    /// Stop every worker after its current step.
    pub fn shutdown(&self) {
        for w in &self.inner.workers {
            w.engine.shutdown();
        }
    }

    /// Measure every worker's rates before the first request, all workers at once: a small
    /// warm-up request (first-touch costs; the rates are reset after it), then one request of
    /// `prompt_tokens` tokens and `output_tokens` outputs (prefill, and decode at a batch of 1),
    /// then up to [`PROFILE_BATCH`] requests at once on that prompt plus a few tokens of their
    /// own (decode at a batch of 32, at that context, for half as many tokens). The trackers keep what these steps
    /// measured. Returns each worker's measured rates, or why its profile failed.
    pub fn profile(&self, prompt_tokens: usize, output_tokens: usize) -> Vec<(String, Result<Profiled, String>)> {
        let vocab = self.model_info().valid_vocab.max(2);
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .inner
                .workers
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    s.spawn(move || (w.name.clone(), profile_worker(&w.engine, i, vocab, prompt_tokens, output_tokens)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| ("?".into(), Err("the profile thread panicked".into()))))
                .collect()
        })
    }
}

impl WorkerScore {
    /// `name: cached C, prefill P / R1 tok/s + decode D / R2 tok/s = S s (L seqs)`.
    pub fn log_line(&self) -> String {
        if !self.eligible {
            return format!("{}: not eligible", self.worker);
        }
        format!(
            "{}: cached {}, prefill {} / {:.1} tok/s + decode {} / {:.1} tok/s = {:.3} s ({} seqs)",
            self.worker,
            self.cached_tokens,
            self.prefill_tokens,
            self.rates.prefill,
            self.decode_tokens,
            self.rates.decode,
            self.score_secs,
            self.live_seqs
        )
    }
}

fn incoming(prompt: &[u32], p: &RequestParams) -> Incoming {
    Incoming { prompt_tokens: prompt.len(), decode_budget: p.max_tokens.saturating_mul(p.n), seqs: p.n.max(1) }
}

/// Sequences decoding together in the profile's second phase: as many as a busy worker runs
/// (fitted from batches of 1 and 16 only, the per-sequence term missed how a batch of 24 runs
/// and priced a near-equal pair of workers 10% off).
pub const PROFILE_BATCH: usize = 32;

/// What a worker's start-up profile measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Profiled {
    pub prefill: f64,
    pub decode: rates::DecodeCost,
}

/// One worker's profile (see [`Router::profile`]); the engine's own step timing measures it.
fn profile_worker(engine: &Engine, i: usize, vocab: usize, prompt: usize, output: usize) -> Result<Profiled, String> {
    // Room for the prompt, 8 tokens of each request's own and the outputs on this worker.
    let prompt = prompt.min(engine.scheduler_config().max_model_len.saturating_sub(output + 16)).max(1);
    // A fixed spread of ids: `len` shared ones, then 8 of request `own`'s (none for `None`).
    // Its own cache salt keeps the profile out of every real prompt's hits.
    let request = |tag: &str, len: usize, own: Option<usize>, max_tokens: usize| Request {
        id: format!("flint-router-profile-{tag}-{i}"),
        prompt: (0..len)
            .map(|k| ((k * 7919 + 13 * (i + 1)) % vocab) as u32)
            .chain(own.into_iter().flat_map(|o| (0..8).map(move |k| ((o * 8 + k) * 104_729 % vocab) as u32)))
            .collect(),
        params: RequestParams {
            max_tokens,
            ignore_eos: true,
            cache_salt: Some("flint-router-profile".into()),
            ..RequestParams::default()
        },
    };
    let run = |reqs: Vec<Request>| -> Result<(), String> {
        let streams =
            reqs.into_iter().map(|r| engine.submit(r).map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
        for mut s in streams {
            while let Some(ev) = s.next_blocking() {
                if let EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) = ev {
                    return Err(e);
                }
            }
        }
        Ok(())
    };
    run(vec![request("warm", 0, Some(PROFILE_BATCH), 2)])?;
    engine.reset_rates();
    run(vec![request("first", prompt, None, output)])?;
    // The batch shares the first prompt (a cache hit), so its decode steps run at that context:
    // a row's cost includes its attention over the context, not only its share of the matmuls.
    let batch = engine.scheduler_config().max_num_seqs.min(PROFILE_BATCH);
    let steps = (output / 2).max(4);
    run((0..batch).map(|k| request(&format!("batch{k}"), prompt, Some(k), steps)).collect())?;
    // Stats are published after each step; the last step's sample may land just after its
    // events (one step of dozens).
    let st = engine.stats();
    Ok(Profiled { prefill: st.prefill_rate, decode: st.decode_cost })
}

/// Sum of per-worker stats (the server's totals).
pub fn total(all: &[EngineStats]) -> EngineStats {
    let mut t = EngineStats::default();
    let mut used_blocks = 0.0;
    for s in all {
        t.num_running += s.num_running;
        t.num_waiting += s.num_waiting;
        used_blocks += s.kv_cache_usage * s.num_blocks as f64;
        t.num_blocks += s.num_blocks;
        t.block_size = if t.block_size == 0 { s.block_size } else { t.block_size };
        t.prefix_cache_queries += s.prefix_cache_queries;
        t.prefix_cache_hits += s.prefix_cache_hits;
        t.num_preemptions += s.num_preemptions;
        t.prompt_tokens += s.prompt_tokens;
        t.generation_tokens += s.generation_tokens;
        t.steps += s.steps;
        t.failed_steps += s.failed_steps;
        t.healthy |= s.healthy;
        t.spec_enabled |= s.spec_enabled;
        t.spec_drafts += s.spec_drafts;
        t.spec_draft_tokens += s.spec_draft_tokens;
        t.spec_accepted_tokens += s.spec_accepted_tokens;
        for (a, b) in t.spec_accepted_per_pos.iter_mut().zip(s.spec_accepted_per_pos) {
            *a += b;
        }
        t.spec_positions = t.spec_positions.max(s.spec_positions);
        t.grammar_masks.merge(&s.grammar_masks);
        t.prefill_rate += s.prefill_rate;
    }
    t.kv_cache_usage = if t.num_blocks > 0 { used_blocks / t.num_blocks as f64 } else { 0.0 };
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_sum_counts_and_weigh_cache_usage_by_blocks() {
        let a =
            EngineStats { num_running: 2, num_blocks: 100, kv_cache_usage: 0.5, healthy: false, ..Default::default() };
        let b =
            EngineStats { num_running: 1, num_blocks: 300, kv_cache_usage: 0.1, healthy: true, ..Default::default() };
        let t = total(&[a, b]);
        assert_eq!((t.num_running, t.num_blocks), (3, 400));
        assert!((t.kv_cache_usage - 0.2).abs() < 1e-12, "(50 + 30) / 400");
        assert!(t.healthy, "healthy while any worker is");
        assert!(!total(&[a]).healthy);
    }

    #[test]
    fn decode_budget_counts_every_sample() {
        let p = RequestParams { max_tokens: 100, n: 3, ..Default::default() };
        assert_eq!(incoming(&[1, 2, 3], &p), Incoming { prompt_tokens: 3, decode_budget: 300, seqs: 3 });
    }
}
