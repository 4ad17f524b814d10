//! What the golden tests share: the transformers reference (fixtures written by
//! `scripts/golden.py`), a paged layout that scatters blocks, and the prefill-then-greedy-steps run
//! that compares logits against it, over whichever KV cache a test gives.

#![allow(dead_code)] // each test binary uses its own share

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use flint_model::{DecoderModel, ForwardBatch, KvCache, LogitsRows};
use safetensors::SafeTensors;

/// `fixtures/golden`; `FLINT_FIXTURES` overrides it for a test binary run away from its build tree
/// (`scripts/device_check.sh` on a GPU machine).
pub fn fixtures() -> PathBuf {
    match std::env::var_os("FLINT_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden"),
    }
}

/// The reference tensors, by name, as f32 or i64 vectors with their shapes.
pub struct Reference {
    pub f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub i64s: HashMap<String, Vec<i64>>,
}

impl Reference {
    pub fn load(path: &Path) -> Self {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (mut f32s, mut i64s) = (HashMap::new(), HashMap::new());
        for (name, view) in st.tensors() {
            match view.dtype() {
                safetensors::Dtype::F32 => {
                    let v = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                    f32s.insert(name, (view.shape().to_vec(), v));
                }
                safetensors::Dtype::I64 => {
                    let v = view.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
                    i64s.insert(name, v);
                }
                other => panic!("unexpected dtype {other:?} for {name}"),
            }
        }
        Self { f32s, i64s }
    }
    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.i64s[name].iter().map(|&x| x as u32).collect()
    }
    pub fn rows(&self, name: &str) -> Option<Vec<Vec<f32>>> {
        let (shape, v) = self.f32s.get(name)?;
        Some(v.chunks(shape[1]).map(<[f32]>::to_vec).collect())
    }
    pub fn num_prompts(&self) -> usize {
        (0..).take_while(|k| self.i64s.contains_key(&format!("prompt.{k}"))).count()
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

pub fn to_rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

/// Largest |Δlogit| seen over prefill rows and cached steps, and whether every greedy token matched.
#[derive(Debug, Default)]
pub struct Outcome {
    pub prefill_max: f32,
    pub step_max: f32,
    pub greedy_mismatches: usize,
    pub greedy_total: usize,
}

/// A paged pool of 211 blocks of 16 tokens; tables walk it with stride 7 (a permutation, as 211
/// is prime), so consecutive positions live in scattered, non-adjacent blocks. Sequence `seq`
/// uses permutation entries `30·seq ..`, disjoint from the others' for up to 480 tokens.
pub const POOL_BLOCKS: usize = 211;

pub fn scattered_table(seq: usize, len: usize) -> Vec<u32> {
    assert!(len <= 480 && 30 * seq + 30 <= POOL_BLOCKS);
    (0..len.div_ceil(16)).map(|i| (((30 * seq + i) * 7 + 3) % POOL_BLOCKS) as u32).collect()
}

/// `batch.push`, into a paged table when `paged`.
pub fn push(b: &mut ForwardBatch, paged: bool, slot: usize, ctx: usize, toks: &[u32], rows: LogitsRows, total: usize) {
    if paged {
        b.push_paged(slot, ctx, toks, rows, scattered_table(slot, total));
    } else {
        b.push(slot, ctx, toks, rows);
    }
}

/// Prefill each prompt in one pass (all rows), then feed the reference greedy tokens one at a time
/// through a fresh `new_cache()`, comparing logits and argmax at every step.
///
/// A greedy token is only required to match where the reference's top-1/top-2 margin exceeds
/// `decisive` (quantized or 16-bit compute: a near-tie may legitimately flip).
pub fn run_with_cache(
    model: &DecoderModel,
    reference: &Reference,
    decisive: f32,
    paged: bool,
    new_cache: &dyn Fn() -> Box<dyn KvCache>,
) -> Outcome {
    let mut out = Outcome::default();
    for k in 0..reference.num_prompts() {
        let prompt = reference.ids(&format!("prompt.{k}"));
        let greedy = reference.ids(&format!("greedy.{k}"));
        let margins = reference.f32s.get(&format!("greedy_margin.{k}")).map(|(_, m)| m.clone());
        let decides = |j: usize| margins.as_ref().is_none_or(|m| m[j] > decisive);
        let mut cache = new_cache();
        let total = prompt.len() + greedy.len();
        let mut batch = ForwardBatch::new();
        push(&mut batch, paged, 0, 0, &prompt, LogitsRows::All, total);
        let logits = to_rows(&model.forward(&batch, cache.as_mut()).unwrap().unwrap());
        // The engine's entry point (logits as a flat vector) gives exactly the same numbers.
        let flat = model.forward_logits(&batch, new_cache().as_mut()).unwrap().unwrap();
        assert_eq!(flat, logits.concat(), "forward_logits differs from forward");
        let want_rows = reference.rows(&format!("prefill_logits.{k}")).unwrap();
        let positions = &reference.i64s[&format!("prefill_rows.{k}")];
        for (row, &pos) in want_rows.iter().zip(positions) {
            out.prefill_max = out.prefill_max.max(max_abs_diff(&logits[pos as usize], row));
        }
        out.greedy_total += 1;
        if decides(0) && argmax(logits.last().unwrap()) != greedy[0] {
            out.greedy_mismatches += 1;
        }
        let steps = reference.rows(&format!("step_logits.{k}"));
        for (s, &tok) in greedy.iter().enumerate() {
            let mut b = ForwardBatch::new();
            push(&mut b, paged, 0, prompt.len() + s, &[tok], LogitsRows::Last, total);
            let row = to_rows(&model.forward(&b, cache.as_mut()).unwrap().unwrap()).remove(0);
            if let Some(steps) = &steps {
                out.step_max = out.step_max.max(max_abs_diff(&row, &steps[s]));
            }
            if let Some(&next) = greedy.get(s + 1) {
                out.greedy_total += 1;
                if decides(s + 1) && argmax(&row) != next {
                    out.greedy_mismatches += 1;
                }
            }
        }
    }
    out
}

pub fn assert_within(name: &str, o: &Outcome, tol: f32) {
    eprintln!("{name}: {o:?} (tolerance {tol})");
    assert!(o.prefill_max <= tol, "{name}: prefill max |Δlogit| {} > {tol}", o.prefill_max);
    assert!(o.step_max <= tol, "{name}: cached-step max |Δlogit| {} > {tol}", o.step_max);
    assert_eq!(o.greedy_mismatches, 0, "{name}: greedy tokens differ from transformers");
}
