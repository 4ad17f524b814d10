//! Structured outputs on a real model: the random-weight golden checkpoint with Qwen's full
//! vocabulary, which writes gibberish unless constrained. Every constrained sample must parse
//! and validate, across seeds and `n > 1`; an unconstrained request batched with constrained ones
//! keeps its exact tokens and logprobs; speculative decoding does not change constrained greedy
//! output.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device};
use flint_engine::engine_core::{EventSink, ModelInfo};
use flint_engine::structured::{Constraint, GrammarCompiler, StructuredOutput};
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{
    EngineCore, EngineEvent, FinishReason, PagedModelRunner, Request, RequestParams, SamplingParams, SchedulerConfig,
    SpeculativeConfig,
};
use flint_model::source::Checkpoint;
use flint_model::{DecoderModel, KvCacheDtype, PagedKvCache};
use serde_json::{json, Value};

const EOS: [u32; 2] = [151_645, 151_643];

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden/full-vocab-bf16")
}

struct Setup {
    model: Arc<DecoderModel>,
    ck: Checkpoint,
    tokenizer: Arc<Tokenizer>,
    grammars: GrammarCompiler,
}

impl Setup {
    fn new() -> Self {
        let ck = Checkpoint::open(fixture().to_str().unwrap()).unwrap();
        let model = Arc::new(DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).unwrap());
        let tokenizer = Arc::new(Tokenizer::builtin_qwen().unwrap());
        let grammars = GrammarCompiler::new(tokenizer.clone(), ck.config.vocab_size, EOS.to_vec());
        Self { model, ck, tokenizer, grammars }
    }

    fn core(&self) -> EngineCore<PagedModelRunner> {
        let num_blocks = 512;
        let cache = PagedKvCache::new(&self.ck.config, KvCacheDtype::F32, 16, num_blocks).unwrap();
        let sched = SchedulerConfig {
            max_num_batched_tokens: 256,
            max_num_seqs: 64,
            max_model_len: 4096,
            block_size: 16,
            num_blocks,
            enable_prefix_caching: true,
            quantize_full_blocks: false,
        };
        let info = ModelInfo {
            vocab_size: self.ck.config.vocab_size,
            valid_vocab: self.tokenizer.len(),
            eos_token_ids: EOS.to_vec(),
        };
        let runner =
            PagedModelRunner { model: self.model.clone(), cache: flint_model::KvPool::Host(cache), draft: None };
        let mut core = EngineCore::new(runner, sched, self.tokenizer.clone(), info);
        core.check_invariants = true;
        core
    }

    fn constrained(&self, c: Constraint, n: usize, seed: u64, max_tokens: usize) -> RequestParams {
        let grammar = self.grammars.compile(&c).unwrap();
        RequestParams {
            n,
            max_tokens,
            sampling: SamplingParams { temperature: 1.0, seed: Some(seed), ..Default::default() },
            structured: Some(StructuredOutput { grammar, after: None }),
            ..Default::default()
        }
    }
}

/// Each sample's text, tokens (with logprob bits) and finish reason.
#[derive(Debug, Clone, Default, PartialEq)]
struct Out {
    text: String,
    tokens: Vec<(u32, u32)>,
    finish: Option<FinishReason>,
}

type Outs = Arc<Mutex<Vec<Out>>>;

fn sink(n: usize) -> (Outs, EventSink) {
    let outs: Outs = Arc::new(Mutex::new(vec![Out::default(); n]));
    let o = outs.clone();
    let sink: EventSink = Box::new(move |ev| {
        match ev {
            EngineEvent::Output(s) => {
                let mut v = o.lock().unwrap();
                let out = &mut v[s.index];
                out.text.push_str(&s.text);
                let bits = s.logprobs.iter().map(|l| l.logprob.to_bits()).chain(std::iter::repeat(0));
                out.tokens.extend(s.token_ids.iter().copied().zip(bits));
                if let Some(f) = s.finished {
                    out.finish = Some(f.reason);
                }
            }
            EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => panic!("request failed: {e}"),
        }
        true
    });
    (outs, sink)
}

fn drain(core: &mut EngineCore<PagedModelRunner>) {
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        assert!(steps < 5_000, "no progress");
    }
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..20u32).map(|i| (seed.wrapping_mul(7919).wrapping_add(i * 131)) % 20_000 + 100).collect()
}

fn run(core: &mut EngineCore<PagedModelRunner>, reqs: Vec<RequestParams>) -> Vec<Vec<Out>> {
    let mut all = Vec::new();
    for (i, params) in reqs.into_iter().enumerate() {
        let (outs, s) = sink(params.n);
        core.add(Request { id: format!("r{i}"), prompt: prompt(i as u32), params }, s).unwrap();
        all.push(outs);
    }
    drain(core);
    all.into_iter().map(|o| o.lock().unwrap().clone()).collect()
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": false
            },
            "active": {"type": "boolean"}
        },
        "required": ["name", "age", "role", "tags", "address", "active"],
        "additionalProperties": false
    })
}

/// The schema above, checked by hand.
fn validate(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    for k in ["name", "age", "role", "tags", "address", "active"] {
        if !keys.contains(&k) {
            return Err(format!("missing {k}"));
        }
    }
    if keys.len() != 6 {
        return Err(format!("extra keys: {keys:?}"));
    }
    let chars = |s: &Value| s.as_str().map(|s| s.chars().count());
    if chars(&o["name"]).is_none_or(|n| n > 8) {
        return Err("name".into());
    }
    if o["age"].as_u64().is_none_or(|a| a > 120) {
        return Err("age".into());
    }
    if !["admin", "user", "guest"].iter().any(|r| o["role"] == *r) {
        return Err("role".into());
    }
    let tags = o["tags"].as_array().ok_or("tags")?;
    if tags.len() > 3 || tags.iter().any(|t| chars(t).is_none_or(|n| n > 5)) {
        return Err("tags".into());
    }
    let a = o["address"].as_object().ok_or("address")?;
    let zip = a.get("zip").and_then(Value::as_str).ok_or("zip")?;
    if a.len() != 2
        || chars(&a["city"]).is_none_or(|n| n > 10)
        || zip.len() != 5
        || !zip.bytes().all(|b| b.is_ascii_digit())
    {
        return Err("address".into());
    }
    if !o["active"].is_boolean() {
        return Err("active".into());
    }
    Ok(())
}

#[test]
fn every_constrained_sample_parses_and_validates() {
    let s = Setup::new();
    let mut core = s.core();
    let reqs = (0..3).map(|seed| s.constrained(Constraint::JsonSchema(schema()), 3, seed, 300)).collect();
    let outs = run(&mut core, reqs);
    let mut distinct = std::collections::HashSet::new();
    for (r, samples) in outs.iter().enumerate() {
        for (i, o) in samples.iter().enumerate() {
            assert_eq!(o.finish, Some(FinishReason::Stop), "request {r} sample {i} did not finish: {:?}", o.text);
            let v: Value = serde_json::from_str(&o.text).unwrap_or_else(|e| panic!("{e}: {:?}", o.text));
            validate(&v).unwrap_or_else(|e| panic!("{e}: {}", o.text));
            distinct.insert(o.text.clone());
        }
    }
    assert!(distinct.len() > 4, "samples differ across seeds and n: {distinct:?}");
    let st = core.mask_times;
    assert!(st.count > 50, "every constrained token had a mask: {}", st.count);
}

#[test]
fn regex_choice_and_json_object_constraints_hold() {
    let s = Setup::new();
    let mut core = s.core();
    let re = "[A-Z][a-z]{2,6}-[0-9]{3}";
    let choices = vec!["alpha".to_string(), "beta".into(), "gamma \"delta\"".into()];
    let reqs = vec![
        s.constrained(Constraint::Regex(re.into()), 4, 1, 40),
        s.constrained(Constraint::Choice(choices.clone()), 4, 2, 40),
    ];
    let outs = run(&mut core, reqs);
    let re = regex::Regex::new(&format!("^{re}$")).unwrap();
    for o in &outs[0] {
        assert!(re.is_match(&o.text), "{:?}", o.text);
    }
    for o in &outs[1] {
        assert!(choices.contains(&o.text), "{:?}", o.text);
        assert_eq!(o.finish, Some(FinishReason::Stop));
    }
    // Greedy: the same constrained answer every time.
    let mut greedy = s.constrained(Constraint::Choice(choices.clone()), 1, 0, 40);
    greedy.sampling.temperature = 0.0;
    let a = run(&mut core, vec![greedy.clone()]);
    let b = run(&mut core, vec![greedy]);
    assert_eq!(a, b);
}

/// A constrained sample that hits max_tokens mid-grammar ends with `length`, its text a prefix
/// the grammar allows.
#[test]
fn max_tokens_mid_grammar_is_a_length_finish() {
    let s = Setup::new();
    let mut core = s.core();
    let outs = run(&mut core, vec![s.constrained(Constraint::JsonSchema(schema()), 1, 5, 3)]);
    let o = &outs[0][0];
    assert_eq!(o.finish, Some(FinishReason::Length));
    assert_eq!(o.tokens.len(), 3);
    assert!(o.text.starts_with("{\""), "{:?}", o.text);
}

#[test]
fn an_unconstrained_request_is_unchanged_by_constrained_neighbours() {
    let s = Setup::new();
    let target = RequestParams { max_tokens: 16, ignore_eos: true, logprobs: Some(0), ..Default::default() };
    let alone = run(&mut s.core(), vec![target.clone()]);
    let mut core = s.core();
    let mut reqs = vec![target];
    reqs.extend((0..3).map(|seed| s.constrained(Constraint::JsonSchema(schema()), 2, seed, 100)));
    let batched = run(&mut core, reqs);
    assert_eq!(alone[0], batched[0], "tokens and logprob bits match");
    assert!(core.mask_times.count > 0);
}

#[test]
fn speculation_keeps_constrained_greedy_output() {
    let s = Setup::new();
    let mut p = s.constrained(Constraint::JsonSchema(schema()), 1, 0, 200);
    p.sampling.temperature = 0.0;
    p.logprobs = Some(0);
    let plain = run(&mut s.core(), vec![p.clone(), p.clone()]);
    let mut core = s.core();
    let cfg = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#;
    core.set_speculative(Some(SpeculativeConfig::parse(cfg).unwrap()));
    let spec = run(&mut core, vec![p.clone(), p]);
    assert_eq!(plain, spec);
    assert!(core.spec_counters.draft_tokens > 0, "drafts were proposed and verified");
    validate(&serde_json::from_str(&spec[0][0].text).unwrap()).unwrap();
}
