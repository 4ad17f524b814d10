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

use candle_core::{DType, Tensor};
use tracing::trace_span;

use super::{Loader, Mlp, Ops};
use crate::config::{ModelConfig, MoeConfig};
use crate::error::Result;
use crate::linear::Linear;

pub(super) struct SparseMoe {
    gate: Linear,
    experts: Vec<Mlp>,
    shared_expert: Option<Mlp>,
    shared_expert_gate: Option<Linear>,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    pub(super) fn load(ld: &Loader, p: &str, cfg: &ModelConfig, moe: &MoeConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let gate = ld.linear(&format!("{p}.gate"), moe.num_experts, h, false)?;
        let experts = (0..moe.num_experts)
            .map(|e| Mlp::load(ld, &format!("{p}.experts.{e}"), h, moe.moe_intermediate_size))
            .collect::<Result<Vec<_>>>()?;
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
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }

    pub(super) fn projections(&self) -> impl Iterator<Item = &Linear> {
        let experts = self.experts.iter().chain(&self.shared_expert).flat_map(Mlp::projections);
        [&self.gate].into_iter().chain(&self.shared_expert_gate).chain(experts)
    }

    pub(super) fn forward(&self, x: &Tensor, ops: &Ops) -> Result<Tensor> {
        let _scope = trace_span!("moe").entered();
        let (n, h) = x.dims2()?;
        let logits = trace_span!("router").in_scope(|| self.gate.forward(x))?;
        let logits = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let e = self.experts.len();
        // Each expert's rows, and the weight each of those rows gives it.
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); e];
        let mut weights: Vec<Vec<f32>> = vec![Vec::new(); e];
        for (r, row) in logits.chunks_exact(e).enumerate() {
            for (expert, w) in route(row, self.top_k, self.norm_topk_prob) {
                rows[expert].push(r as u32);
                weights[expert].push(w);
            }
        }
        // On the CPU in f32 the weighted outputs are added into one buffer in place; elsewhere
        // through `index_add`, which copies the whole output once per expert. Both add
        // `y · w` (rounded) to a row in expert order: the same bits.
        let in_place = x.device().is_cpu() && x.dtype() == DType::F32;
        let mut sum = if in_place { vec![0f32; n * h] } else { Vec::new() };
        let mut out = Tensor::zeros((n, h), x.dtype(), x.device())?;
        for (expert, (rows, weights)) in self.experts.iter().zip(rows.into_iter().zip(weights)) {
            if rows.is_empty() {
                continue;
            }
            let m = rows.len();
            let idx = Tensor::from_slice(&rows, m, x.device())?;
            let y = expert.forward(&x.index_select(&idx, 0)?, ops)?;
            if in_place {
                let y = y.flatten_all()?.to_vec1::<f32>()?;
                for ((&r, &w), y) in rows.iter().zip(&weights).zip(y.chunks_exact(h)) {
                    let dst = &mut sum[r as usize * h..][..h];
                    for (d, &v) in dst.iter_mut().zip(y) {
                        *d += v * w;
                    }
                }
            } else {
                let w = Tensor::from_vec(weights, (m, 1), x.device())?.to_dtype(y.dtype())?;
                out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
            }
        }
        if in_place {
            out = Tensor::from_vec(sum, (n, h), x.device())?;
        }
        if let (Some(shared), Some(gate)) = (&self.shared_expert, &self.shared_expert_gate) {
            let g = gate.forward(x)?;
            // sigmoid(g) = 1 / (1 + e^-g)
            let g = (g.neg()?.exp()? + 1.0)?.recip()?;
            out = (out + shared.forward(x, ops)?.broadcast_mul(&g)?)?;
        }
        Ok(out)
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
    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    order.truncate(k.min(order.len()));
    let mut chosen: Vec<(usize, f32)> = order.into_iter().map(|i| (i, exp[i] / sum)).collect();
    if normalize {
        let total: f32 = chosen.iter().map(|c| c.1).sum();
        chosen.iter_mut().for_each(|c| c.1 /= total);
    }
    chosen.sort_by_key(|c| c.0);
    chosen
}

#[cfg(test)]
mod tests {
    use super::route;

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
