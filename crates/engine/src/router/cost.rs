//! The routing policies as pure functions of what each worker has (no threads, no engines), so
//! the published design's worked example is a unit test.
//!
//! The cost of sending a request to a worker is the time that worker needs for all its work,
//! this request included, priced by phase:
//!
//! ```text
//! score = remaining prefill tokens / prefill rate + remaining decode-token budget / decode rate
//! ```
//!
//! Prefill tokens exclude the prefix the worker has cached (a request already there keeps the
//! discount it was routed with), and the decode budget is every request's unused `max_tokens`:
//! output length is not predicted. The lowest score wins.

use std::fmt;
use std::str::FromStr;

/// `--router`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RoutePolicy {
    /// The lowest [`score`], pricing prefill and decode separately and counting cached prefixes.
    #[default]
    Cost,
    /// The fewest sequences in flight.
    LeastLoad,
    /// Each healthy worker in turn.
    RoundRobin,
}

impl FromStr for RoutePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "cost" => Ok(Self::Cost),
            "least-load" => Ok(Self::LeastLoad),
            "round-robin" => Ok(Self::RoundRobin),
            other => Err(format!("--router: unknown policy {other:?}; use cost, least-load or round-robin")),
        }
    }
}

impl fmt::Display for RoutePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cost => "cost",
            Self::LeastLoad => "least-load",
            Self::RoundRobin => "round-robin",
        })
    }
}

/// A worker's throughput by phase, in tokens per second.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rates {
    pub prefill: f64,
    pub decode: f64,
}

/// Tokens of work still to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Work {
    /// Prompt tokens not yet computed and not served from the prefix cache.
    pub prefill: usize,
    /// Unused `max_tokens` (times `n`).
    pub decode: usize,
}

impl std::ops::Add for Work {
    type Output = Work;
    fn add(self, o: Work) -> Work {
        Work { prefill: self.prefill + o.prefill, decode: self.decode + o.decode }
    }
}

/// Seconds `work` takes at `rates`. A rate not yet measured (zero) prices its phase as free
/// only when there is none of it; otherwise as if one token per second, so an unmeasured
/// worker is never preferred by accident.
pub fn seconds(work: Work, rates: Rates) -> f64 {
    let phase = |tokens: usize, rate: f64| {
        if tokens == 0 {
            0.0
        } else {
            tokens as f64 / if rate > 0.0 && rate.is_finite() { rate } else { 1.0 }
        }
    };
    phase(work.prefill, rates.prefill) + phase(work.decode, rates.decode)
}

/// One worker as a routing decision sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Candidate {
    /// Its step loop runs, and the request fits its limits.
    pub eligible: bool,
    pub rates: Rates,
    /// Work already there (running and queued).
    pub load: Work,
    /// Sequences already there (least-load's measure).
    pub live_seqs: usize,
    /// Prompt tokens of the incoming request this worker has cached.
    pub cached_tokens: usize,
}

/// The incoming request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incoming {
    pub prompt_tokens: usize,
    /// `max_tokens × n`.
    pub decode_budget: usize,
    pub seqs: usize,
}

impl Incoming {
    /// What it adds to a worker that has `cached` of its prompt tokens.
    pub fn work_on(&self, cached: usize) -> Work {
        Work { prefill: self.prompt_tokens.saturating_sub(cached), decode: self.decode_budget }
    }
}

/// The cost policy's score of sending `req` to `c` (seconds of work there, this request included).
pub fn score(c: &Candidate, req: &Incoming) -> f64 {
    seconds(c.load + req.work_on(c.cached_tokens), c.rates)
}

/// The worker `policy` picks for `req` among `cands`, `None` if none is eligible. `turn` is the
/// round-robin counter (the caller advances it).
pub fn choose(policy: RoutePolicy, cands: &[Candidate], req: &Incoming, turn: usize) -> Option<usize> {
    let eligible = || cands.iter().enumerate().filter(|(_, c)| c.eligible);
    match policy {
        // Ties go to the lower index, so a decision is reproducible from its log line.
        RoutePolicy::Cost => eligible()
            .map(|(i, c)| (i, score(c, req)))
            .fold(None, |best: Option<(usize, f64)>, (i, s)| match best {
                Some((_, b)) if b <= s => best,
                _ => Some((i, s)),
            })
            .map(|(i, _)| i),
        RoutePolicy::LeastLoad => eligible().min_by_key(|&(i, c)| (c.live_seqs, i)).map(|(i, _)| i),
        RoutePolicy::RoundRobin => {
            let n = cands.len();
            (0..n).map(|k| (turn + k) % n).find(|&i| cands[i].eligible)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The design's setup: 512-token-prefix prompts of 516 tokens with 496 cached on both
    /// workers, 128 output tokens, isolated profile rates (CPU 73/45, Metal GPU 2551/293 tok/s).
    fn example(gpu_active_remaining: usize, gpu_queued: usize) -> (Vec<Candidate>, Incoming) {
        let req = Incoming { prompt_tokens: 516, decode_budget: 128, seqs: 1 };
        let cpu = Candidate {
            eligible: true,
            rates: Rates { prefill: 73.0, decode: 45.0 },
            load: Work::default(),
            live_seqs: 0,
            cached_tokens: 496,
        };
        // Four active requests (prefill done), `gpu_queued` queued with their 20 uncached tokens.
        let load = Work { prefill: gpu_queued * 20, decode: 4 * gpu_active_remaining + gpu_queued * 128 };
        let gpu = Candidate {
            eligible: true,
            rates: Rates { prefill: 2551.0, decode: 293.0 },
            load,
            live_seqs: 4 + gpu_queued,
            cached_tokens: 496,
        };
        (vec![cpu, gpu], req)
    }

    #[test]
    fn worked_example_request_7_goes_to_the_gpu() {
        let (c, req) = example(124, 2);
        let (cpu, gpu) = (score(&c[0], &req), score(&c[1], &req));
        assert!((cpu - 3.118).abs() < 5e-4, "CPU 20/73 + 128/45 = {cpu}");
        assert!((gpu - 3.027).abs() < 5e-4, "GPU 60/2551 + 880/293 = {gpu}");
        assert_eq!(choose(RoutePolicy::Cost, &c, &req, 0), Some(1));
    }

    #[test]
    fn worked_example_request_8_goes_to_the_idle_cpu() {
        // 50 ms later: request 7 queued too, and the active requests used 8 more tokens each.
        let (c, req) = example(122, 3);
        let (cpu, gpu) = (score(&c[0], &req), score(&c[1], &req));
        assert!((cpu - 3.118).abs() < 5e-4, "{cpu}");
        assert!((gpu - 3.444).abs() < 5e-4, "GPU 80/2551 + 1000/293 = {gpu}");
        assert_eq!(choose(RoutePolicy::Cost, &c, &req, 0), Some(0));
    }

    #[test]
    fn without_the_cache_discount_the_cpu_would_lose() {
        // An idle CPU that does not have the prefix: 516/73 + 128/45 = 9.9 s, worse than the
        // busy GPU's 3.4 s, so the prefix cache is what makes the CPU worth using.
        let (mut c, req) = example(122, 3);
        c[0].cached_tokens = 0;
        assert_eq!(choose(RoutePolicy::Cost, &c, &req, 0), Some(1));
    }

    #[test]
    fn ineligible_workers_are_never_chosen() {
        let (mut c, req) = example(122, 3);
        c[0].eligible = false;
        for p in [RoutePolicy::Cost, RoutePolicy::LeastLoad, RoutePolicy::RoundRobin] {
            for turn in 0..4 {
                assert_eq!(choose(p, &c, &req, turn), Some(1), "{p} turn {turn}");
            }
        }
        c[1].eligible = false;
        assert_eq!(choose(RoutePolicy::Cost, &c, &req, 0), None);
        assert_eq!(choose(RoutePolicy::RoundRobin, &c, &req, 1), None);
    }

    #[test]
    fn least_load_takes_the_fewest_sequences_whatever_their_speed() {
        let (c, req) = example(122, 3);
        // The GPU is far faster but has 7 sequences; the CPU none.
        assert_eq!(choose(RoutePolicy::LeastLoad, &c, &req, 0), Some(0));
        let mut c = c;
        c[0].live_seqs = 8;
        assert_eq!(choose(RoutePolicy::LeastLoad, &c, &req, 0), Some(1));
        c[0].live_seqs = 7;
        assert_eq!(choose(RoutePolicy::LeastLoad, &c, &req, 0), Some(0), "ties go to the lower index");
    }

    #[test]
    fn round_robin_takes_turns_skipping_the_ineligible() {
        let mut c = vec![Candidate { eligible: true, ..Default::default() }; 3];
        let req = Incoming { prompt_tokens: 10, decode_budget: 10, seqs: 1 };
        let picks: Vec<_> = (0..6).map(|t| choose(RoutePolicy::RoundRobin, &c, &req, t).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        c[1].eligible = false;
        let picks: Vec<_> = (0..4).map(|t| choose(RoutePolicy::RoundRobin, &c, &req, t).unwrap()).collect();
        assert_eq!(picks, [0, 2, 2, 0]);
    }

    #[test]
    fn an_unmeasured_rate_is_not_free() {
        let w = Work { prefill: 10, decode: 0 };
        assert_eq!(seconds(w, Rates { prefill: 0.0, decode: 0.0 }), 10.0);
        assert_eq!(seconds(Work::default(), Rates::default()), 0.0);
    }

    #[test]
    fn policies_parse_by_their_flag_names() {
        for p in [RoutePolicy::Cost, RoutePolicy::LeastLoad, RoutePolicy::RoundRobin] {
            assert_eq!(p.to_string().parse::<RoutePolicy>(), Ok(p));
        }
        assert!("fastest".parse::<RoutePolicy>().unwrap_err().contains("cost, least-load or round-robin"));
    }
}
