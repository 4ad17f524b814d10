//! The sparse feed-forward of a mixture of experts (Qwen3-MoE, Qwen2-MoE), as transformers
//! computes it: the router (`gate`) scores every expert, each token goes to the top
//! `num_experts_per_tok` by softmax probability (renormalised when `norm_topk_prob`), and its
//! output is the weighted sum of those experts' SwiGLU MLPs, plus Qwen2-MoE's shared expert
//! gated by a sigmoid.
//!
//! A pass groups its rows by expert and runs each chosen expert once over all of its rows, so a
//! prefill chunk or a decode batch reads each chosen expert's weights once, and an expert no row
//! chose is not read at all. Batch invariance holds as for the dense MLP: routing is per row
//! (ties to the lower expert index), the expert kernels are row-independent, and each row's
//! expert outputs are added in expert-index order (transformers' order) whatever else is in the
//! batch.

use std::mem::MaybeUninit;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use tracing::trace_span;

use super::{Loader, Mlp, Ops};
use crate::config::{ModelConfig, MoeConfig};
use crate::error::Result;
use crate::kernels::matmul_q8::{self, ExpertJob, PackedQ8};
use crate::kernels::pool;
use crate::kernels::rowwise::with_f32;
use crate::linear::{pack_q8_rows, Linear};

pub(super) struct SparseMoe {
    gate: Linear,
    experts: Experts,
    shared_expert: Option<Mlp>,
    shared_expert_gate: Option<Linear>,
    num_experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    pub(super) fn load(ld: &Loader, p: &str, cfg: &ModelConfig, moe: &MoeConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let gate = ld.linear(&format!("{p}.gate"), moe.num_experts, h, false)?;
        let experts = Experts::load(ld, p, moe.num_experts, h, moe.moe_intermediate_size)?;
        let shared_expert = moe
            .shared_expert_intermediate_size
            .map(|i| Mlp::load(ld, &format!("{p}.shared_expert"), h, i))
            .transpose()?;
        let shared_expert_gate = match shared_expert {
            Some(_) => Some(ld.linear(&format!("{p}.shared_expert_gate"), 1, h, false)?),
            None => None,
        };
        Ok(Self {
            gate,
            experts,
            shared_expert,
            shared_expert_gate,
            num_experts: moe.num_experts,
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }

    pub(super) fn projections(&self) -> impl Iterator<Item = &Linear> {
        let shared = self.shared_expert.iter().flat_map(Mlp::projections);
        [&self.gate].into_iter().chain(&self.shared_expert_gate).chain(self.experts.projections()).chain(shared)
    }

    #[cfg(test)]
    pub(super) fn is_merged(&self) -> bool {
        matches!(self.experts, Experts::Merged { .. })
    }

    pub(super) fn forward(&self, x: &Tensor, ops: &Ops) -> Result<Tensor> {
        let _scope = trace_span!("moe").entered();
        let (n, h) = x.dims2()?;
        let logits = trace_span!("router").in_scope(|| self.gate.forward(x))?;
        let logits = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let e = self.num_experts;
        // Each expert's rows, and the weight each of those rows gives it.
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); e];
        let mut weights: Vec<Vec<f32>> = vec![Vec::new(); e];
        for (r, row) in logits.chunks_exact(e).enumerate() {
            for (expert, w) in route(row, self.top_k, self.norm_topk_prob) {
                rows[expert].push(r as u32);
                weights[expert].push(w);
            }
        }
        let mut out = match &self.experts {
            Experts::Merged { gate, up, down } => {
                let y = trace_span!("experts").in_scope(|| merged_forward(x, &rows, &weights, [gate, up, down]))?;
                Tensor::from_vec(y, (n, h), x.device())?.to_dtype(x.dtype())?
            }
            Experts::Separate(experts) => separate_forward(x, experts, rows, weights, ops)?,
        };
        if let (Some(shared), Some(gate)) = (&self.shared_expert, &self.shared_expert_gate) {
            let g = gate.forward(x)?;
            // sigmoid(g) = 1 / (1 + e^-g)
            let g = (g.neg()?.exp()? + 1.0)?.recip()?;
            out = (out + shared.forward(x, ops)?.broadcast_mul(&g)?)?;
        }
        Ok(out)
    }
}

/// A mixture's experts as flint holds them.
enum Experts {
    /// A GGUF's merged experts packed whole for the int8 kernel, one buffer per projection
    /// (`[experts · out, in]`, in huge pages when large) run by the grouped kernels
    /// ([`matmul_q8::grouped_gated_uninit`]): one parallel region per projection for all the
    /// chosen experts.
    Merged { gate: Arc<PackedQ8>, up: Arc<PackedQ8>, down: Arc<PackedQ8> },
    /// One MLP per expert: safetensors, dense types, GPUs.
    Separate(Vec<Mlp>),
}

impl Experts {
    /// The `n` experts of the mixture at `p`, each a SwiGLU MLP of intermediate size `i`: merged
    /// when the file holds them merged in a type the int8 kernel reads (on the CPU, whole
    /// panels per expert), else one MLP per expert (see
    /// [`crate::weights::WeightSource::get_experts`]).
    fn load(ld: &Loader, p: &str, n: usize, h: usize, i: usize) -> Result<Self> {
        if ld.device.is_cpu() && i.is_multiple_of(16) && h.is_multiple_of(16) && !separate_only() {
            let merged = |proj: &str, out: usize, inp: usize| -> Result<Option<PackedQ8>> {
                match ld.weights.get_merged_experts(p, proj, n, &[out, inp])? {
                    Some(q) => pack_q8_rows(&q, n * out, inp),
                    None => Ok(None),
                }
            };
            if let Some(gate) = merged("gate_proj", i, h)? {
                if let (Some(up), Some(down)) = (merged("up_proj", i, h)?, merged("down_proj", h, i)?) {
                    return Ok(Experts::Merged { gate: Arc::new(gate), up: Arc::new(up), down: Arc::new(down) });
                }
            }
        }
        let get = |proj: &str, shape: [usize; 2]| ld.weights.get_experts(p, proj, n, &shape, ld.dtype, ld.device);
        let (gate, up, down) = (get("gate_proj", [i, h])?, get("up_proj", [i, h])?, get("down_proj", [h, i])?);
        let mlps = gate
            .into_iter()
            .zip(up)
            .zip(down)
            .map(|((g, u), d)| {
                Ok(Mlp {
                    gate_proj: Linear::new(g, None)?,
                    up_proj: Linear::new(u, None)?,
                    down_proj: Linear::new(d, None)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Experts::Separate(mlps))
    }

    /// The separate experts' projections (the merged ones are int8 kernels: row-independent).
    fn projections(&self) -> Vec<&Linear> {
        match self {
            Experts::Merged { .. } => Vec::new(),
            Experts::Separate(experts) => experts.iter().flat_map(Mlp::projections).collect(),
        }
    }
}

/// The merged experts over their routed rows, `[n · h]`: every chosen expert's gate/up in one
/// grouped call, its down projection in another, then each row's outputs weighted and added in
/// expert order (the same operations, in the same order, as [`separate_forward`]).
fn merged_forward(
    x: &Tensor,
    rows: &[Vec<u32>],
    weights: &[Vec<f32>],
    [gate, up, down]: [&PackedQ8; 3],
) -> Result<Vec<f32>> {
    let (n, h) = x.dims2()?;
    let i = gate.out_features() / rows.len().max(1);
    let chosen: Vec<usize> = (0..rows.len()).filter(|&e| !rows[e].is_empty()).collect();
    let routed: Vec<usize> = chosen.iter().map(|&e| rows[e].len()).collect();
    let x = x.to_dtype(DType::F32)?;
    let gated_jobs: Vec<ExpertJob> =
        chosen.iter().map(|&e| ExpertJob { rows: &rows[e], col0: e * i, cols: i }).collect();
    let gated = trace_span!("gate_up").in_scope(|| {
        with_f32(&x, |xs| {
            expert_outputs(&routed, i, |ys| matmul_q8::grouped_gated_uninit(xs, n, gate, up, &gated_jobs, ys))
        })
    })?;
    let down_jobs: Vec<ExpertJob> =
        chosen.iter().map(|&e| ExpertJob { rows: &rows[e], col0: e * h, cols: h }).collect();
    let ys = trace_span!("down").in_scope(|| {
        let inputs: Vec<&[f32]> = split_lens(&gated, &routed, i);
        expert_outputs(&routed, h, |ys| matmul_q8::grouped_uninit(&inputs, down, &down_jobs, ys))
    });
    let _sum = trace_span!("weighted_sum").entered();
    let outputs = split_lens(&ys, &routed, h);
    let mut sum = vec![0f32; n * h];
    // Rows `r0..` of the sum, each given its experts in expert order.
    let add = |r0: usize, part: &mut [f32]| {
        for (&e, y) in chosen.iter().zip(&outputs) {
            add_weighted(part, r0, h, &rows[e], &weights[e], y);
        }
    };
    if n >= PARALLEL_SUM_ROWS && h > 0 {
        let per = n.div_ceil(pool::threads());
        pool::run_chunks(&mut sum, per * h, |i, part| add(i * per, part));
    } else {
        add(0, &mut sum);
    }
    Ok(sum)
}

/// Passes of at least this many rows add up their expert outputs on the kernel pool, the rows
/// split between the threads (each row's additions stay in expert order, so the bits are the
/// same). A 16-sequence decode step of qwen3-30b-a3b adds 128 outputs of 2048 values a layer:
/// on the AMX Xeon's two threads 3.8–4.0 ms a step against 5.1–5.6 ms by one thread while the
/// other waited.
const PARALLEL_SUM_ROWS: usize = 4;

/// The chosen experts' outputs, one after another in one buffer (`routed[j]` rows of `width`
/// for expert `j`), written by `kernel` into its unfilled parts. Not zero-filled first: a
/// 16-sequence decode step would clear over a megabyte per layer that the kernel overwrites.
fn expert_outputs(routed: &[usize], width: usize, kernel: impl FnOnce(&mut [&mut [MaybeUninit<f32>]])) -> Vec<f32> {
    let total = routed.iter().sum::<usize>() * width;
    let mut buf: Vec<f32> = Vec::with_capacity(total);
    let mut rest = &mut buf.spare_capacity_mut()[..total];
    let mut parts = Vec::with_capacity(routed.len());
    for &m in routed {
        let (part, tail) = rest.split_at_mut(m * width);
        parts.push(part);
        rest = tail;
    }
    kernel(&mut parts);
    // SAFETY: the grouped kernels write every value of every output they are given (each
    // job's panel stripes cover all its columns for all its rows), and the parts cover the
    // first `total` values.
    unsafe { buf.set_len(total) };
    buf
}

/// `buf` cut into consecutive pieces of `routed[j] · width` values.
fn split_lens<'a>(buf: &'a [f32], routed: &[usize], width: usize) -> Vec<&'a [f32]> {
    let mut rest = buf;
    routed
        .iter()
        .map(|&m| {
            let (part, tail) = rest.split_at(m * width);
            rest = tail;
            part
        })
        .collect()
}

/// Each expert on its own rows (gathered), its outputs weighted and added in expert order.
fn separate_forward(
    x: &Tensor,
    experts: &[Mlp],
    rows: Vec<Vec<u32>>,
    weights: Vec<Vec<f32>>,
    ops: &Ops,
) -> Result<Tensor> {
    let (n, h) = x.dims2()?;
    // On the CPU in f32 the weighted outputs are added into one buffer in place; elsewhere
    // through `index_add`, which copies the whole output once per expert. Both add
    // `y · w` (rounded) to a row in expert order: the same bits.
    let in_place = x.device().is_cpu() && x.dtype() == DType::F32;
    let mut sum = if in_place { vec![0f32; n * h] } else { Vec::new() };
    let mut out = Tensor::zeros((n, h), x.dtype(), x.device())?;
    for (expert, (rows, weights)) in experts.iter().zip(rows.into_iter().zip(weights)) {
        if rows.is_empty() {
            continue;
        }
        let m = rows.len();
        let idx = Tensor::from_slice(&rows, m, x.device())?;
        let y = expert.forward(&x.index_select(&idx, 0)?, ops)?;
        if in_place {
            add_weighted(&mut sum, 0, h, &rows, &weights, &y.flatten_all()?.to_vec1::<f32>()?);
        } else {
            let w = Tensor::from_vec(weights, (m, 1), x.device())?.to_dtype(y.dtype())?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
    }
    if in_place {
        out = Tensor::from_vec(sum, (n, h), x.device())?;
    }
    Ok(out)
}

/// `sum[r − r0] += y_j · w_j` for each of an expert's rows `r = rows[j]` that `sum` holds (rows
/// `r0..`, `h` wide).
fn add_weighted(sum: &mut [f32], r0: usize, h: usize, rows: &[u32], weights: &[f32], y: &[f32]) {
    let held = r0..r0 + sum.len() / h.max(1);
    for ((&r, &w), y) in rows.iter().zip(weights).zip(y.chunks_exact(h)) {
        let r = r as usize;
        if !held.contains(&r) {
            continue;
        }
        let dst = &mut sum[(r - r0) * h..][..h];
        for (d, &v) in dst.iter_mut().zip(y) {
            *d += v * w;
        }
    }
}

/// One row's experts and their weights: the `k` highest softmax probabilities of the router's
/// `logits` (ties to the lower index), divided by their sum when `normalize`, in expert order.
pub(crate) fn route(logits: &[f32], k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // A NaN logit (a broken checkpoint) sorts last.
    let key = |i: usize| if exp[i].is_nan() { f32::NEG_INFINITY } else { exp[i] };
    // A total order (probability down, then index up), so selecting the first k gives the same
    // experts as sorting all of them would, without sorting the other `n − k`.
    let by_rank = |&a: &usize, &b: &usize| key(b).total_cmp(&key(a)).then(a.cmp(&b));
    let k = k.min(order.len());
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_rank);
    }
    order.truncate(k);
    let mut chosen: Vec<(usize, f32)> = order.into_iter().map(|i| (i, exp[i] / sum)).collect();
    if normalize {
        let total: f32 = chosen.iter().map(|c| c.1).sum();
        chosen.iter_mut().for_each(|c| c.1 /= total);
    }
    chosen.sort_by_key(|c| c.0);
    chosen
}

#[cfg(test)]
thread_local! {
    static SEPARATE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` (a model load on this thread) with every mixture's experts held apart, as
/// safetensors load them: the reference the merged experts are compared with.
#[cfg(test)]
pub(crate) fn with_separate_experts<R>(f: impl FnOnce() -> R) -> R {
    SEPARATE.with(|c| c.set(true));
    let r = f();
    SEPARATE.with(|c| c.set(false));
    r
}

/// Whether a test asked for separate experts (`with_separate_experts`).
#[cfg(test)]
fn separate_only() -> bool {
    SEPARATE.with(|c| c.get())
}

/// Outside tests the merged experts are always taken where they load.
#[cfg(not(test))]
fn separate_only() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::{add_weighted, route};

    #[test]
    fn weighted_sums_split_by_rows_give_the_whole_sums_bits() {
        // Three experts over five rows of width 3, added whole and in parts of every size.
        let (n, h) = (5, 3);
        let rows: [Vec<u32>; 3] = [vec![0, 2, 4], vec![1, 2], vec![0, 3, 4]];
        let weights: [Vec<f32>; 3] = [vec![0.3, 0.7, 0.1], vec![0.9, 0.2], vec![0.6, 0.4, 0.8]];
        let ys: Vec<Vec<f32>> =
            (0..3).map(|e| (0..rows[e].len() * h).map(|i| (i as f32 * 0.37 + e as f32).sin()).collect()).collect();
        let mut whole = vec![0f32; n * h];
        for e in 0..3 {
            add_weighted(&mut whole, 0, h, &rows[e], &weights[e], &ys[e]);
        }
        // Row 0 is expert 0's first row, then expert 2's first, in that order.
        assert_eq!(whole[1], (0.0 + ys[0][1] * 0.3) + ys[2][1] * 0.6);
        assert!(whole.iter().all(|&v| v != 0.0), "every row has an expert");
        for per in 1..=n {
            let mut split = vec![0f32; n * h];
            for (i, part) in split.chunks_mut(per * h).enumerate() {
                for e in 0..3 {
                    add_weighted(part, i * per, h, &rows[e], &weights[e], &ys[e]);
                }
            }
            assert_eq!(whole, split, "rows {per} at a time");
        }
    }

    #[test]
    fn routing_takes_the_top_k_by_probability_with_ties_to_the_lower_index() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
        let r = route(&logits, 2, false);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1, 3]);
        let z: f32 = logits.iter().map(|l| (l - 2.0).exp()).sum();
        assert!((r[0].1 - 1.0 / z).abs() < 1e-7 && r[0].1 == r[1].1);
        let r = route(&logits, 3, true);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1, 3, 4]);
        assert!((r.iter().map(|c| c.1).sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r[2].1 < r[0].1);
        // All equal: the first k.
        assert_eq!(route(&[0.0; 6], 4, true).iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        // NaN never wins over a number.
        assert_eq!(route(&[f32::NAN, 1.0, 0.0], 1, true)[0].0, 1);
    }
}
