//! The int8 cache's arithmetic in integers (the codes laid out by [`kv_quant`]'s
//! [`key_code_at`] and [`value_code_at`]): the reference every path follows, and the scalar path.
//!
//! **Scores.** A key is `min_c + scale_c · code`, so a score is `Σ q_c·scale_c·code + Σ q_c·min_c`.
//! Per (row, block) the query side `q_c·scale_c` is quantized to i8 (symmetric, step = max/127),
//! and the score is `(Σ q8_c·code) · step + bias`: the sum is exact in i32 (and in f32: |Σ| <
//! 2^24 for heads up to 256), so it is one `vpdpbusd` per four channels of 16 keys on CPUs with
//! AVX-512 VNNI, and every path — whatever order it adds in — gets the same integer.
//!
//! **Values.** A value is `scale_t · code`, so the weighted sum is `Σ (p_t·scale_t)·code`. Per
//! (row, block) the weights `p_t·scale_t` are quantized to i16 (step = max/32767, 15 bits: a weight
//! at 1/1000 of the block's largest still has 5 significant bits), and `o += (Σ w16_t·code) ·
//! step`: exact in i32 (|Σ| < 2^31 for blocks up to 512 tokens), one `vpdpwssd` per two tokens of
//! 16 outputs.
//!
//! Both quantizations are functions of the row's own query and the stored block alone, so batch
//! invariance holds; NaN anywhere in a row's query, a key channel's statistics or a weight gives
//! NaN, as the f32 arithmetic would.

use crate::kernels::kv_quant::{key_code_at, scale, value_code_at};

use super::portable::tree_sum;
use super::KEY_TILE;

/// Largest query code.
pub(super) const Q_LEVELS: f32 = 127.0;
/// Largest weight code.
pub(super) const W_LEVELS: f32 = 32767.0;

/// The query side of one row against one int8 block (this head's statistics): writes `q8` and
/// returns `(step, bias)`, a score being `(Σ q8·code) as f32 · step + bias`.
pub(super) fn quantize_query(q: &[f32], k_min: &[u16], k_scale: &[u8], q8: &mut [i8]) -> (f32, f32) {
    let d = q.len();
    // Σ q·min as 16 lane-wise fused chains (channel c in lane c mod 16), then the tree sum.
    let mut acc = [0f32; KEY_TILE];
    let (mut amax, mut finite) = (0f32, true);
    for c in 0..d {
        let m = half::f16::from_bits(k_min[c]).to_f32();
        acc[c % KEY_TILE] = q[c].mul_add(m, acc[c % KEY_TILE]);
        let x = q[c] * scale(k_scale[c]);
        finite &= x.is_finite();
        amax = amax.max(x.abs());
    }
    let bias = tree_sum(&acc);
    if !finite || amax == 0.0 {
        q8[..d].fill(0);
        return (if finite { 0.0 } else { f32::NAN }, bias);
    }
    let inv = Q_LEVELS / amax;
    for c in 0..d {
        q8[c] = (q[c] * scale(k_scale[c]) * inv).round_ties_even() as i8;
    }
    (amax / Q_LEVELS, bias)
}

/// The score of key `t` of a block (`codes`: this head's `d·bs` key codes).
#[inline(always)]
pub(super) fn score(q8: &[i8], codes: &[u8], bs: usize, t: usize, (step, bias): (f32, f32)) -> f32 {
    let d = q8.len();
    let dot: i32 = (0..d).map(|c| q8[c] as i32 * codes[key_code_at(d, bs, c, t)] as i32).sum();
    (dot as f32).mul_add(step, bias)
}

/// What a row's weights over a block add to its output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum WeightStep {
    /// `o += (Σ w16·code) · step`.
    Step(f32),
    /// Every weight is zero or too small to quantize (under 1e−34: nothing next to the block
    /// holding the running maximum, whose largest weight is at least its value scale).
    Nothing,
    /// A weight is NaN or infinite: the output becomes NaN.
    Nan,
}

/// Quantize the weights `w[a..e]` of a row over a block into `w16[a..e]` (the rest of `w16` is
/// not touched).
pub(super) fn quantize_weights(w: &[f32], a: usize, e: usize, w16: &mut [i16]) -> WeightStep {
    let (mut wmax, mut finite) = (0f32, true);
    for &x in &w[a..e] {
        finite &= x.is_finite();
        wmax = wmax.max(x);
    }
    let inv = W_LEVELS / wmax;
    if !finite {
        return WeightStep::Nan;
    }
    if wmax <= 0.0 || !inv.is_finite() {
        return WeightStep::Nothing;
    }
    for t in a..e {
        w16[t] = (w[t] * inv).round_ties_even() as i16;
    }
    WeightStep::Step(wmax / W_LEVELS)
}

/// `o += Σ_t w_t·v_t` over keys `a..e` of a block (`codes`: this head's `bs·d` value codes).
pub(super) fn weigh_values(w16: &[i16], a: usize, e: usize, codes: &[i8], step: WeightStep, o: &mut [f32]) {
    let d = o.len();
    match step {
        WeightStep::Nothing => {}
        WeightStep::Nan => o.fill(f32::NAN),
        WeightStep::Step(s) => {
            for (c, x) in o.iter_mut().enumerate() {
                let acc: i32 = (a..e).map(|t| w16[t] as i32 * codes[value_code_at(d, t, c)] as i32).sum();
                *x = (acc as f32).mul_add(s, *x);
            }
        }
    }
}
