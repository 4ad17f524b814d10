//! The engine core with a fake model runner: scheduling, preemption, prefix caching, sampling
//! parameters, stop conditions, failures and aborts, end to end through the event sinks.

mod fake_runner;

use std::sync::{Arc, Mutex};

use fake_runner::{config, core, FakeRunner, EOS};
use flint_engine::engine_core::EventSink;
use flint_engine::{
    EngineCore, EngineError, EngineEvent, FinishReason, Request, RequestParams, SampleOutput, SamplingParams, StopMatch,
};

type Log = Arc<Mutex<Vec<EngineEvent>>>;

fn sink() -> (Log, EventSink) {
    let log: Log = Arc::default();
    let l = log.clone();
    (log, Box::new(move |ev| l.lock().map(|mut v| v.push(ev)).is_ok()))
}

fn run(core: &mut EngineCore<FakeRunner>) -> usize {
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        assert!(steps < 100_000, "engine does not make progress");
    }
    steps
}

/// Per sample index: (token ids, text, finish).
fn collect(log: &Log) -> Vec<(Vec<u32>, String, Option<flint_engine::Finished>)> {
    let mut out: Vec<(Vec<u32>, String, Option<flint_engine::Finished>)> = Vec::new();
    for ev in log.lock().unwrap().iter() {
        match ev {
            EngineEvent::Output(SampleOutput { index, text, token_ids, finished, .. }) => {
                if out.len() <= *index {
                    out.resize(*index + 1, Default::default());
                }
                out[*index].0.extend(token_ids);
                out[*index].1.push_str(text);
                if finished.is_some() {
                    out[*index].2 = finished.clone();
                }
            }
            EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => {
                panic!("unexpected error event: {e}")
            }
        }
    }
    out
}

fn prompt(seed: u64, shared: usize, own: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..shared as u32).map(|i| 2000 + i).collect();
    p.extend((0..own as u64).map(|i| 3000 + ((seed * 131 + i * 17) % 500) as u32));
    p
}

fn req(id: &str, prompt: Vec<u32>, params: RequestParams) -> Request {
    Request { id: id.into(), prompt, params }
}

fn greedy(max_tokens: usize) -> RequestParams {
    RequestParams { max_tokens, ignore_eos: true, ..Default::default() }
}

#[test]
fn batching_chunking_preemption_and_prefix_hits_do_not_change_outputs() {
    let prompts: Vec<Vec<u32>> = (0..12).map(|i| prompt(i, 22, 1 + (i as usize * 7) % 40)).collect();
    let params = |i: usize| {
        if i.is_multiple_of(3) {
            // Seeded random sampling must be just as independent of the batch.
            RequestParams {
                sampling: SamplingParams { temperature: 0.9, top_p: 0.9, seed: Some(i as u64), ..Default::default() },
                ..greedy(24)
            }
        } else {
            greedy(24)
        }
    };
    let mut solo = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut c = core(config(512, 4096, 64));
        let (log, s) = sink();
        c.add(req("r", p.clone(), params(i)), s).unwrap();
        run(&mut c);
        solo.push(collect(&log));
    }
    // All together: a budget of 16 tokens chunks every prompt, 40 blocks of 4 force preemption.
    for (budget, blocks) in [(16, 40), (7, 64), (4096, 512)] {
        let mut c = core(config(blocks, budget, 64));
        let logs: Vec<Log> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (log, s) = sink();
                c.add(req(&format!("r{i}"), p.clone(), params(i)), s).unwrap();
                log
            })
            .collect();
        run(&mut c);
        for (i, log) in logs.iter().enumerate() {
            assert_eq!(collect(log), solo[i], "request {i} with budget {budget}, {blocks} blocks");
        }
        let st = c.scheduler().stats;
        // With a large budget all twelve are admitted in one step, before any block is computed.
        assert!(
            budget == 4096 || st.prefix_hits > 0,
            "the shared 22-token prefix must hit the cache ({budget}, {blocks}): {st:?}"
        );
        if blocks == 40 {
            assert!(st.preemptions > 0, "a 40-block pool must preempt");
        }
        assert_eq!(c.scheduler().kv().pool().num_held(), 0, "every block returned");
        assert_eq!(c.num_requests(), 0);
    }
}

#[test]
fn n_samples_share_the_prompt_and_are_reproducible() {
    let p = prompt(1, 30, 5);
    let params = RequestParams {
        n: 3,
        sampling: SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() },
        ..greedy(12)
    };
    let mut outs = Vec::new();
    for _ in 0..2 {
        let mut c = core(config(256, 64, 16));
        let (log, s) = sink();
        c.add(req("n", p.clone(), params.clone()), s).unwrap();
        run(&mut c);
        let o = collect(&log);
        assert_eq!(o.len(), 3);
        // Siblings reuse the first sample's full prompt blocks: 32 of 35 tokens, twice.
        assert_eq!(c.scheduler().stats.prefix_hits, 64);
        outs.push(o);
    }
    assert_eq!(outs[0], outs[1], "same seed, same samples");
    assert!(outs[0][0].0 != outs[0][1].0 || outs[0][1].0 != outs[0][2].0, "samples should differ");
}

#[test]
fn requests_that_can_never_fit_are_refused_at_admission() {
    let mut c = core(SchedulerConfig { max_model_len: 64, ..config(8, 64, 4) });
    let (_, s) = sink();
    let e = c.add(req("a", vec![1; 60], greedy(10)), s).unwrap_err();
    assert!(matches!(e, EngineError::Admission(_)), "{e}");
    assert!(e.to_string().contains("maximum context length is 64 tokens"), "{e}");
    let (_, s) = sink();
    let e = c.add(req("b", vec![1; 30], greedy(10)), s).unwrap_err();
    assert!(e.to_string().contains("needs 10 KV-cache blocks"), "{e}");
    let (_, s) = sink();
    let e = c.add(req("c", vec![], greedy(10)), s).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    let (_, s) = sink();
    let e = c.add(req("d", vec![1], RequestParams { max_tokens: 0, ..greedy(1) }), s).unwrap_err();
    assert!(e.to_string().contains("max_tokens"), "{e}");
    assert!(!c.has_work());
}

use flint_engine::SchedulerConfig;

#[test]
fn eos_min_tokens_and_stop_token_ids() {
    // EOS is likely: without min_tokens the sample stops early on it.
    let p = prompt(3, 8, 8);
    let run_with = |params: RequestParams| {
        let mut c = core(config(256, 64, 8));
        c.runner_mut().eos_every = 3;
        let (log, s) = sink();
        c.add(req("e", p.clone(), params), s).unwrap();
        run(&mut c);
        collect(&log).remove(0)
    };
    let free = run_with(RequestParams { max_tokens: 200, ..Default::default() });
    assert_eq!(free.2.as_ref().unwrap().stop, Some(StopMatch::Token(EOS)));
    let n = free.0.len();
    assert!(n < 200, "EOS must end the sample");
    assert!(!free.1.contains("<|im_end|>"), "a stop token is not part of the text");
    let min = run_with(RequestParams { max_tokens: 200, min_tokens: n + 3, ..Default::default() });
    assert!(min.0.len() >= n + 3, "min_tokens holds EOS back");
    assert_eq!(&min.0[..n - 1], &free.0[..n - 1]);
    let ignore = run_with(RequestParams { max_tokens: 50, ignore_eos: true, ..Default::default() });
    assert_eq!(ignore.0.len(), 50);
    assert_eq!(ignore.2.as_ref().unwrap().reason, FinishReason::Length);
    // A user stop id taken from the ignore-eos run ends generation where it first appears.
    let stop_id = ignore.0[5];
    let first = ignore.0.iter().position(|&t| t == stop_id).unwrap();
    let st = run_with(RequestParams {
        max_tokens: 50,
        ignore_eos: true,
        stop_token_ids: vec![stop_id],
        ..Default::default()
    });
    assert_eq!(st.0.len(), first + 1);
    assert_eq!(st.2.unwrap().stop, Some(StopMatch::Token(stop_id)));
}

#[test]
fn stop_strings_end_generation_and_are_never_streamed() {
    let p = prompt(4, 4, 4);
    let mut c = core(config(256, 64, 8));
    let (log, s) = sink();
    c.add(req("s", p.clone(), greedy(40)), s).unwrap();
    run(&mut c);
    let full = collect(&log).remove(0).1;
    // Pick a stop string that straddles the output's tokens: 3 characters from the middle.
    let chars: Vec<char> = full.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let at = full.find(&stop).unwrap();
    for include in [false, true] {
        let mut c = core(config(256, 64, 8));
        let (log, s) = sink();
        let params = RequestParams { stop: vec![stop.clone()], include_stop_str_in_output: include, ..greedy(40) };
        c.add(req("s", p.clone(), params), s).unwrap();
        run(&mut c);
        let (_, text, fin) = collect(&log).remove(0);
        let want = if include { &full[..at + stop.len()] } else { &full[..at] };
        assert_eq!(text, want, "include={include}");
        assert_eq!(fin.unwrap().stop, Some(StopMatch::Text(stop.clone())));
    }
    // Before min_tokens, stop strings do not apply (as vLLM).
    let mut c = core(config(256, 64, 8));
    let (log, s) = sink();
    c.add(req("s", p.clone(), RequestParams { stop: vec![stop.clone()], min_tokens: 40, ..greedy(40) }), s).unwrap();
    run(&mut c);
    let (_, text, fin) = collect(&log).remove(0);
    assert_eq!(text, full);
    assert_eq!(fin.unwrap().reason, FinishReason::Length);
}

#[test]
fn requests_sharing_a_client_id_are_separate_and_abort_by_id_ends_both() {
    let mut c = core(config(256, 4096, 8));
    let (a, s) = sink();
    let ha = c.add(req("dup", prompt(8, 4, 4), greedy(50)), s).unwrap();
    let (b, s) = sink();
    let hb = c.add(req("dup", prompt(9, 4, 4), greedy(50)), s).unwrap();
    assert_ne!(ha, hb);
    c.step();
    c.abort_handle(ha);
    assert_eq!(c.num_requests(), 1, "aborting one handle leaves the other");
    c.abort("dup");
    assert!(!c.has_work());
    for log in [a, b] {
        let last = log.lock().unwrap().last().cloned();
        assert!(
            matches!(last, Some(EngineEvent::Output(o)) if o.finished.as_ref().unwrap().reason == FinishReason::Abort)
        );
    }
}

#[test]
fn logprobs_and_prompt_logprobs() {
    let p = prompt(5, 6, 6);
    let mut c = core(config(256, 5, 8)); // budget 5: prompt logprobs arrive over three chunks
    let (log, s) = sink();
    c.add(req("l", p.clone(), RequestParams { logprobs: Some(3), prompt_logprobs: Some(2), ..greedy(4) }), s).unwrap();
    run(&mut c);
    let events = log.lock().unwrap().clone();
    let mut seen_prompt = 0;
    for ev in &events {
        let EngineEvent::Output(o) = ev else { panic!("{ev:?}") };
        assert_eq!(o.logprobs.len(), o.token_ids.len());
        for (lp, &t) in o.logprobs.iter().zip(&o.token_ids) {
            assert_eq!(lp.token, t);
            assert_eq!(lp.top.len(), 3);
            assert_eq!(lp.top[0].0, t, "greedy picks the most likely token");
            assert!(lp.logprob <= 0.0);
        }
        if let Some(pl) = &o.prompt_logprobs {
            seen_prompt += 1;
            assert_eq!(pl.len(), p.len());
            assert!(pl[0].is_none());
            for (i, e) in pl.iter().enumerate().skip(1) {
                let e = e.as_ref().unwrap();
                assert_eq!(e.token, p[i]);
                assert_eq!(e.top.len(), 2);
            }
        }
    }
    assert_eq!(seen_prompt, 1, "prompt logprobs are sent once");
}

/// max_tokens 0 scores the prompt (evaluation harnesses' `echo` with `max_tokens: 0`): its
/// logprobs, then a `length` finish with no token, for every sample; without prompt logprobs
/// it is refused.
#[test]
fn max_tokens_zero_scores_the_prompt() {
    let p = prompt(5, 6, 6);
    let mut c = core(config(256, 4, 8));
    let (log, s) = sink();
    c.add(req("z", p.clone(), RequestParams { prompt_logprobs: Some(1), n: 2, ..greedy(0) }), s).unwrap();
    run(&mut c);
    let events = log.lock().unwrap().clone();
    let outs: Vec<&SampleOutput> =
        events.iter().map(|e| if let EngineEvent::Output(o) = e { o } else { panic!("{e:?}") }).collect();
    assert_eq!(outs.len(), 2, "one final event per sample: {events:?}");
    for o in &outs {
        assert!(o.token_ids.is_empty() && o.text.is_empty());
        assert_eq!(o.finished.as_ref().map(|f| f.reason), Some(FinishReason::Length));
    }
    let pl = outs.iter().find_map(|o| o.prompt_logprobs.clone()).expect("prompt logprobs");
    assert_eq!(pl.len(), p.len());
    assert!(pl[1..].iter().all(|e| e.is_some()));
    assert_eq!(c.scheduler().kv().pool().num_held(), 0, "blocks back in the pool");
    let (_, s) = sink();
    assert!(c.add(req("zz", p, greedy(0)), s).is_err());
}

#[test]
fn a_failing_step_ends_its_requests_and_the_engine_keeps_serving() {
    for panic in [false, true] {
        let mut c = core(config(256, 4096, 8));
        if panic {
            c.runner_mut().panic_on = Some(7777);
        } else {
            c.runner_mut().fail_on = Some(7777);
        }
        let (bad_log, s) = sink();
        c.add(req("bad", vec![1, 2, 7777], greedy(5)), s).unwrap();
        run(&mut c);
        let ev = bad_log.lock().unwrap().clone();
        assert!(matches!(ev.last(), Some(EngineEvent::Error(m)) if m.contains("request failed")), "{ev:?}");
        assert_eq!(c.scheduler().kv().pool().num_held(), 0);
        let (good_log, s) = sink();
        c.add(req("good", vec![1, 2, 3], greedy(5)), s).unwrap();
        run(&mut c);
        assert_eq!(collect(&good_log)[0].0.len(), 5);
    }
}

#[test]
fn abort_and_a_vanished_client_free_blocks_at_once() {
    let mut c = core(config(256, 4096, 8));
    let (log, s) = sink();
    c.add(req("a", prompt(6, 10, 10), greedy(100)), s).unwrap();
    c.step();
    c.step();
    assert!(c.scheduler().kv().pool().num_held() > 0);
    c.abort("a");
    assert_eq!(c.scheduler().kv().pool().num_held(), 0);
    assert!(!c.has_work());
    let last = log.lock().unwrap().last().cloned();
    assert!(matches!(last, Some(EngineEvent::Output(o)) if o.finished.as_ref().unwrap().reason == FinishReason::Abort));
    // A sink that reports its receiver gone aborts the request on the next event.
    c.add(req("b", prompt(7, 10, 10), greedy(100)), Box::new(|_| false)).unwrap();
    c.step();
    assert!(!c.has_work());
    assert_eq!(c.scheduler().kv().pool().num_held(), 0);
}
