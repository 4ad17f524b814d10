//! The router over real engines (fake model runners of set speed): the cost policy sends a prompt
//! to the worker whose prefix cache holds it, the other policies spread requests as named, and a
//! dead worker gets nothing more while the other serves.

mod fake_runner;

use std::time::{Duration, Instant};

use fake_runner::{config, core};
use flint_engine::{Engine, EngineEvent, Request, RequestParams, RoutePolicy, Router};

fn worker(ms_per_token: u64) -> Engine {
    let mut c = core(config(512, 64, 8));
    c.runner_mut().delay_per_token = Some(Duration::from_millis(ms_per_token));
    Engine::start(c)
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request { id: id.into(), prompt, params: RequestParams { max_tokens, ignore_eos: true, ..Default::default() } }
}

fn drain(mut s: flint_engine::EventStream) -> usize {
    let mut n = 0;
    while let Some(ev) = s.next_blocking() {
        match ev {
            EngineEvent::Output(o) => n += o.token_ids.len(),
            EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => panic!("{e}"),
        }
    }
    n
}

fn decisions(r: &Router) -> Vec<u64> {
    r.workers().iter().map(|w| w.decisions).collect()
}

#[test]
fn cost_sends_a_prompt_where_its_prefix_is_cached() {
    let (a, b) = (worker(2), worker(2));
    let router = Router::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], RoutePolicy::Cost).unwrap();
    for (name, r) in router.profile(32, 4) {
        let r = r.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(r.prefill > 0.0 && r.decode.rate_at(1) > 0.0, "{name}: {r:?}");
    }
    // Worker b (not a) has seen a 64-token prefix.
    let prefix: Vec<u32> = (0..64).map(|i| 3000 + i).collect();
    drain(b.submit(req("warm", prefix.clone(), 1)).unwrap());
    let hits_before = b.stats().prefix_cache_hits;
    for k in 0..3 {
        let mut p = prefix.clone();
        p.extend([5000 + k, 5001, 5002, 5003]);
        drain(router.submit(req(&format!("r{k}"), p, 1)).unwrap());
    }
    assert_eq!(decisions(&router), [0, 3], "68-token prompts with 64 cached on b: 4 tokens there, 68 on a");
    let t0 = Instant::now();
    while b.stats().prefix_cache_hits < hits_before + 3 * 64 {
        // Stats are published after the step whose events the stream already had.
        assert!(t0.elapsed() < Duration::from_secs(5), "{} hits after {hits_before}", b.stats().prefix_cache_hits);
        std::thread::sleep(Duration::from_millis(2));
    }
    // A prompt neither has goes by speed and load alone; with b busy, a takes it.
    let busy = router.submit(req("long", (0..8).map(|i| 7000 + i).collect(), 400)).unwrap();
    let busy_on = decisions(&router);
    let s = router.submit(req("other", (0..8).map(|i| 8000 + i).collect(), 4)).unwrap();
    let after = decisions(&router);
    assert_ne!(busy_on, after);
    assert_eq!(after[0] + after[1], 5);
    assert!(
        (busy_on[0] == 1 && after[1] == busy_on[1] + 1) || (busy_on[1] == 4 && after[0] == 1),
        "the short request avoids the worker with 400 tokens to decode: {busy_on:?} then {after:?}"
    );
    drop(busy);
    drain(s);
}

#[test]
fn least_load_and_round_robin_spread_as_named() {
    let (a, b) = (worker(0), worker(0));
    let router = Router::new(vec![("a".into(), a), ("b".into(), b)], RoutePolicy::RoundRobin).unwrap();
    for k in 0..6 {
        drain(router.submit(req(&format!("rr{k}"), vec![100 + k, 101, 102], 2)).unwrap());
    }
    assert_eq!(decisions(&router), [3, 3]);

    let (a, b) = (worker(1), worker(0));
    let router = Router::new(vec![("a".into(), a), ("b".into(), b)], RoutePolicy::LeastLoad).unwrap();
    // Four long requests at once: two each, whatever each worker's speed.
    let held: Vec<_> =
        (0..4).map(|k| router.submit(req(&format!("ll{k}"), vec![200 + k, 201, 202], 500)).unwrap()).collect();
    assert_eq!(decisions(&router), [2, 2]);
    drop(held);
    // Dropped streams leave the ledger: the next goes to the first worker again.
    router.submit(req("next", vec![300, 301], 1)).map(drain).unwrap();
    assert_eq!(decisions(&router), [3, 2]);
}

#[test]
fn a_dead_worker_gets_nothing_more() {
    let (a, b) = (worker(1), worker(0));
    let router = Router::new(vec![("a".into(), a.clone()), ("b".into(), b)], RoutePolicy::RoundRobin).unwrap();
    let in_flight = router.submit(req("doomed", vec![1, 2, 3], 1500)).unwrap();
    assert_eq!(decisions(&router), [1, 0]);
    router.inject_fault(0).unwrap();
    // Its request ends with Stopped (the server's 503), not a generic error.
    let mut s = in_flight;
    let last = std::iter::from_fn(|| s.next_blocking()).last();
    assert!(matches!(last, Some(EngineEvent::Stopped(_))), "{last:?}");
    let t0 = Instant::now();
    while a.is_healthy() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(router.live_workers(), (1, 2));
    for k in 0..4 {
        assert_eq!(drain(router.submit(req(&format!("after{k}"), vec![10 + k, 11], 3)).unwrap()), 3);
    }
    assert_eq!(decisions(&router), [1, 4]);
    assert!(router.stats().healthy, "healthy while any worker is");
    router.inject_fault(1).unwrap();
    let t0 = Instant::now();
    while router.is_healthy() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    let err = router.submit(req("none", vec![1, 2], 1)).err().expect("no worker left");
    assert!(matches!(err, flint_engine::EngineError::Unavailable(_) | flint_engine::EngineError::Internal(_)), "{err}");
    assert!(router.inject_fault(7).is_err());
}
