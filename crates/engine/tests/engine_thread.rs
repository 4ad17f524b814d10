//! The threaded engine: async event streams, synchronous validation, abort by id and by dropping
//! the stream (blocks freed at once), stats, and shutdown ending pending requests with an error.

mod fake_runner;

use std::time::{Duration, Instant};

use fake_runner::{config, core};
use flint_engine::{Engine, EngineError, EngineEvent, FinishReason, Request, RequestParams};

fn req(id: &str, len: usize, max_tokens: usize) -> Request {
    Request {
        id: id.into(),
        prompt: (0..len as u32).map(|i| 2000 + i).collect(),
        params: RequestParams { max_tokens, ignore_eos: true, ..Default::default() },
    }
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn async_streams_deliver_every_token_concurrently() {
    let engine = Engine::start(core(config(256, 64, 8)));
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let counts = rt.block_on(async {
        let mut streams: Vec<_> =
            (0..4).map(|i| engine.submit(req(&format!("r{i}"), 5 + i, 10 + i)).unwrap()).collect();
        let mut counts = Vec::new();
        for s in &mut streams {
            let (mut n, mut finish) = (0, None);
            while let Some(ev) = s.next().await {
                match ev {
                    EngineEvent::Output(o) => {
                        n += o.token_ids.len();
                        finish = o.finished.map(|f| f.reason).or(finish);
                    }
                    EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => panic!("{e}"),
                }
            }
            counts.push((n, finish));
        }
        counts
    });
    for (i, (n, f)) in counts.iter().enumerate() {
        assert_eq!(*n, 10 + i);
        assert_eq!(*f, Some(FinishReason::Length));
    }
    // Stats are published after each step, just after its events.
    wait_until("stats", || engine.stats().generation_tokens == 10 + 11 + 12 + 13);
    assert!(engine.stats().healthy);
    engine.shutdown();
}

#[test]
fn invalid_requests_fail_at_submit() {
    let engine = Engine::start(core(config(16, 64, 8)));
    let e = engine.submit(req("big", 100, 1)).err().expect("must be refused");
    assert!(matches!(e, EngineError::Admission(_)), "{e}");
    let mut bad = req("t", 3, 4);
    bad.params.sampling.temperature = -1.0;
    assert!(engine.submit(bad).err().unwrap().to_string().contains("temperature"));
    engine.shutdown();
}

#[test]
fn dropping_a_stream_or_aborting_frees_its_blocks_at_once() {
    let engine = Engine::start(core(config(256, 64, 8)));
    let mut s = engine.submit(req("long", 20, 100_000 / 100)).unwrap();
    // Let it start, then walk away mid-generation.
    assert!(matches!(s.next_blocking(), Some(EngineEvent::Output(_))));
    wait_until("blocks in use", || engine.stats().kv_cache_usage > 0.0);
    drop(s);
    wait_until("blocks to be freed after drop", || {
        let st = engine.stats();
        st.kv_cache_usage == 0.0 && st.num_running == 0
    });

    // A dropped stream aborts only its own request, even when another shares its client id.
    let mut keep = engine.submit(req("same", 10, 30)).unwrap();
    let gone = engine.submit(req("same", 12, 1000)).unwrap();
    drop(gone);
    let mut n = 0;
    while let Some(ev) = keep.next_blocking() {
        if let EngineEvent::Output(o) = ev {
            n += o.token_ids.len();
            if let Some(f) = o.finished {
                assert_eq!(f.reason, FinishReason::Length);
            }
        }
    }
    assert_eq!(n, 30);

    let mut s = engine.submit(req("aborted", 20, 1000)).unwrap();
    assert!(matches!(s.next_blocking(), Some(EngineEvent::Output(_))));
    engine.abort("aborted");
    let mut last = None;
    while let Some(ev) = s.next_blocking() {
        last = Some(ev);
    }
    match last {
        Some(EngineEvent::Output(o)) => assert_eq!(o.finished.unwrap().reason, FinishReason::Abort),
        other => panic!("expected an abort finish, got {other:?}"),
    }
    wait_until("blocks to be freed after abort", || engine.stats().kv_cache_usage == 0.0);
    engine.shutdown();
    assert!(!engine.is_healthy());
    assert!(engine.submit(req("late", 2, 2)).is_err(), "a stopped engine refuses work");
}
