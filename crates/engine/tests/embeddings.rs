//! Embeddings against transformers: each family's tiny checkpoint (fixtures/families/, written
//! by scripts/golden_embeddings.py), pooled by last token, mean and first token and normalised,
//! within 1e-5 of `AutoModel`'s `last_hidden_state` pooled the same way in f32; and the same bits
//! whether the request runs alone, in prefill chunks of 16, or batched with generation requests
//! in a pool small enough to preempt.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use flint_engine::engine_core::{EventSink, ModelInfo};
use flint_engine::pooling::{PoolerConfig, PoolingParams, PoolingType};
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{EngineCore, EngineEvent, PagedModelRunner, Request, RequestParams, SchedulerConfig};
use flint_model::kernels::matmul_f32::Bf16Compute;
use flint_model::linear::with_bf16_compute;
use flint_model::source::Checkpoint;
use flint_model::{DecoderModel, KvCacheDtype, KvPool, PagedKvCache};

fn family_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/families").join(family)
}

fn core(dir: &Path, budget: usize, num_blocks: usize) -> EngineCore<PagedModelRunner> {
    let ck = Checkpoint::open(dir.to_str().unwrap()).unwrap();
    // The fixtures' weights are bf16: pin the exact f32 products (as the golden tests do), since
    // a CPU with AVX-512 BF16 would otherwise compute them in bf16 dot products, outside the
    // 1e-5 the transformers comparison allows.
    let model = with_bf16_compute(Bf16Compute::WidenF32, || {
        DecoderModel::load(&ck.config, &ck.weights, DType::F32, &Device::Cpu).unwrap()
    });
    let cache = KvPool::Host(PagedKvCache::new(&ck.config, KvCacheDtype::F32, 16, num_blocks).unwrap());
    let sched = SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: 64,
        max_model_len: 4096,
        block_size: 16,
        num_blocks,
        enable_prefix_caching: true,
        quantize_full_blocks: false,
    };
    let info = ModelInfo { vocab_size: ck.config.vocab_size, valid_vocab: ck.config.vocab_size, eos_token_ids: vec![] };
    let runner = PagedModelRunner { model: Arc::new(model), cache, draft: None };
    let mut core = EngineCore::new(runner, sched, Arc::new(Tokenizer::builtin_qwen().unwrap()), info);
    core.check_invariants = true;
    core
}

fn embed_request(id: &str, prompt: Vec<u32>, t: PoolingType, dimensions: Option<usize>) -> Request {
    let pooling = PoolingParams { config: PoolerConfig { pooling_type: t, normalize: true }, dimensions };
    Request {
        id: id.into(),
        prompt,
        params: RequestParams { max_tokens: 0, pooling: Some(pooling), ..Default::default() },
    }
}

fn generation(i: usize) -> Request {
    let prompt = (0..(5 + i * 23 % 70) as u32).map(|j| (j * 31 + i as u32 * 7) % 200 + 3).collect();
    Request {
        id: format!("gen{i}"),
        prompt,
        params: RequestParams { max_tokens: 6, ignore_eos: true, ..Default::default() },
    }
}

type Out = Arc<Mutex<Option<Vec<f32>>>>;

fn sink() -> (Out, EventSink) {
    let out: Out = Arc::default();
    let o = out.clone();
    let sink: EventSink = Box::new(move |ev| {
        match ev {
            EngineEvent::Output(s) => {
                if let Some(v) = s.embedding {
                    *o.lock().unwrap() = Some(v);
                }
            }
            EngineEvent::Error(e) | EngineEvent::Rejected(e) | EngineEvent::Stopped(e) => panic!("request failed: {e}"),
        }
        true
    });
    (out, sink)
}

/// Run `reqs` together to the end; the embeddings of those that are embedding requests.
fn run(core: &mut EngineCore<PagedModelRunner>, reqs: Vec<Request>) -> Vec<Vec<f32>> {
    let mut outs = Vec::new();
    for r in reqs {
        let embedding = r.params.pooling.is_some();
        let (o, s) = sink();
        core.add(r, s).unwrap();
        if embedding {
            outs.push(o);
        }
    }
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        assert!(steps < 20_000, "no progress");
    }
    outs.iter().map(|o| o.lock().unwrap().clone().expect("an embedding")).collect()
}

fn reference(family: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(family_dir(family).join("embeddings.safetensors"), &Device::Cpu).unwrap()
}

fn vec_of(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

fn prompts(r: &HashMap<String, Tensor>) -> Vec<(usize, Vec<u32>)> {
    let mut ids: Vec<usize> = r.keys().filter_map(|k| k.strip_prefix("prompt.").and_then(|n| n.parse().ok())).collect();
    ids.sort_unstable();
    ids.into_iter()
        .map(|n| {
            let t = r[&format!("prompt.{n}")].to_dtype(DType::I64).unwrap();
            (n, t.flatten_all().unwrap().to_vec1::<i64>().unwrap().into_iter().map(|x| x as u32).collect())
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

const TYPES: [(PoolingType, &str); 3] =
    [(PoolingType::Last, "last"), (PoolingType::Mean, "mean"), (PoolingType::Cls, "cls")];

#[test]
fn embeddings_match_transformers_for_every_family_and_pooling() {
    for family in ["qwen3", "llama3", "mistral"] {
        let r = reference(family);
        let ps = prompts(&r);
        assert!(ps.len() >= 2, "{family}: the fixture has prompts");
        let dir = family_dir(family);
        let mut alone = core(&dir, 4096, 512);
        for (t, name) in TYPES {
            for (n, p) in &ps {
                let got = run(&mut alone, vec![embed_request("e", p.clone(), t, None)]).remove(0);
                let want = vec_of(&r[&format!("{name}.{n}")]);
                let d = max_diff(&got, &want);
                assert!(d <= 1e-5, "{family} {name} prompt {n}: max |diff| {d}");
                let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
                assert!((norm - 1.0).abs() < 1e-5, "{family} {name}: norm {norm}");
            }
        }
    }
}

#[test]
fn embeddings_are_the_same_bits_alone_chunked_and_batched_with_generation() {
    let family = "qwen3";
    let r = reference(family);
    let ps = prompts(&r);
    let dir = family_dir(family);
    for (t, name) in TYPES {
        let (n, p) = ps.last().unwrap().clone();
        let alone = run(&mut core(&dir, 4096, 512), vec![embed_request("e", p.clone(), t, None)]).remove(0);
        // Chunks of 16 tokens, then a busy batch in a pool of 24 blocks (preemption), with the
        // prompt's prefix already cached by an earlier request.
        let chunked = run(&mut core(&dir, 16, 512), vec![embed_request("e", p.clone(), t, None)]).remove(0);
        assert_eq!(chunked, alone, "{name} prompt {n}: chunked prefill changed the vector");
        let mut busy = core(&dir, 64, 24);
        run(
            &mut busy,
            vec![Request { params: RequestParams { max_tokens: 2, ..Default::default() }, ..generation(0) }],
        );
        let mut reqs: Vec<Request> = (1..9).map(generation).collect();
        reqs.insert(3, embed_request("e", p.clone(), t, None));
        reqs.push(embed_request("e2", p.clone(), t, None));
        let batched = run(&mut busy, reqs);
        assert_eq!(batched[0], alone, "{name}: batched with generation changed the vector");
        assert_eq!(batched[1], alone, "{name}: a second copy (its prefix cached) changed the vector");
    }
}

#[test]
fn dimensions_truncate_then_renormalise() {
    let r = reference("qwen3");
    let (_, p) = prompts(&r).remove(0);
    let dir = family_dir("qwen3");
    let mut c = core(&dir, 4096, 512);
    let full = run(&mut c, vec![embed_request("e", p.clone(), PoolingType::Mean, None)]).remove(0);
    let cut = run(&mut c, vec![embed_request("e", p, PoolingType::Mean, Some(8))]).remove(0);
    assert_eq!(cut.len(), 8);
    let norm: f32 = full[..8].iter().map(|x| x * x).sum::<f32>().sqrt();
    let want: Vec<f32> = full[..8].iter().map(|x| x / norm).collect();
    assert!(max_diff(&cut, &want) < 1e-6, "{cut:?} vs {want:?}");
}
