//! Batch invariance on the real model (the small f32 golden checkpoint over the paged KV cache):
//! a greedy request yields the same tokens — and bit-identical logprobs, a much finer check —
//! alone, batched with 1–31 others of different lengths, under different prefill chunk sizes,
//! after preemption and recompute, and with its prompt hitting the prefix cache cold, warm and
//! partially — with the KV cache stored as f32, bf16 and int8 (16-token blocks, so the int8
//! cache quantizes several full blocks and keeps the last one at full precision).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device};
use flint_engine::engine_core::{EventSink, ModelInfo};
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{
    DraftModel, EngineCore, EngineEvent, PagedModelRunner, Request, RequestParams, SamplingParams, SchedulerConfig,
    SpeculativeConfig,
};
use flint_model::kernels::matmul_f32::Bf16Compute;
use flint_model::linear::with_bf16_compute;
use flint_model::source::Checkpoint;
use flint_model::{DecoderModel, DeviceKvCache, KvCacheDtype, KvPool, PagedKvCache};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden/small-f32")
}

struct Setup {
    model_dir: PathBuf,
    tokenizer: Arc<Tokenizer>,
    /// How bf16 weights are packed (`None`: as this machine would).
    bf16: Option<Bf16Compute>,
    /// The device KV pool (on the CPU: its reference ops) instead of the host pool.
    device_pool: bool,
}

impl Setup {
    fn new() -> Self {
        Self {
            model_dir: fixture(),
            tokenizer: Arc::new(Tokenizer::builtin_qwen().unwrap()),
            bf16: None,
            device_pool: false,
        }
    }

    fn core(&self, dtype: KvCacheDtype, budget: usize, num_blocks: usize) -> EngineCore<PagedModelRunner> {
        let ck = Checkpoint::open(self.model_dir.to_str().unwrap()).unwrap();
        let load = || DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).unwrap();
        let model = match self.bf16 {
            Some(c) => with_bf16_compute(c, load),
            None => load(),
        };
        let cache = if self.device_pool {
            KvPool::Device(DeviceKvCache::new(&ck.config, DType::F32, 16, num_blocks, &Device::Cpu).unwrap())
        } else {
            KvPool::Host(PagedKvCache::new(&ck.config, dtype, 16, num_blocks).unwrap())
        };
        let sched = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 64,
            max_model_len: 4096,
            block_size: 16,
            num_blocks,
            enable_prefix_caching: true,
            quantize_full_blocks: dtype == KvCacheDtype::Int8,
        };
        let info =
            ModelInfo { vocab_size: ck.config.vocab_size, valid_vocab: ck.config.vocab_size, eos_token_ids: vec![] };
        let mut core = EngineCore::new(
            PagedModelRunner { model: Arc::new(model), cache, draft: None },
            sched,
            self.tokenizer.clone(),
            info,
        );
        core.check_invariants = true;
        core
    }
}

/// What a request produced: tokens and the bits of every logprob.
type Trace = Vec<(u32, u32, Vec<(u32, u32)>)>;
type Log = Arc<Mutex<Trace>>;

fn sink() -> (Log, EventSink) {
    let log: Log = Arc::default();
    let l = log.clone();
    let sink: EventSink = Box::new(move |ev| {
        match ev {
            EngineEvent::Output(o) => {
                let mut v = l.lock().unwrap();
                for (t, lp) in o.token_ids.iter().zip(&o.logprobs) {
                    v.push((*t, lp.logprob.to_bits(), lp.top.iter().map(|(i, p)| (*i, p.to_bits())).collect()));
                }
            }
            EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => panic!("request failed: {e}"),
        }
        true
    });
    (log, sink)
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (seed.wrapping_mul(7919).wrapping_add(i * 131)) % 500 + 3).collect()
}

const TARGET_LEN: usize = 45;

fn target() -> Request {
    Request {
        id: "target".into(),
        prompt: prompt(1, TARGET_LEN),
        params: RequestParams { max_tokens: 12, ignore_eos: true, logprobs: Some(3), ..Default::default() },
    }
}

fn other(i: usize) -> Request {
    Request {
        id: format!("other{i}"),
        prompt: prompt(100 + i as u32, 1 + (i * 37) % 90),
        params: RequestParams { max_tokens: 4 + i % 9, ignore_eos: true, ..Default::default() },
    }
}

fn drain(core: &mut EngineCore<PagedModelRunner>) {
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        assert!(steps < 20_000, "no progress");
    }
}

/// Add `others` first (so the target is the newest, the one preempted), then the target.
fn run_with(core: &mut EngineCore<PagedModelRunner>, others: usize, first: Option<Request>) -> Trace {
    if let Some(r) = first {
        let (_, s) = sink();
        core.add(r, s).unwrap();
        drain(core);
    }
    for i in 0..others {
        let (_, s) = sink();
        core.add(other(i), s).unwrap();
    }
    let (log, s) = sink();
    core.add(target(), s).unwrap();
    drain(core);
    let t = log.lock().unwrap().clone();
    assert_eq!(t.len(), 12);
    t
}

/// Once every request is over (and one more step has passed the freed blocks on), an int8
/// cache holds no staging: nothing leaks.
fn assert_no_staging(core: &mut EngineCore<PagedModelRunner>) {
    core.step();
    if let KvPool::Host(cache) = &core.runner_mut().cache {
        assert_eq!(cache.staging_blocks(), 0, "staging outlived its blocks");
    }
}

#[test]
fn greedy_output_is_identical_alone_batched_chunked_preempted_and_cached() {
    let setup = Setup::new();
    let mut traces = Vec::new();
    for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16, KvCacheDtype::Int8] {
        let alone = invariant_for(&setup, dtype);
        traces.push(alone);
    }
    // The stored precision shows in the logprobs (it must, or int8/bf16 were never read).
    assert_ne!(traces[0], traces[2], "int8 gave f32's exact bits");
    assert_ne!(traces[0], traces[1], "bf16 gave f32's exact bits");
}

/// The same on bf16 weights computed in bf16 dot products (the full-vocab bf16 golden model):
/// rounding each row's activations to bf16 depends on nothing but the row. The SIMD kernel where
/// the CPU has AVX-512 BF16, else its bit-exact emulation.
#[test]
fn bf16_dot_products_are_batch_invariant() {
    let setup = Setup {
        model_dir: fixture().join("../full-vocab-bf16"),
        tokenizer: Arc::new(Tokenizer::builtin_qwen().unwrap()),
        bf16: Some(Bf16Compute::Dot),
        device_pool: false,
    };
    let simd = flint_model::kernels::matmul_bf16::simd_available();
    eprintln!("bf16 dot products via {}", if simd { "AVX-512 BF16" } else { "the scalar emulation" });
    let dot = invariant_for(&setup, KvCacheDtype::Int8);
    let exact = run_with(
        &mut Setup { bf16: Some(Bf16Compute::WidenF32), ..setup }.core(KvCacheDtype::Int8, 4096, 512),
        0,
        None,
    );
    assert_ne!(dot, exact, "bf16 dot products gave the exact path's bits");
}

/// The same on AMX-BF16 tiles, whose order of sums differs from `vdpbf16ps`'s: every row count
/// runs on the tiles (the hardware with AMX-BF16 and `FLINT_CPU_ISA=amx`, else the emulation),
/// so a row's bits cannot depend on its batch.
#[test]
fn bf16_tile_products_are_batch_invariant() {
    let setup = Setup {
        model_dir: fixture().join("../full-vocab-bf16"),
        tokenizer: Arc::new(Tokenizer::builtin_qwen().unwrap()),
        bf16: Some(Bf16Compute::Tiles),
        device_pool: false,
    };
    let hw = flint_model::kernels::amx_bf16::hardware_available() && flint_model::kernels::Isa::AmxBf16.available();
    eprintln!("bf16 tile products via {}", if hw { "AMX-BF16" } else { "the scalar emulation" });
    let tiles = invariant_for(&setup, KvCacheDtype::Int8);
    let dot =
        run_with(&mut Setup { bf16: Some(Bf16Compute::Dot), ..setup }.core(KvCacheDtype::Int8, 4096, 512), 0, None);
    assert_ne!(tiles, dot, "tile products gave the dot products' bits");
}

/// Every family beside Qwen2 (the golden fixtures of `scripts/golden_families.py`: Qwen3's head
/// norms, Llama 3's scaled RoPE, Mistral's 64-token window, which the longer requests here
/// cross, and the mixtures of experts, whose expert groups change with every batch) keeps the
/// guarantee, with the f32 and the int8 cache.
#[test]
fn every_family_is_batch_invariant() {
    for family in ["qwen3", "llama3", "mistral", "qwen3_moe", "qwen2_moe"] {
        let setup = Setup { model_dir: fixture().join("../../families").join(family), ..Setup::new() };
        eprintln!("{family}");
        let f32 = invariant_for(&setup, KvCacheDtype::F32);
        let int8 = invariant_for(&setup, KvCacheDtype::Int8);
        assert_ne!(f32, int8, "{family}: int8 gave f32's exact bits");
    }
}

/// The device KV pool under the same scheduling (batches, chunked prefill, preemption, prefix
/// hits), through its ops' CPU reference here and the CUDA kernels on a GPU: batch-invariant, and
/// the host pool's greedy tokens with logprobs within f32 summation order.
#[test]
fn the_device_pool_is_batch_invariant_and_agrees_with_the_host_pool() {
    let host = run_with(&mut Setup::new().core(KvCacheDtype::F32, 4096, 512), 0, None);
    let device = invariant_for(&Setup { device_pool: true, ..Setup::new() }, KvCacheDtype::F32);
    assert_eq!(host.len(), device.len());
    for ((ht, hl, htop), (dt, dl, dtop)) in host.iter().zip(&device) {
        assert_eq!(ht, dt, "the device pool changed a greedy token");
        let close = |a: u32, b: u32| (f32::from_bits(a) - f32::from_bits(b)).abs() <= 1e-4;
        assert!(close(*hl, *dl), "logprob {} vs {}", f32::from_bits(*hl), f32::from_bits(*dl));
        assert_eq!(htop.len(), dtop.len());
        assert!(htop.iter().zip(dtop).all(|(a, b)| a.0 == b.0 && close(a.1, b.1)), "top logprobs differ");
    }
}

fn invariant_for(setup: &Setup, dtype: KvCacheDtype) -> Trace {
    let alone = run_with(&mut setup.core(dtype, 4096, 512), 0, None);

    for others in [1, 2, 5, 11, 31] {
        let mut core = setup.core(dtype, 4096, 512);
        let got = run_with(&mut core, others, None);
        assert_eq!(got, alone, "{dtype}: batched with {others} others");
        assert_no_staging(&mut core);
    }
    for budget in [1, 5, 16, 33] {
        let got = run_with(&mut setup.core(dtype, budget, 512), 7, None);
        assert_eq!(got, alone, "{dtype}: prefill chunk budget {budget}");
    }

    // A pool of 12 blocks (192 tokens) cannot hold the target and its 7 elders: preemption.
    let mut core = setup.core(dtype, 64, 12);
    let got = run_with(&mut core, 7, None);
    assert!(core.scheduler().stats.preemptions > 0, "the small pool must force preemption");
    assert_eq!(got, alone, "{dtype}: after preemption and recompute");
    assert_no_staging(&mut core);

    // Prefix cache: cold, then warm (the same prompt again), then partial (a shared stem).
    let mut core = setup.core(dtype, 4096, 512);
    let cold = run_with(&mut core, 0, None);
    assert_eq!(core.scheduler().stats.prefix_hits, 0);
    assert_eq!(cold, alone, "{dtype}: cold cache");
    let warm = run_with(&mut core, 0, None);
    assert_eq!(core.scheduler().stats.prefix_hits, 32, "two full blocks of 45 tokens hit");
    assert_eq!(warm, alone, "{dtype}: warm cache");
    let mut core = setup.core(dtype, 4096, 512);
    let mut stem = target();
    stem.id = "stem".into();
    stem.prompt.truncate(20);
    stem.prompt.extend([7, 8, 9]);
    let partial = run_with(&mut core, 0, Some(stem));
    assert_eq!(core.scheduler().stats.prefix_hits, 16, "one shared block");
    assert_eq!(partial, alone, "{dtype}: partial cache hit");
    alone
}

/// Speculative decoding (n-gram lookup, verification of up to k tokens per step) on the real
/// model: the greedy target's tokens and the bits of its logprobs are those of plain decoding,
/// alone, batched with sampled requests that speculate too, and with prefill chunked small —
/// for every KV dtype (int8: drafts never fill a block, which would quantize rejected tokens).
#[test]
fn speculation_changes_no_greedy_token_or_logprob() {
    let setup = Setup::new();
    let spec_target = || {
        let mut r = target();
        // A prompt that repeats, so lookup proposes from the first step.
        r.prompt = (0..60).map(|i| prompt(1, 12)[i % 12]).collect();
        r.params.max_tokens = 40;
        r
    };
    let sampled = |i: usize| {
        let mut r = other(i);
        r.params.sampling =
            SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(i as u64), ..Default::default() };
        r.params.max_tokens = 24;
        r
    };
    let run = |core: &mut EngineCore<PagedModelRunner>, others: usize| -> Trace {
        for i in 0..others {
            let (_, s) = sink();
            core.add(sampled(i), s).unwrap();
        }
        let (log, s) = sink();
        core.add(spec_target(), s).unwrap();
        drain(core);
        let t = log.lock().unwrap().clone();
        assert_eq!(t.len(), 40);
        t
    };
    let spec = SpeculativeConfig::parse(
        r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#,
    )
    .unwrap();
    for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16, KvCacheDtype::Int8] {
        let plain = run(&mut setup.core(dtype, 4096, 512), 0);
        let (mut drafted, mut accepted) = (0, 0);
        for (others, budget) in [(0, 4096), (5, 4096), (5, 7)] {
            let mut core = setup.core(dtype, budget, 512);
            core.set_speculative(Some(spec.clone()));
            let got = run(&mut core, others);
            assert_eq!(got, plain, "{dtype}: speculation with {others} others, budget {budget}");
            drafted += core.spec_counters.draft_tokens;
            accepted += core.spec_counters.accepted_tokens;
            assert_eq!(core.scheduler().kv().pool().num_held(), 0, "{dtype}: every block returned");
            assert_no_staging(&mut core);
        }
        eprintln!("{dtype}: {accepted} of {drafted} draft tokens accepted");
        assert!(accepted > 0 && accepted < drafted, "{dtype}: both acceptance and rejection ({accepted}/{drafted})");
    }
}

/// A draft model on the real model: the golden checkpoint itself in bf16 compute with a bf16
/// cache proposes (close to the target, not the same), and the target's greedy tokens and
/// logprob bits are those of plain decoding, alone and batched with sampled requests.
#[test]
fn a_draft_model_changes_no_greedy_token_or_logprob() {
    let setup = Setup::new();
    let spec = SpeculativeConfig::parse(r#"{"model": "small-f32 in bf16", "num_speculative_tokens": 4}"#).unwrap();
    let with_draft = |budget: usize| {
        let mut core = setup.core(KvCacheDtype::F32, budget, 512);
        let ck = Checkpoint::open(setup.model_dir.to_str().unwrap()).unwrap();
        let model = DecoderModel::load(&ck.config, &ck.weights, DType::BF16, &Device::Cpu).unwrap();
        let cache = PagedKvCache::new(&ck.config, KvCacheDtype::Bf16, 16, 512).unwrap();
        core.runner_mut().draft = Some(DraftModel { model: Arc::new(model), cache, valid_vocab: ck.config.vocab_size });
        core.set_speculative(Some(spec.clone()));
        core
    };
    let mut long = target();
    long.params.max_tokens = 30;
    let run = |core: &mut EngineCore<PagedModelRunner>, others: usize| -> Trace {
        for i in 0..others {
            let (_, s) = sink();
            let mut r = other(i);
            r.params.sampling = SamplingParams { temperature: 0.8, seed: Some(i as u64), ..Default::default() };
            core.add(r, s).unwrap();
        }
        let (log, s) = sink();
        core.add(long.clone(), s).unwrap();
        drain(core);
        let t = log.lock().unwrap().clone();
        assert_eq!(t.len(), 30);
        t
    };
    let plain = run(&mut setup.core(KvCacheDtype::F32, 4096, 512), 0);
    for (others, budget) in [(0, 4096), (3, 4096), (3, 7)] {
        let mut core = with_draft(budget);
        assert_eq!(run(&mut core, others), plain, "draft model, {others} others, budget {budget}");
        let st = &core.spec_counters;
        eprintln!("draft model, {others} others, budget {budget}: {st:?}");
        assert!(st.accepted_tokens > 0, "{st:?}");
        if others == 0 {
            // The bf16 copy agrees with every greedy token here: a draft cache that missed a
            // position (or read a stale one) would show as rejections.
            assert_eq!(st.accepted_tokens, st.draft_tokens, "{st:?}");
        }
        assert_eq!(core.scheduler().kv().pool().num_held(), 0);
    }
}
