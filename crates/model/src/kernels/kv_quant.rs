//! The int8 KV cache's number formats, KIVI's layout: keys quantized per channel over a block's
//! tokens, values per token. Quantization runs once per block, when the block fills, in plain
//! scalar code (it is not on the hot path), so a block's codes are a function of its full-precision
//! keys and values alone — the same on every CPU, whatever the batch or the chunking was.
//!
//! - **Keys**, per (block, head, channel): asymmetric, `k ≈ min + scale · code` with `code` in
//!   0..=255. Qwen2's `k_proj` bias gives some channels a large offset and a small spread; the
//!   per-channel minimum absorbs the offset, so the 256 steps span only the spread.
//! - **Values**, per (block, head, token): symmetric, `v ≈ scale · code` with `code` in −127..=127.
//!
//! Scales are stored as one byte, a 1/8-octave logarithmic code ([`scale`]): the scale used is the
//! smallest code at least as large as the ideal one, at most 9% coarser, so it costs under 0.13
//! bits of the 8. Key minimums are f16, rounded down so the range still covers every key. One byte
//! per scale keeps the per-block statistics to `3·head_dim` bytes for the keys plus one byte per
//! token for the values: with 128-token blocks, int8 holds 3.92× (head_dim 64) to 3.94× (128) the
//! tokens of f32 in the same memory.

use half::f16;

/// `scale(code) = 2^((code − SCALE_BIAS) / 8)`: codes 0..=254 cover 2^−24 … 2^7.75, so values up to
/// ±27,400 and key spreads up to 55,000 are represented, and anything smaller down to 6e−8 steps.
/// Code 255 is NaN: a row or channel that held a NaN (or an infinity) reads back NaN, as an f32
/// cache would give, instead of a plausible wrong number.
pub const SCALE_BIAS: i32 = 192;

/// 2^(j/8) for j = 0..8 (each literal parses to the correctly rounded f32).
#[allow(clippy::excessive_precision)]
const EIGHTHS: [f32; 8] = [
    1.0,
    1.090_507_732_665_257_7,
    1.189_207_115_002_721,
    1.296_839_554_651_009_6,
    std::f32::consts::SQRT_2,
    1.542_210_825_407_940_7,
    1.681_792_830_507_429,
    1.834_008_086_409_342_4,
];

const fn build_scales() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 255 {
        let e = i as i32 - SCALE_BIAS;
        let (whole, frac) = (e.div_euclid(8), e.rem_euclid(8));
        // 2^whole is exact (whole ∈ −24..=7), so each entry is EIGHTHS[frac] times a power of two.
        t[i] = EIGHTHS[frac as usize] * f32::from_bits(((whole + 127) as u32) << 23);
        i += 1;
    }
    t[255] = f32::NAN;
    t
}

/// Every scale code's value.
pub static SCALES: [f32; 256] = build_scales();

/// The scale a code stands for.
#[inline(always)]
pub fn scale(code: u8) -> f32 {
    SCALES[code as usize]
}

/// The smallest code whose scale times `levels` reaches `span` (255 for a key channel's spread,
/// 127 for a value's largest magnitude); the largest finite one when none does; the NaN code for
/// a NaN or infinite span.
fn scale_code(span: f32, levels: f32) -> u8 {
    if !span.is_finite() {
        return 255;
    }
    SCALES[..255].partition_point(|&s| s * levels < span).min(254) as u8
}

/// `x` rounded down to an f16 (so `f16 ≤ x`), saturating at f16's finite range.
fn f16_at_most(x: f32) -> f16 {
    if x.is_nan() {
        return f16::NAN;
    }
    if x <= f16::MIN.to_f32() {
        return f16::MIN;
    }
    if x >= f16::MAX.to_f32() {
        return f16::MAX;
    }
    let h = f16::from_f32(x);
    if h.to_f32() <= x {
        return h;
    }
    // One step towards −∞.
    let b = h.to_bits();
    f16::from_bits(match b {
        0x0000 | 0x8000 => 0x8001,
        b if b & 0x8000 == 0 => b - 1,
        b => b + 1,
    })
}

/// Whether an int8 cache can hold blocks of `block_size` tokens of heads of `head_dim`: the code
/// layouts ([`key_code_at`], [`value_code_at`]) take channels four at a time and tokens in pairs.
pub fn int8_layout_fits(head_dim: usize, block_size: usize) -> bool {
    head_dim.is_multiple_of(4) && block_size.is_multiple_of(2) && block_size > 0
}

/// Where channel `c` of token `t`'s key code sits in a (block, head)'s `d·bs` codes: tiles of 16
/// tokens (the last may be shorter, `len`), each `[d/4][len][4]`, so one 64-byte line holds four
/// channels of a whole tile — the operand of one `vpdpbusd` per four channels of 16 scores.
#[inline(always)]
pub fn key_code_at(d: usize, bs: usize, c: usize, t: usize) -> usize {
    let tile = t / 16;
    let len = 16.min(bs - tile * 16);
    tile * 16 * d + (c / 4) * len * 4 + (t % 16) * 4 + c % 4
}

/// Where channel `c` of token `t`'s value code sits in a (block, head)'s `bs·d` codes: token
/// pairs, each `[d][2]`, so 32 bytes hold two tokens of 16 channels — the operand of one
/// `vpdpwssd` (once widened) per two tokens of 16 outputs.
#[inline(always)]
pub fn value_code_at(d: usize, t: usize, c: usize) -> usize {
    (t / 2) * 2 * d + c * 2 + t % 2
}

/// Quantize one (block, head) of keys, given transposed: `k[c·bs + t]` is channel `c` of token
/// `t`. Writes `codes` (laid out by [`key_code_at`]), and per channel the f16 minimum and the
/// scale code.
pub fn quantize_keys(k: &[f32], bs: usize, codes: &mut [u8], mins: &mut [u16], scales: &mut [u8]) {
    let d = k.len() / bs;
    for (c, (row, (min_out, scale_out))) in k.chunks_exact(bs).zip(mins.iter_mut().zip(scales.iter_mut())).enumerate() {
        let (lo, hi) = row.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let nan = row.iter().any(|x| x.is_nan());
        let min = if nan { f16::NAN } else { f16_at_most(lo) };
        let base = min.to_f32();
        let code = scale_code(hi - base, 255.0);
        let inv = 1.0 / scale(code);
        *min_out = min.to_bits();
        *scale_out = code;
        for (t, &x) in row.iter().enumerate() {
            // `as u8` maps NaN to 0; the NaN minimum carries the NaN instead.
            codes[key_code_at(d, bs, c, t)] = round(((x - base) * inv).clamp(0.0, 255.0)) as u8;
        }
    }
}

/// Quantize one (block, head) of values, given as rows `v[t·d + c]`: per token a scale code and
/// `d` codes (laid out by [`value_code_at`]).
pub fn quantize_values(v: &[f32], d: usize, codes: &mut [i8], scales: &mut [u8]) {
    for (t, (row, scale_out)) in v.chunks_exact(d).zip(scales.iter_mut()).enumerate() {
        let nan = row.iter().any(|x| x.is_nan());
        let amax = if nan { f32::NAN } else { row.iter().fold(0f32, |m, &x| m.max(x.abs())) };
        let code = scale_code(amax, 127.0);
        let inv = 1.0 / scale(code);
        *scale_out = code;
        for (c, &x) in row.iter().enumerate() {
            codes[value_code_at(d, t, c)] = round((x * inv).clamp(-127.0, 127.0)) as i8;
        }
    }
}

/// `x` (|x| ≤ 255) rounded to the nearest integer, ties to even, in two additions: the same on
/// every CPU, and it vectorises (libm's `roundf` is a call per value).
#[inline(always)]
fn round(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it leaves no fraction bits
    (x + MAGIC) - MAGIC
}

/// A key as the cache holds it: `min + scale · code`.
#[inline]
pub fn dequantize_key(code: u8, min: u16, scale_code: u8) -> f32 {
    f16::from_bits(min).to_f32() + scale(scale_code) * code as f32
}

/// A value as the cache holds it: `scale · code`.
#[inline]
pub fn dequantize_value(code: i8, scale_code: u8) -> f32 {
    scale(scale_code) * code as f32
}

/// f32 → bf16, rounded to nearest even (NaN stays NaN).
#[inline]
pub fn to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// bf16 → f32 (exact).
#[inline(always)]
pub fn from_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_table_is_exact_and_monotone() {
        for (i, &s) in SCALES[..255].iter().enumerate() {
            let want = 2f64.powf((i as f64 - SCALE_BIAS as f64) / 8.0);
            assert!(((s as f64 - want) / want).abs() < 6e-8, "code {i}: {s} vs {want}");
            if i > 0 {
                assert!(s > SCALES[i - 1]);
            }
        }
        assert_eq!(scale(SCALE_BIAS as u8), 1.0);
        assert_eq!(scale(SCALE_BIAS as u8 + 8), 2.0);
        assert_eq!(scale_code(0.0, 255.0), 0);
        assert!(scale(255).is_nan());
        assert_eq!(scale_code(f32::INFINITY, 255.0), 255);
        assert_eq!(scale_code(f32::NAN, 127.0), 255);
        assert_eq!(scale_code(1e30, 127.0), 254, "finite spans saturate at the largest finite scale");
        // The chosen scale is never more than one step (9%) above the ideal.
        for span in [1e-6f32, 0.37, 3.0, 255.0, 1e4] {
            let c = scale_code(span, 255.0);
            assert!(scale(c) * 255.0 >= span && (c == 0 || scale(c - 1) * 255.0 < span));
            assert!(scale(c) * 255.0 <= span * 1.0906 || c == 0);
        }
    }

    #[test]
    fn f16_minimum_never_exceeds_the_value() {
        for x in [0.0f32, -0.0, 1e-9, -1e-9, 0.1, -0.1, 50.3, -50.3, 1234.567, -65504.0, 65504.0] {
            let h = f16_at_most(x).to_f32();
            assert!(h <= x, "{x} -> {h}");
            assert!((x - h).abs() <= (x.abs() * 2e-3).max(1e-7), "{x} -> {h}");
        }
        // Past f16's range it saturates (the codes then clip: keys that large are a broken model).
        assert_eq!(f16_at_most(-1e6), f16::MIN);
        assert_eq!(f16_at_most(1e6), f16::MAX);
    }

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        crate::kernels::xorshift(seed.wrapping_mul(2_654_435_761) | 1)
            .take(n)
            .map(|s| (s % 20_000) as f32 / 5_000.0 - 2.0)
            .collect()
    }

    /// Keys with a large per-channel offset (Qwen2's k_proj bias) keep an error bounded by the
    /// channel's spread, not its offset; values by their row's magnitude.
    #[test]
    fn round_trip_error_is_half_a_step_of_the_spread() {
        let (bs, d) = (128, 64);
        let mut k = pseudo(bs * d, 1);
        for c in 0..d {
            let offset = if c % 7 == 0 { 300.0 - 9.0 * c as f32 } else { 0.0 };
            for t in 0..bs {
                k[c * bs + t] += offset;
            }
        }
        let (mut codes, mut mins, mut scales) = (vec![0u8; bs * d], vec![0u16; d], vec![0u8; d]);
        quantize_keys(&k, bs, &mut codes, &mut mins, &mut scales);
        for c in 0..d {
            let row = &k[c * bs..(c + 1) * bs];
            let spread = row.iter().cloned().fold(f32::MIN, f32::max) - row.iter().cloned().fold(f32::MAX, f32::min);
            for t in 0..bs {
                let got = dequantize_key(codes[key_code_at(d, bs, c, t)], mins[c], scales[c]);
                // Half a step of (spread + the f16 rounding of the minimum), a step ≤ 1.0906·range/255.
                let bound = 0.5 * 1.0906 * (spread + row[0].abs() * 1e-3) / 255.0 + 1e-6;
                assert!((got - row[t]).abs() <= bound, "channel {c} token {t}: {got} vs {}", row[t]);
            }
        }
        let v = pseudo(bs * d, 2);
        let (mut vc, mut vs) = (vec![0i8; bs * d], vec![0u8; bs]);
        quantize_values(&v, d, &mut vc, &mut vs);
        for t in 0..bs {
            let row = &v[t * d..(t + 1) * d];
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            for c in 0..d {
                let got = dequantize_value(vc[value_code_at(d, t, c)], vs[t]);
                assert!((got - row[c]).abs() <= 0.5 * 1.0906 * amax / 127.0 + 1e-7);
            }
        }
    }

    #[test]
    fn degenerate_inputs_stay_finite_or_nan_never_garbage() {
        // Constant channels (4 channels × 4 tokens): zero spread, exact.
        let (mut codes, mut mins, mut scales) = (vec![0u8; 16], vec![0u16; 4], vec![0u8; 4]);
        quantize_keys(&[2.5; 16], 4, &mut codes, &mut mins, &mut scales);
        assert!((dequantize_key(codes[key_code_at(4, 4, 0, 1)], mins[0], scales[0]) - 2.5).abs() < 1e-6);
        // NaN in a channel: that channel reads back NaN, the others do not.
        let mut k = [1.0f32; 16];
        k[..4].copy_from_slice(&[1.0, f32::NAN, 2.0, 3.0]);
        quantize_keys(&k, 4, &mut codes, &mut mins, &mut scales);
        assert!(dequantize_key(codes[key_code_at(4, 4, 0, 2)], mins[0], scales[0]).is_nan());
        assert_eq!(dequantize_key(codes[key_code_at(4, 4, 1, 2)], mins[1], scales[1]), 1.0);
        // Values: two tokens of 4 channels.
        let (mut vc, mut vs) = (vec![0i8; 8], vec![0u8; 2]);
        quantize_values(&[0.0; 8], 4, &mut vc, &mut vs);
        assert_eq!(dequantize_value(vc[value_code_at(4, 0, 0)], vs[0]), 0.0);
        quantize_values(&[1.0, f32::NAN, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], 4, &mut vc, &mut vs);
        assert!(dequantize_value(vc[value_code_at(4, 0, 0)], vs[0]).is_nan());
        assert!((dequantize_value(vc[value_code_at(4, 1, 0)], vs[1]) - 1.0).abs() < 1e-2);
        // Huge values saturate rather than wrap.
        quantize_values(&[1e9, -1e9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 4, &mut vc, &mut vs);
        assert_eq!((vc[value_code_at(4, 0, 0)], vc[value_code_at(4, 0, 1)]), (127, -127));
    }

    /// The layouts are permutations of a (block, head)'s codes, ragged last key tile included.
    #[test]
    fn code_layouts_are_permutations() {
        for (d, bs) in [(64, 128), (48, 24), (16, 8), (128, 16), (4, 2)] {
            let mut seen = vec![false; d * bs];
            for c in 0..d {
                for t in 0..bs {
                    let i = key_code_at(d, bs, c, t);
                    assert!(!std::mem::replace(&mut seen[i], true), "key {d}/{bs}: ({c}, {t}) collides");
                }
            }
            let mut seen = vec![false; d * bs];
            for c in 0..d {
                for t in 0..bs {
                    assert!(!std::mem::replace(&mut seen[value_code_at(d, t, c)], true));
                }
            }
        }
        assert!(int8_layout_fits(64, 128) && !int8_layout_fits(62, 128) && !int8_layout_fits(64, 15));
    }

    #[test]
    fn bf16_round_trip() {
        assert_eq!(from_bf16(to_bf16(1.0)), 1.0);
        assert_eq!(from_bf16(to_bf16(-3.5)), -3.5);
        let x = 1.0 + 1.0 / 512.0; // halfway between two bf16 values: rounds to even
        assert_eq!(from_bf16(to_bf16(x)), 1.0);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
    }
}
