use super::*;
use crate::kernels::test_data as data;

fn bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| round_to_bf16(x)).collect()
}

fn f(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The SIMD kernel (where the CPU has it) or the emulation.
fn matmul(simd: bool, x: &[f32], m: usize, w: &HugeBuf<u16>, out: usize, inp: usize) -> Vec<f32> {
    let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
    run(if simd { Isa::Avx512Bf16 } else { Isa::Scalar }, x, m, w, out, inp, &mut y);
    crate::kernels::written(&y)
}

#[test]
fn rounding_is_to_nearest_even() {
    assert_eq!(round_to_bf16(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even (1.0).
    assert_eq!(round_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
    assert_eq!(round_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    assert_eq!(round_to_bf16(-2.5e-3), round_to_bf16(2.5e-3) | 0x8000);
    assert!(f(round_to_bf16(f32::NAN)).is_nan());
    assert_eq!(round_to_bf16(f32::INFINITY), 0x7f80);
    assert_eq!(round_to_bf16(f32::MAX), 0x7f80, "rounds up to infinity");
}

/// The emulation's reading of the instruction, on cases where a wrong reading shows.
#[test]
fn emulation_follows_the_instruction() {
    let pair = |e: f32, o: f32| round_to_bf16(e) as u32 | (round_to_bf16(o) as u32) << 16;
    let ones = pair(1.0, 1.0);
    // Odd product first: 1 + 2^-24 rounds to 1, then −1 gives 0 (even first would give 2^-24).
    assert_eq!(dpbf16(1.0, pair(-1.0, 2f32.powi(-24)), ones), 0.0);
    // Products are exact (fused): the smallest normal plus 2^-140 keeps the 2^-140.
    assert!(dpbf16(2f32.powi(-126), pair(0.0, 2f32.powi(-70)), pair(0.0, 2f32.powi(-70))) > 2f32.powi(-126));
    // Subnormal results are flushed, subnormal accumulators read as zero.
    assert_eq!(dpbf16(0.0, pair(0.0, 2f32.powi(-70)), pair(0.0, 2f32.powi(-70))), 0.0);
    assert_eq!(dpbf16(1e-39, 0, 0), 0.0);
    // Subnormal bf16 inputs read as zero.
    assert_eq!(dpbf16(1.0, 0x0001 << 16, ones), 1.0);
    // Tininess after rounding at 24 bits (read off the instruction on a Xeon): the smallest
    // normal minus 2^-151 rounds back up to it and stays; minus 2^-150 (where IEEE's
    // subnormal rounding ties up to the smallest normal) or 0.75·2^-150 is flushed.
    let min = f32::MIN_POSITIVE;
    let p = |a: f32| round_to_bf16(a) as u32;
    assert_eq!(dpbf16(min, p(-(2f32.powi(-75))) << 16, p(2f32.powi(-76)) << 16), min);
    assert_eq!(dpbf16(min, p(-(2f32.powi(-75))) << 16, p(2f32.powi(-75)) << 16), 0.0);
    assert_eq!(dpbf16(min, p(-1.5 * 2f32.powi(-75)) << 16, p(2f32.powi(-76)) << 16), 0.0);
    assert_eq!(dpbf16(-min, p(2f32.powi(-75)) << 16, p(2f32.powi(-76)) << 16), -min);
    // Flushed to −0, then the even product +0 is added: +0, as on the instruction.
    assert_eq!(dpbf16(-min, p(2f32.powi(-75)) << 16, p(2f32.powi(-75)) << 16).to_bits(), 0);
    assert_eq!(dpbf16(0.5, pair(2.0, 3.0), pair(4.0, 5.0)), 0.5 + 15.0 + 8.0);
}

#[test]
fn simd_matches_the_emulation_bit_for_bit() {
    if !simd_available() {
        eprintln!("AVX-512 BF16 not available: only the emulation ran");
        return;
    }
    eprintln!("AVX-512 BF16 SIMD path checked against the emulation");
    // Ordinary values, then values that reach the instruction's corners (subnormal products
    // and inputs, cancellation, overflow).
    let mut corner = data(64 * 45, 7);
    for (i, v) in corner.iter_mut().enumerate() {
        *v *= match i % 7 {
            0 => 2f32.powi(-66),
            1 => 2f32.powi(-128),
            2 => 2f32.powi(60),
            3 => 1e30,
            _ => 1.0,
        };
    }
    // The flush boundary below the smallest normal: per column, pair 0 makes the
    // accumulator ±2^-126 (2^-63·2^-63) and pair 1's odd product takes it just below the
    // boundary, onto it, or past it.
    let e = |k: i32| 2f32.powi(k);
    let odd = [-e(-75), -1.5 * e(-75), -e(-74), -e(-76), e(-80), -e(-63)];
    let mut wb = vec![0f32; 16 * 4];
    for c in 0..16 {
        let s = if c % 2 == 0 { 1.0 } else { -1.0 };
        wb[c * 4] = s * e(-63);
        wb[c * 4 + 3] = s * odd[c % odd.len()];
    }
    for x3 in [e(-76), e(-75), e(-74)] {
        let x = [e(-63), 0.0, 0.0, x3];
        let packed = to_pair_panels(&bits(&wb), 16, 4);
        let (simd, emul) = (matmul(true, &x, 1, &packed, 16, 4), matmul(false, &x, 1, &packed, 16, 4));
        let same = simd.iter().zip(&emul).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "flush boundary x3={x3:e}: SIMD {simd:?} vs emulation {emul:?}");
    }
    for (out, inp, w) in [(37, 45, data(37 * 45, 1)), (64, 45, corner.clone())] {
        let packed = to_pair_panels(&bits(&w), out, inp);
        for m in [1, 2, 3, 7, 8, 9, 17] {
            let mut x = data(m * inp, 2 + m as u32);
            if out == 64 {
                x.iter_mut().zip(&corner).for_each(|(a, c)| *a *= c.abs().max(1e-3));
            }
            let (s, e) = (matmul(true, &x, m, &packed, out, inp), matmul(false, &x, m, &packed, out, inp));
            let same = s.iter().zip(&e).all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan());
            assert!(same, "{out}x{inp} m={m}: SIMD and emulation differ");
        }
    }
}

#[test]
fn matches_a_reference_on_the_rounded_inputs() {
    let (out, inp) = (37, 29);
    let w = bits(&data(out * inp, 3));
    let packed = to_pair_panels(&w, out, inp);
    for m in [1, 5, 9] {
        let x = data(m * inp, 4);
        for simd in [false, true] {
            let y = matmul(simd, &x, m, &packed, out, inp);
            for i in 0..m {
                for o in 0..out {
                    let r: f64 =
                        (0..inp).map(|k| f(round_to_bf16(x[i * inp + k])) as f64 * f(w[o * inp + k]) as f64).sum();
                    assert!((y[i * out + o] as f64 - r).abs() < 1e-5, "({i},{o}) {} vs {r}", y[i * out + o]);
                }
            }
        }
    }
}

#[test]
fn a_row_does_not_depend_on_its_batch() {
    let (out, inp) = (80, 96);
    let packed = to_pair_panels(&bits(&data(out * inp, 5)), out, inp);
    let target = data(inp, 6);
    for simd in [false, true] {
        let alone = matmul(simd, &target, 1, &packed, out, inp);
        for m in [2, 8, 9, 20] {
            let mut x = data(m * inp, 7 + m as u32);
            let pos = m / 2;
            x[pos * inp..(pos + 1) * inp].copy_from_slice(&target);
            let y = matmul(simd, &x, m, &packed, out, inp);
            assert_eq!(&y[pos * out..(pos + 1) * out], &alone[..], "m={m} simd={simd}");
        }
    }
}

#[test]
fn simd_rounding_matches_the_scalar_rounding() {
    if !Isa::Avx512.available() {
        eprintln!("AVX-512 not available: only the scalar rounding ran");
        return;
    }
    eprintln!("AVX-512 rounding checked against the scalar one");
    // Every corner (ties either way, NaNs quiet and signalling, infinities, the largest
    // finite values, subnormals) and random bit patterns; an odd length leaves a tail.
    let mut bits = vec![
        0x3f80_8000u32,
        0x3f81_8000,
        0x3f80_8001,
        0x3f80_7fff,
        0x7fc0_0000,
        0x7f80_0001,
        0xff80_0001,
        0x7fbf_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x7f7f_ffff,
        0xff7f_ffff,
        0x7f7f_8000,
        0x0000_0001,
        0x007f_ffff,
        0x807f_8000,
        0x0000_0000,
        0x8000_0000,
        0x0080_0000,
    ];
    bits.extend(crate::kernels::xorshift(9).take(4099));
    let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let round = |isa| {
        let mut out = vec![MaybeUninit::new(0u16); src.len()];
        round_row(isa, &src, &mut out);
        // SAFETY: `round_row` wrote every value (and they started initialised anyway).
        out.iter().map(|v| unsafe { v.assume_init() }).collect::<Vec<u16>>()
    };
    let (simd, scalar) = (round(Isa::Avx512), round(Isa::Scalar));
    for (i, (a, b)) in simd.iter().zip(&scalar).enumerate() {
        assert_eq!(a, b, "{:#010x}: SIMD {a:#06x}, scalar {b:#06x}", bits[i]);
    }
}

/// Several weights in one call, and gate/up fused with SiLU, give each output the bits of
/// its own call (and of `silu_mul` after them), on the SIMD path and the emulation.
#[test]
fn many_and_gated_give_the_bits_of_single_calls() {
    let inp = 45;
    let ws: Vec<(usize, HugeBuf<u16>)> =
        [37, 16, 80].iter().map(|&out| (out, to_pair_panels(&bits(&data(out * inp, out as u32)), out, inp))).collect();
    for isa in [Isa::Scalar, Isa::Avx512Bf16] {
        for m in [1, 7, 9, 20] {
            let x = data(m * inp, 40 + m as u32);
            let single: Vec<Vec<f32>> = ws
                .iter()
                .map(|(out, w)| {
                    let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
                    run(isa, &x, m, w, *out, inp, &mut y);
                    crate::kernels::written(&y)
                })
                .collect();
            let mut outs: Vec<Vec<MaybeUninit<f32>>> =
                ws.iter().map(|(out, _)| vec![MaybeUninit::new(f32::NAN); m * out]).collect();
            let mut views: Vec<&mut [MaybeUninit<f32>]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            let parts: Vec<(&[u16], usize)> = ws.iter().map(|(out, w)| (&w[..], *out)).collect();
            run_many(isa, &x, m, &parts, inp, &mut views);
            for (j, o) in outs.iter().enumerate() {
                let got = crate::kernels::written(o);
                assert!(got.iter().zip(&single[j]).all(|(a, b)| a.to_bits() == b.to_bits()), "many: matrix {j} m={m}");
            }
            // Gate = the first weight, up = a second weight of the same shape.
            let up = to_pair_panels(&bits(&data(37 * inp, 99)), 37, inp);
            let mut u = vec![MaybeUninit::new(f32::NAN); m * 37];
            run(isa, &x, m, &up, 37, inp, &mut u);
            let u = crate::kernels::written(&u);
            let mut want = vec![0f32; m * 37];
            crate::kernels::rowwise::silu_mul_row(&single[0], &u, &mut want);
            let mut y = vec![MaybeUninit::new(f32::NAN); m * 37];
            run_gated(isa, &x, m, &ws[0].1, &up, 37, inp, &mut y);
            let got = crate::kernels::written(&y);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "gated m={m} {isa:?}");
        }
    }
}

#[test]
fn pair_layout_places_every_weight() {
    let (out, inp) = (20, 5);
    let w: Vec<u16> = (0..(out * inp) as u16).map(|v| v + 1).collect();
    let p = to_pair_panels(&w, out, inp);
    let kp = pairs(inp);
    for o in 0..out {
        for k in 0..inp {
            assert_eq!(p[(o / PANEL) * kp * STEP + index_in_panel(k, o % PANEL)], w[o * inp + k]);
        }
    }
    // The odd column's partner is zero padding.
    assert_eq!(p[index_in_panel(5, 3)], 0);
}
