//! Speculative decoding through the engine core with fake runners: greedy output and logprobs
//! unchanged by speculation (alone, batched with sampled requests, chunked, preempted), block
//! accounting after frequent rejections, prefix-cache hits after speculative runs, and sampling
//! that stays exact (the joint distribution of the first tokens, chi-square).

mod fake_runner;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use fake_runner::{config, core, FakeRunner};
use flint_engine::engine_core::{EventSink, ModelInfo};
use flint_engine::scheduler::{SchedulerConfig, StepPlan};
use flint_engine::{
    DraftRequest, EngineCore, EngineError, EngineEvent, ModelRunner, Request, RequestParams, SamplingParams,
    SpeculativeConfig, StepLogits,
};

/// (token, bits of its logprob) in order.
type Trace = Vec<(u32, Option<u32>)>;
type Log = Arc<Mutex<Trace>>;

/// Records each token and the bits of its logprob.
fn sink() -> (Log, EventSink) {
    let log: Log = Arc::default();
    let l = log.clone();
    let sink: EventSink = Box::new(move |ev| {
        match ev {
            EngineEvent::Output(o) => {
                let mut v = l.lock().unwrap();
                for (i, t) in o.token_ids.iter().enumerate() {
                    v.push((*t, o.logprobs.get(i).map(|lp| lp.logprob.to_bits())));
                }
            }
            EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => panic!("request failed: {e}"),
        }
        true
    });
    (log, sink)
}

fn drain<R: ModelRunner>(core: &mut EngineCore<R>) {
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
}

fn ngram(k: usize, min: usize, max: usize) -> SpeculativeConfig {
    SpeculativeConfig::parse(&format!(
        r#"{{"method": "ngram", "num_speculative_tokens": {k}, "prompt_lookup_min": {min}, "prompt_lookup_max": {max}}}"#
    ))
    .unwrap()
}

/// A prompt that repeats itself, so lookup finds matches from the start.
fn prompt(i: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|p| 1000 + (p * 7 + i) % (5 + i % 4)).collect()
}

fn params(i: usize) -> RequestParams {
    let sampling = if i % 3 == 2 {
        SamplingParams { temperature: 0.9, top_p: 0.9, seed: Some(i as u64), ..Default::default() }
    } else {
        SamplingParams::default()
    };
    RequestParams { sampling, max_tokens: 20 + i % 7, ignore_eos: true, logprobs: Some(2), ..Default::default() }
}

/// Every request's (token, logprob bits), by request.
fn run_all(cfg: SchedulerConfig, spec: Option<SpeculativeConfig>, n: usize) -> (Vec<Trace>, EngineCore<FakeRunner>) {
    let mut c = core(cfg);
    c.runner_mut().window = Some(1);
    c.set_speculative(spec);
    let logs: Vec<Log> = (0..n)
        .map(|i| {
            let (log, s) = sink();
            c.add(Request { id: format!("r{i}"), prompt: prompt(i as u32, 9 + i * 5), params: params(i) }, s).unwrap();
            log
        })
        .collect();
    drain(&mut c);
    (logs.iter().map(|l| l.lock().unwrap().clone()).collect(), c)
}

#[test]
fn greedy_tokens_and_logprobs_do_not_change_with_speculation() {
    // Alone, without speculation: the reference for each request.
    let solo: Vec<_> = (0..6)
        .map(|i| {
            let mut c = core(config(512, 4096, 64));
            c.runner_mut().window = Some(1);
            let (log, s) = sink();
            c.add(Request { id: "r".into(), prompt: prompt(i as u32, 9 + i * 5), params: params(i) }, s).unwrap();
            drain(&mut c);
            let t = log.lock().unwrap().clone();
            t
        })
        .collect();
    // Each row depends on the last token only: greedy output cycles, so lookup is often right,
    // and wrong wherever the prompt or a sampled token led it astray.
    for (budget, blocks, spec) in [(4096, 512, ngram(4, 1, 3)), (7, 512, ngram(3, 1, 1)), (16, 30, ngram(8, 1, 2))] {
        let (got, c) = run_all(config(blocks, budget, 64), Some(spec.clone()), 6);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.len(), params(i).max_tokens, "request {i}: every token, none past max_tokens");
            if params(i).sampling.temperature == 0.0 {
                assert_eq!(*g, solo[i], "greedy request {i}, budget {budget}, {blocks} blocks, {spec:?}");
            }
        }
        let st = &c.spec_counters;
        assert!(st.drafts > 0 && st.accepted_tokens > 0, "{spec:?}: {st:?}");
        assert!(st.accepted_tokens < st.draft_tokens, "{spec:?}: rejections too: {st:?}");
        if blocks == 30 {
            assert!(c.scheduler().stats.preemptions > 0, "a 30-block pool must preempt");
        }
        assert_eq!(c.scheduler().kv().pool().num_held(), 0, "every block returned");
    }
}

#[test]
fn disable_by_batch_size_pauses_speculation() {
    let mut spec = ngram(4, 1, 3);
    spec.disable_by_batch_size = Some(2);
    let (_, c) = run_all(config(512, 4096, 64), Some(spec.clone()), 5);
    let busy = c.spec_counters.drafts;
    let (_, c) = run_all(config(512, 4096, 2), Some(spec), 5);
    let calm = c.spec_counters.drafts;
    // With at most 2 running, speculation never pauses; with 5 it pauses until some finish.
    assert!(busy < calm, "drafts with 5 running {busy}, with 2 {calm}");
}

/// A prefix-cache hit after speculative runs reads back only accepted tokens: the fake derives
/// each row from the tokens stored in the blocks, so a rejected draft left in a shared block
/// would change what a later request generates.
#[test]
fn prefix_cache_after_speculation_holds_only_accepted_tokens() {
    let mut spec_core = core(config(512, 4096, 64));
    spec_core.set_speculative(Some(ngram(6, 1, 2)));
    let p = prompt(3, 20);
    let (log, s) = sink();
    spec_core.add(Request { id: "a".into(), prompt: p.clone(), params: params(0) }, s).unwrap();
    drain(&mut spec_core);
    let st = &spec_core.spec_counters;
    assert!(st.draft_tokens > 0 && st.accepted_tokens < st.draft_tokens, "{st:?}");
    // Now a prompt that extends the first request's prompt and output: its blocks are cached.
    let mut follow = p.clone();
    follow.extend(log.lock().unwrap().iter().map(|t| t.0));
    follow.extend([1001, 1002, 1003]);
    let (log2, s) = sink();
    spec_core.add(Request { id: "b".into(), prompt: follow.clone(), params: params(1) }, s).unwrap();
    drain(&mut spec_core);
    // The first request computed its 20 prompt and 19 of its 20 output tokens: 9 full blocks.
    assert_eq!(spec_core.scheduler().stats.prefix_hits, 36, "{:?}", spec_core.scheduler().stats);
    let mut cold = core(config(512, 4096, 64));
    let (log3, s) = sink();
    cold.add(Request { id: "b".into(), prompt: follow, params: params(1) }, s).unwrap();
    drain(&mut cold);
    assert_eq!(*log2.lock().unwrap(), *log3.lock().unwrap());
}

/// A first-order Markov "model" over three tokens: each row depends on the last token only, so
/// the exact joint distribution of a sample's first tokens is a product of its rows. With
/// `draft`, it also plays a draft model that proposes the argmax of other rows (`DRAFT`), which
/// disagree with the target's samples often.
struct Markov {
    draft: bool,
}

const DRAFT: [[f32; 3]; 3] = [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]];

const LOGITS: [[f32; 3]; 3] = [[0.3, 1.0, -0.2], [1.2, -0.4, 0.5], [0.0, 0.6, 0.9]];

impl ModelRunner for Markov {
    fn propose(&mut self, reqs: &[DraftRequest]) -> Result<Vec<Vec<u32>>, EngineError> {
        Ok(reqs
            .iter()
            .map(|r| {
                let mut t = r.token;
                (0..if self.draft { r.k } else { 0 })
                    .map(|_| {
                        t = flint_engine::sampler::argmax(&DRAFT[t as usize]);
                        t
                    })
                    .collect()
            })
            .collect())
    }

    fn execute(&mut self, plan: &StepPlan) -> Result<StepLogits, EngineError> {
        let mut data = Vec::new();
        for c in &plan.chunks {
            for &t in &c.tokens[c.logits().rows(c.tokens.len())] {
                data.extend_from_slice(&LOGITS[t as usize]);
            }
        }
        Ok(StepLogits { width: 3, data, ..Default::default() })
    }
}

fn softmax(l: &[f32; 3], temperature: f64) -> [f64; 3] {
    let w: Vec<f64> = l.iter().map(|&x| (f64::from(x) / temperature).exp()).collect();
    let s: f64 = w.iter().sum();
    [w[0] / s, w[1] / s, w[2] / s]
}

/// With a draft that disagrees often (prompt lookup over a prompt the chain does not follow),
/// the first four sampled tokens — the prefill's, then verifications of drafts of up to two
/// tokens — have exactly the distribution sampling without speculation has.
#[test]
fn sampling_with_speculation_is_exact() {
    sampling_is_exact(ngram(2, 1, 1), false);
}

/// The same with a draft model's greedy proposals.
#[test]
fn sampling_with_a_draft_model_is_exact() {
    let cfg = SpeculativeConfig::parse(r#"{"model": "markov-draft", "num_speculative_tokens": 2}"#).unwrap();
    sampling_is_exact(cfg, true);
}

fn sampling_is_exact(spec: SpeculativeConfig, draft: bool) {
    const T: f64 = 0.8;
    const N: u64 = 6000;
    let cfg = SchedulerConfig { max_model_len: 64, ..config(4096, 4096, 64) };
    let info = ModelInfo { vocab_size: 3, valid_vocab: 3, eos_token_ids: vec![] };
    let mut c = EngineCore::new(Markov { draft }, cfg, fake_runner::tokenizer(), info);
    c.check_invariants = true;
    c.set_speculative(Some(spec));
    let prompt = vec![0, 2, 1, 0, 2, 1, 0];
    let mut counts: HashMap<Vec<u32>, u64> = HashMap::new();
    for seed in 0..N {
        let (log, s) = sink();
        let params = RequestParams {
            sampling: SamplingParams { temperature: T as f32, seed: Some(seed), ..Default::default() },
            max_tokens: 4,
            ..Default::default()
        };
        c.add(Request { id: format!("{seed}"), prompt: prompt.clone(), params }, s).unwrap();
        drain(&mut c);
        let toks: Vec<u32> = log.lock().unwrap().iter().map(|t| t.0).collect();
        *counts.entry(toks).or_default() += 1;
    }
    let st = c.spec_counters.clone();
    assert!(st.drafts >= N && st.draft_tokens >= 2 * N, "every request verified a two-token draft: {st:?}");
    assert!(st.accepted_tokens > N / 20 && st.accepted_tokens < st.draft_tokens / 2, "{st:?}");
    let rows: Vec<[f64; 3]> = LOGITS.iter().map(|l| softmax(l, T)).collect();
    let mut x2 = 0.0;
    let mut cells = 0;
    for a in 0..3u32 {
        for b in 0..3u32 {
            for d in 0..3u32 {
                for e in 0..3u32 {
                    let p = rows[0][a as usize]
                        * rows[a as usize][b as usize]
                        * rows[b as usize][d as usize]
                        * rows[d as usize][e as usize];
                    let seen = counts.get(&vec![a, b, d, e]).copied().unwrap_or(0) as f64;
                    x2 += (seen - p * N as f64).powi(2) / (p * N as f64);
                    cells += 1;
                }
            }
        }
    }
    assert_eq!(counts.values().sum::<u64>(), N);
    // 80 degrees of freedom; the 0.1% critical value of chi-square is 124.8.
    assert_eq!(cells, 81);
    assert!(x2 < 124.8, "chi-square {x2:.1} over {cells} cells: speculation changed the distribution");
}

/// EOS, `min_tokens`, stop ids, stop strings and `max_tokens` end a speculating sample exactly
/// where they end a plain one: the same text, tokens and finish, event for event in sum.
#[test]
fn stops_end_speculation_where_they_end_plain_decoding() {
    type Outcome = (Vec<u32>, String, Option<flint_engine::Finished>);
    let run = |params: RequestParams, spec: Option<SpeculativeConfig>| -> Outcome {
        let mut c = core(config(256, 64, 8));
        c.runner_mut().window = Some(1);
        c.runner_mut().eos_every = 5;
        c.set_speculative(spec);
        let log: Arc<Mutex<Vec<EngineEvent>>> = Arc::default();
        let l = log.clone();
        c.add(
            Request { id: "s".into(), prompt: prompt(2, 12), params },
            Box::new(move |ev| l.lock().map(|mut v| v.push(ev)).is_ok()),
        )
        .unwrap();
        drain(&mut c);
        let mut out: Outcome = Default::default();
        for ev in log.lock().unwrap().iter() {
            match ev {
                EngineEvent::Output(o) => {
                    out.0.extend(&o.token_ids);
                    out.1.push_str(&o.text);
                    out.2 = o.finished.clone().or(out.2.take());
                }
                EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => panic!("{e}"),
            }
        }
        out
    };
    let free = run(RequestParams { max_tokens: 60, ..Default::default() }, None);
    let text_plain = run(RequestParams { max_tokens: 60, ignore_eos: true, ..Default::default() }, None).1;
    let stop: String = text_plain.chars().skip(text_plain.chars().count() / 2).take(3).collect();
    let cases = [
        RequestParams { max_tokens: 60, ..Default::default() },
        RequestParams { max_tokens: 60, min_tokens: free.0.len() + 4, ..Default::default() },
        RequestParams { max_tokens: 60, ignore_eos: true, stop_token_ids: vec![free.0[3]], ..Default::default() },
        RequestParams { max_tokens: 60, ignore_eos: true, stop: vec![stop.clone()], ..Default::default() },
        RequestParams { max_tokens: 17, ignore_eos: true, ..Default::default() },
    ];
    for (i, params) in cases.into_iter().enumerate() {
        let plain = run(params.clone(), None);
        for spec in [ngram(4, 1, 2), ngram(8, 1, 1)] {
            assert_eq!(run(params.clone(), Some(spec.clone())), plain, "case {i}, {spec:?}");
        }
    }
}

/// A draft model (the fake's own greedy continuation, one proposal in three spoiled): greedy
/// tokens and logprob bits as without speculation, alone, batched with sampled requests, chunked
/// and preempted; blocks all returned.
#[test]
fn draft_model_keeps_greedy_output() {
    let spec = SpeculativeConfig::parse(r#"{"model": "fake-draft", "num_speculative_tokens": 4}"#).unwrap();
    let solo: Vec<_> = (0..4)
        .map(|i| {
            let mut c = core(config(512, 4096, 64));
            let (log, s) = sink();
            c.add(Request { id: "r".into(), prompt: prompt(i as u32, 9 + i * 5), params: params(i) }, s).unwrap();
            drain(&mut c);
            let t = log.lock().unwrap().clone();
            t
        })
        .collect();
    for (budget, blocks) in [(4096, 512), (3, 512), (16, 24)] {
        let mut c = core(config(blocks, budget, 64));
        c.runner_mut().draft_wrong_every = Some(3);
        c.set_speculative(Some(spec.clone()));
        let logs: Vec<Log> = (0..4)
            .map(|i| {
                let (log, s) = sink();
                c.add(Request { id: format!("r{i}"), prompt: prompt(i as u32, 9 + i * 5), params: params(i) }, s)
                    .unwrap();
                log
            })
            .collect();
        drain(&mut c);
        for (i, log) in logs.iter().enumerate() {
            let got = log.lock().unwrap().clone();
            assert_eq!(got.len(), params(i).max_tokens);
            if params(i).sampling.temperature == 0.0 {
                assert_eq!(got, solo[i], "greedy request {i}, budget {budget}, {blocks} blocks");
            }
        }
        let st = &c.spec_counters;
        assert!(st.accepted_tokens > 0 && st.accepted_tokens < st.draft_tokens, "{budget}/{blocks}: {st:?}");
        if blocks == 24 {
            assert!(c.scheduler().stats.preemptions > 0, "a 24-block pool must preempt");
        }
        assert_eq!(c.scheduler().kv().pool().num_held(), 0, "every block returned");
    }
}
