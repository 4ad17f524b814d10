// Index loops over rows, operands and columns read as the tiles' coordinates.
#![allow(clippy::needless_range_loop)]

use super::*;
use crate::kernels::matmul_bf16::dpbf16;

/// xorshift32: deterministic inputs without a dependency.
struct Rng(u32);

impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        self.0
    }

    /// A bf16 of either sign with an exponent spread over 2^-12..2^12 (sums that round), one in
    /// `1 / subnormal_every` subnormal (0 for none) and some zeros.
    fn bf16(&mut self, subnormal_every: u32) -> u16 {
        let r = self.next();
        let sign = ((r >> 31) as u16) << 15;
        let mant = (r & 0x7f) as u16;
        if subnormal_every > 0 && (r >> 8).is_multiple_of(subnormal_every) {
            return sign | mant.max(1);
        }
        if (r >> 8).is_multiple_of(61) {
            return sign;
        }
        let exp = (127 - 12 + (r >> 16) % 25) as u16;
        sign | exp << 7 | mant
    }
}

/// Random A rows (`m` × `stride` pairs) and `panels` B chunks.
fn inputs(rng: &mut Rng, m: usize, stride: usize, chunks: usize, sub: u32) -> (Vec<u32>, [Vec<u16>; 2]) {
    let a = (0..m * stride).map(|_| rng.bf16(sub) as u32 | (rng.bf16(sub) as u32) << 16).collect();
    let b = [0, 1].map(|_| (0..chunks * B_CHUNK).map(|_| rng.bf16(sub)).collect());
    (a, b)
}

/// `chunks` chunks of a block through `t`: A chunk `c` at pair `16c` of each row.
fn run_block<T: Bf16Tiles>(
    t: &mut T,
    a: &[u32],
    stride: usize,
    b: &[Vec<u16>; 2],
    m: usize,
    panels: usize,
    chunks: usize,
) -> Block {
    t.start(m, panels);
    for c in 0..chunks {
        // SAFETY: `a` holds `m` rows of `stride` ≥ 16·chunks pairs; each B has `chunks` chunks.
        unsafe {
            t.chunk(
                a[c * CHUNK_PAIRS..].as_ptr(),
                stride * 4,
                [b[0][c * B_CHUNK..].as_ptr(), b[1][c * B_CHUNK..].as_ptr()],
            )
        };
    }
    let mut out = [[[0f32; 16]; BLOCK_ROWS]; 2];
    t.finish(&mut out);
    out
}

/// With normal values only, the emulation is plain f32 arithmetic in the SDM's order.
#[test]
fn emulated_lane_is_the_sdm_order() {
    let mut rng = Rng(0x1234_5678);
    let (mut differs_from_vdp, mut n) = (0, 0);
    for _ in 0..2000 {
        let a: Vec<u32> = (0..16).map(|_| rng.bf16(0) as u32 | (rng.bf16(0) as u32) << 16).collect();
        let b: Vec<u16> = (0..B_CHUNK).map(|_| rng.bf16(0)).collect();
        let col = rng.next() as usize % 16;
        let c0 = f32::from_bits((rng.bf16(0) as u32) << 16);
        let f = |bits: u32| f32::from_bits(bits << 16);
        let (mut even, mut odd) = (0f32, 0f32);
        for k in 0..16 {
            even = f(a[k] & 0xffff).mul_add(f(b[k * 32 + 2 * col] as u32), even);
            odd = f(a[k] >> 16).mul_add(f(b[k * 32 + 2 * col + 1] as u32), odd);
        }
        let want = c0 + (even + odd);
        let got = tdp_lane(c0, &a, &b, col);
        assert_eq!(got.to_bits(), want.to_bits(), "lane {col}: {got} against {want}");
        // vdpbf16ps's order: one chain, odd product first.
        let chain = (0..16)
            .fold(c0, |acc, k| dpbf16(acc, b[k * 32 + 2 * col] as u32 | (b[k * 32 + 2 * col + 1] as u32) << 16, a[k]));
        differs_from_vdp += usize::from(chain.to_bits() != got.to_bits());
        n += 1;
    }
    // The inputs make rounding visible: the two orders disagree on most of them.
    assert!(differs_from_vdp > n / 2, "only {differs_from_vdp} of {n} differ from vdpbf16ps's order");
}

#[test]
fn emulated_lane_flushes_subnormals() {
    let mut b = vec![0u16; B_CHUNK];
    let mut a = vec![0u32; 16];
    // A subnormal input reads as zero: 2^-130 (bf16 0x0010) times 2^10.
    (a[0], b[0]) = (0x0010, 0x4480);
    assert_eq!(tdp_lane(1.0, &a, &b, 0), 1.0);
    // A product tiny after rounding is flushed: 2^-70 · 2^-70.
    (a[0], b[0]) = (0x1c80, 0x1c80);
    assert_eq!(tdp_lane(0.0, &a, &b, 0).to_bits(), 0);
    // A subnormal accumulator reads as zero.
    (a[0], b[0]) = (0, 0);
    assert_eq!(tdp_lane(f32::from_bits(1), &a, &b, 0).to_bits(), 0);
}

/// Every row and operand of a block is its own sequence of [`tdp_lane`]s.
#[test]
fn emulated_block_is_lanes_per_row_and_operand() {
    let mut rng = Rng(77);
    for (m, panels, chunks) in [(1, 1, 1), (5, 2, 3), (16, 1, 2), (17, 2, 2), (32, 2, 1)] {
        let stride = chunks * 16 + 3;
        let (a, b) = inputs(&mut rng, m, stride, chunks, 50);
        let got = run_block(&mut EmulatedBf16Tiles::default(), &a, stride, &b, m, panels, chunks);
        for j in 0..panels {
            for r in 0..m {
                for n in 0..16 {
                    let want =
                        (0..chunks).fold(0f32, |c, k| tdp_lane(c, &a[r * stride + k * 16..], &b[j][k * B_CHUNK..], n));
                    assert_eq!(got[j][r][n].to_bits(), want.to_bits(), "m {m} operand {j} row {r} col {n}");
                }
            }
        }
    }
}

/// The hardware against the emulation, where this process has AMX-BF16. On a mismatch the
/// message says which other order the hardware follows, if any.
#[test]
fn hardware_tiles_give_the_emulated_bits() {
    if !hardware_available() {
        eprintln!("no AMX-BF16 here: the hardware comparison did not run");
        return;
    }
    let mut rng = Rng(4242);
    for sub in [0, 40] {
        for (m, panels, chunks) in [(1, 1, 1), (3, 2, 2), (16, 2, 3), (17, 1, 2), (29, 2, 4), (32, 2, 5)] {
            let stride = chunks * 16 + 5;
            let (a, b) = inputs(&mut rng, m, stride, chunks, sub);
            let want = run_block(&mut EmulatedBf16Tiles::default(), &a, stride, &b, m, panels, chunks);
            let mut t = Bf16TileUnit::new(true);
            assert!(matches!(t, Bf16TileUnit::Hardware(_)));
            let got = run_block(&mut t, &a, stride, &b, m, panels, chunks);
            let mut bad = Vec::new();
            for j in 0..panels {
                for r in 0..m {
                    for n in 0..16 {
                        if got[j][r][n].to_bits() != want[j][r][n].to_bits() {
                            bad.push((j, r, n));
                        }
                    }
                }
            }
            if !bad.is_empty() {
                let report = other_orders(&a, stride, &b, m, panels, chunks, &got);
                panic!(
                    "m {m} operands {panels} chunks {chunks} subnormals 1/{sub}: {} of {} differ, first {:?}: \
                     hardware {:e} emulation {:e}; {report}",
                    bad.len(),
                    panels * m * 16,
                    bad[0],
                    got[bad[0].0][bad[0].1][bad[0].2],
                    want[bad[0].0][bad[0].1][bad[0].2],
                );
            }
        }
    }
}

/// How many of the hardware's values each candidate order gives.
fn other_orders(
    a: &[u32],
    stride: usize,
    b: &[Vec<u16>; 2],
    m: usize,
    panels: usize,
    chunks: usize,
    got: &Block,
) -> String {
    fn f(bits: u32) -> f32 {
        f32::from_bits(bits << 16)
    }
    type Order = fn(f32, &[u32], &[u16], usize) -> f32;
    let even_first: Order = |c, a, b, n| {
        (0..16).fold(c, |acc, k| {
            let acc = f(a[k] & 0xffff).mul_add(f(b[k * 32 + 2 * n] as u32), acc);
            f(a[k] >> 16).mul_add(f(b[k * 32 + 2 * n + 1] as u32), acc)
        })
    };
    let odd_first: Order = |c, a, b, n| {
        (0..16).fold(c, |acc, k| dpbf16(acc, b[k * 32 + 2 * n] as u32 | (b[k * 32 + 2 * n + 1] as u32) << 16, a[k]))
    };
    let c_then_even_then_odd: Order = |c, a, b, n| {
        let (mut e, mut o) = (0f32, 0f32);
        for k in 0..16 {
            e = f(a[k] & 0xffff).mul_add(f(b[k * 32 + 2 * n] as u32), e);
            o = f(a[k] >> 16).mul_add(f(b[k * 32 + 2 * n + 1] as u32), o);
        }
        (c + e) + o
    };
    let pair_sums_exact: Order = |c, a, b, n| {
        // Each pair's two products summed exactly (f64), rounded once, then chained.
        (0..16).fold(c, |acc, k| {
            let p = f(a[k] & 0xffff) as f64 * f(b[k * 32 + 2 * n] as u32) as f64
                + f(a[k] >> 16) as f64 * f(b[k * 32 + 2 * n + 1] as u32) as f64;
            acc + p as f32
        })
    };
    let chunk_exact: Order = |c, a, b, n| {
        let s: f64 = (0..16)
            .map(|k| {
                f(a[k] & 0xffff) as f64 * f(b[k * 32 + 2 * n] as u32) as f64
                    + f(a[k] >> 16) as f64 * f(b[k * 32 + 2 * n + 1] as u32) as f64
            })
            .sum();
        c + s as f32
    };
    let orders: [(&str, Order); 6] = [
        ("sdm (emulation)", tdp_lane),
        ("one chain, even first", even_first),
        ("one chain, odd first (vdpbf16ps)", odd_first),
        ("(c + even) + odd", c_then_even_then_odd),
        ("pair sums rounded once, chained", pair_sums_exact),
        ("chunk sum rounded once, then added", chunk_exact),
    ];
    let mut out = Vec::new();
    for (name, order) in orders {
        let mut same = 0;
        for j in 0..panels {
            for r in 0..m {
                for n in 0..16 {
                    let v = (0..chunks).fold(0f32, |c, k| order(c, &a[r * stride + k * 16..], &b[j][k * B_CHUNK..], n));
                    same += usize::from(v.to_bits() == got[j][r][n].to_bits());
                }
            }
        }
        out.push(format!("{name}: {same}/{}", panels * m * 16));
    }
    out.join(", ")
}
