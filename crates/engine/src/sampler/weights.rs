//! The draw's weights, `exp((l - max) / T)` in fixed point, for a whole row at once.
//!
//! libm's `exp` is a call the compiler cannot vectorise: about 8 ns an id, 1.3 ms for a
//! 151,936-id row and most of a top-p draw's cost. `exp_nonpositive` is the textbook reduction
//! (x = k·ln2 + r, |r| ≤ ln2/2) and a degree-13 Taylor polynomial for e^r, written with plain f64
//! multiplies and adds only. Rust never fuses or reorders them, so the row loop vectorises
//! (4 or 8 lanes) and every CPU, vectorised or scalar, computes the same bits: the draw stays
//! reproducible across machines, and batch invariance does not depend on the loop's shape.
//! Its error is a few ulp of libm's, far below anything a draw can tell apart.

use flint_model::kernels::Isa;

/// Below this the weight is 0: e^-708 ≈ 3e-308 is the edge of the normal doubles, and a token
/// that far below the best has no say in any draw (151,936 of them weigh less than 1e-302).
const UNDERFLOW: f64 = -708.0;
const LOG2E: f64 = std::f64::consts::LOG2_E;
/// ln 2 split so that `k * LN2_HI` is exact for |k| < 2^11 (its low 32 bits are zero) and
/// `LN2_LO` carries the next 53 bits (fdlibm's constants; `LN_2 - LN2_HI` would carry only the
/// rounding of `LN_2`, a few hundred ulp at k = -1000).
const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
/// Adding 1.5·2^52 rounds to the nearest integer (ties to even) and leaves it in the low bits.
const ROUND: f64 = 6_755_399_441_055_744.0;
/// 1/n! for n = 2..=13 (1/0! and 1/1! are the 1.0s of the Horner form).
const INV_FACT: [f64; 12] = [
    1.0 / 2.0,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5_040.0,
    1.0 / 40_320.0,
    1.0 / 362_880.0,
    1.0 / 3_628_800.0,
    1.0 / 39_916_800.0,
    1.0 / 479_001_600.0,
    1.0 / 6_227_020_800.0,
];

/// e^x for x ≤ 0; 0 below `UNDERFLOW` and for NaN (a NaN or -inf logit is never a candidate).
#[inline(always)]
pub(super) fn exp_nonpositive(x: f64) -> f64 {
    let zero = x.is_nan() || x < UNDERFLOW;
    let x = if zero { 0.0 } else { x.min(0.0) };
    let shifted = x * LOG2E + ROUND;
    let k = shifted - ROUND;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut p = INV_FACT[11];
    for &c in INV_FACT[..11].iter().rev() {
        p = p * r + c;
    }
    let p = (p * r + 1.0) * r + 1.0;
    // k is in -1022..=0, so 2^k is a normal double built from its exponent field alone.
    let k = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i64;
    let scale = f64::from_bits(((k + 1023) as u64) << 52);
    if zero {
        0.0
    } else {
        p * scale
    }
}

/// `exp((l - max) / T)` of one logit: 1 for the best, 0 for NaN and -inf.
#[inline(always)]
pub(super) fn weight(l: f32, max: f32, inv_t: f64) -> f64 {
    exp_nonpositive((f64::from(l) - f64::from(max)) * inv_t)
}

/// Adding 2^52 to a value in [0, 2^51] rounds it to an integer (ties to even) held in the low
/// mantissa bits: an f64 to u64 conversion in bit moves, which AVX2 lacks as an instruction.
const TO_INT: f64 = 4_503_599_627_370_496.0;

/// `weight` in units of 1/`one` (`one` a power of two, at most 2^51), rounded to the nearest.
#[inline(always)]
pub(super) fn fixed_weight(l: f32, max: f32, inv_t: f64, one: f64) -> u64 {
    (weight(l, max, inv_t) * one + TO_INT).to_bits() - TO_INT.to_bits()
}

/// `fixed_weight` of every id of `row` into `out` (as long as the row). The same loop compiled
/// for the widest vector level the process may use (`Isa`): the build's baseline (SSE2) gives
/// the compiler two f64 lanes and no 64-bit lane compares, AVX2 four and AVX-512 eight. Every
/// level gives the same bits (IEEE adds, multiplies and bit moves, never fused or reordered).
pub(super) fn fill(row: &[f32], max: f32, inv_t: f64, one: f64, out: &mut [u64]) {
    fill_at(Isa::detected(), row, max, inv_t, one, out)
}

/// `fill` on the path of `isa` (the portable loop where that level is not available).
fn fill_at(isa: Isa, row: &[f32], max: f32, inv_t: f64, one: f64, out: &mut [u64]) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa >= Isa::Avx512 && Isa::Avx512.available() {
            // SAFETY: the CPU has AVX-512 F (checked by `available`).
            return unsafe { fill_avx512(row, max, inv_t, one, out) };
        }
        if isa >= Isa::Avx2 && Isa::Avx2.available() {
            // SAFETY: the CPU has AVX2 (checked by `available`).
            return unsafe { fill_avx2(row, max, inv_t, one, out) };
        }
    }
    let _ = isa;
    fill_portable(row, max, inv_t, one, out)
}

/// Sixteen ids at a time: four independent vector chains through the polynomial, where one
/// chain would wait on each multiply-add in turn.
#[inline(always)]
fn fill_portable(row: &[f32], max: f32, inv_t: f64, one: f64, out: &mut [u64]) {
    const GROUP: usize = 16;
    let n = row.len().min(out.len());
    let (row, out) = (&row[..n], &mut out[..n]);
    let mut outs = out.chunks_exact_mut(GROUP);
    let mut rows = row.chunks_exact(GROUP);
    for (o, r) in (&mut outs).zip(&mut rows) {
        for (w, &l) in o.iter_mut().zip(r) {
            *w = fixed_weight(l, max, inv_t, one);
        }
    }
    for (w, &l) in outs.into_remainder().iter_mut().zip(rows.remainder()) {
        *w = fixed_weight(l, max, inv_t, one);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fill_avx2(row: &[f32], max: f32, inv_t: f64, one: f64, out: &mut [u64]) {
    fill_portable(row, max, inv_t, one, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fill_avx512(row: &[f32], max: f32, inv_t: f64, one: f64, out: &mut [u64]) {
    fill_portable(row, max, inv_t, one, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn ulps(a: f64, b: f64) -> u64 {
        a.to_bits().abs_diff(b.to_bits())
    }

    /// Within 2 ulp of libm over the whole range, exact at 0, 0 past the underflow edge and for
    /// NaN and -inf; `fill` (vectorised) gives the bits of the scalar function.
    #[test]
    fn exp_is_libms_to_two_ulp_and_fixed_weights_round_it_on_every_path() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut worst = 0;
        for i in 0..200_000 {
            let x = match i % 4 {
                0 => -rng.random::<f64>() * 708.0,
                1 => -rng.random::<f64>() * 2.0,
                2 => -rng.random::<f64>() * 1e-6,
                _ => -(i as f64) * std::f64::consts::LN_2 / 64.0 % 708.0,
            };
            worst = worst.max(ulps(exp_nonpositive(x), x.exp()));
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        for x in [-708.5, -745.0, -1e300, f64::NEG_INFINITY, f64::NAN] {
            assert_eq!(exp_nonpositive(x), 0.0, "{x}");
        }
        assert!(exp_nonpositive(UNDERFLOW) > 0.0);

        let row: Vec<f32> = (0..10_007)
            .map(|i| match i % 97 {
                0 => f32::NEG_INFINITY,
                1 => f32::NAN,
                _ => (rng.random::<f32>() - 0.5) * 40.0,
            })
            .collect();
        // Every path this CPU has (the others run the portable loop, compared all the same),
        // against the scalar function and against rounding the libm weight to the nearest unit.
        let one = 2f64.powi(44);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            for inv_t in [1.0, 1.0 / 0.7, 1e-3, 1e30] {
                let mut out = vec![u64::MAX; row.len()];
                fill_at(isa, &row, 20.0, inv_t, one, &mut out);
                for (&w, &l) in out.iter().zip(&row) {
                    assert_eq!(w, fixed_weight(l, 20.0, inv_t, one), "{isa:?} {l} {inv_t}");
                    let x = (f64::from(l) - 20.0) * inv_t;
                    if l.is_finite() && x >= UNDERFLOW {
                        assert!((w as f64 - (x.exp() * one).round()).abs() <= 1.0, "{isa:?} {l} {inv_t}");
                    } else {
                        assert_eq!(w, 0, "{l} {inv_t}");
                    }
                }
            }
        }
        assert_eq!(fixed_weight(3.0, 3.0, 1.0, one), 1 << 44);
        assert_eq!(fixed_weight(3.0, 3.0, 1.0, 2f64.powi(51)), 1 << 51);
    }
}
