//! The bf16 matmul on AMX-BF16 tiles: blocks of up to 32 rows against two 16-column panels
//! (two of a matrix, or a gate panel and its up panel), the f32 accumulators kept in the tiles
//! over the whole input width, so there is no per-block fold as in the int8 path.
//!
//! The pair panels need no second copy: 16 consecutive k-pairs of a panel are 16 lines of 64
//! bytes, `tdpbf16ps`'s B operand as stored. The activations are rounded to bf16 as for
//! `vdpbf16ps`, into rows padded with zeros to a whole number of 16-pair chunks, the A tiles'
//! width; a weight whose width is not a multiple of 32 has its last chunk copied into a
//! zero-padded one. The padding adds `+0 · +0` products, which leave every sum's bits as they
//! are (a chain starts at +0 and never becomes −0 by adding +0).

use std::mem::MaybeUninit;
use std::ops::Range;

use super::{pairs, round_rows_padded, PANEL, STEP};
use crate::kernels::amx_bf16::{Bf16TileUnit, Bf16Tiles, Block, BLOCK_ROWS, B_CHUNK, CHUNK_PAIRS};
use crate::kernels::{by_panel_stripes_many, Isa, Stripe};

/// B chunks to prefetch ahead while a block streams its panels from memory: a single-row decode
/// step is memory-bound, and a tile load waits for all 16 of its lines. Without it, decode on
/// tiles ran at 0.78–0.84× the f32 products' tg16 on a Sapphire Rapids-class Xeon
/// (`scripts/amx_check.sh`, bf16 qwen2.5-1.5b and 0.5b).
const PREFETCH_CHUNKS: usize = 4;

/// A panel's B chunks: in place, the last one copied into zero padding when the width is not
/// a whole number of chunks.
struct PanelChunks<'a> {
    panel: &'a [u16],
    tail: Option<Box<[u16; B_CHUNK]>>,
}

impl<'a> PanelChunks<'a> {
    fn new(panel: &'a [u16]) -> Self {
        let (full, rest) = (panel.len() / B_CHUNK, panel.len() % B_CHUNK);
        let tail = (rest > 0).then(|| {
            let mut t = Box::new([0u16; B_CHUNK]);
            t[..rest].copy_from_slice(&panel[full * B_CHUNK..]);
            t
        });
        Self { panel, tail }
    }

    /// Ask for chunk `c`'s 16 lines ahead of their tile load. Past the panel's end the lines
    /// are those of the next panel in memory, which the next block of the stripe reads (a
    /// prefetch never faults, wherever it points).
    #[inline(always)]
    fn prefetch(&self, c: usize) {
        #[cfg(target_arch = "x86_64")]
        for line in 0..CHUNK_PAIRS {
            let at = self.panel.as_ptr().wrapping_add(c * B_CHUNK + line * 32);
            // SAFETY: a prefetch reads nothing architecturally and never faults.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = c;
    }

    /// Chunk `c`'s 16 lines (`c` below the panel's chunk count).
    fn at(&self, c: usize) -> *const u16 {
        match &self.tail {
            Some(t) if (c + 1) * B_CHUNK > self.panel.len() => t.as_ptr(),
            _ => self.panel[c * B_CHUNK..].as_ptr(),
        }
    }
}

/// `acc = A · B` for `rows` of the padded activations `xs` (`stride` pairs per row) against one
/// or two panels.
fn block<T: Bf16Tiles>(
    t: &mut T,
    xs: &[u32],
    stride: usize,
    rows: Range<usize>,
    b: [&PanelChunks; 2],
    two: bool,
    acc: &mut Block,
) {
    let chunks = stride / CHUNK_PAIRS;
    assert!(xs.len() >= rows.end * stride, "bf16 tiles: activation rows");
    t.start(rows.len(), 1 + usize::from(two));
    let a = xs[rows.start * stride..].as_ptr();
    // The first row block streams the panels from memory; later ones find them in cache.
    let stream = rows.start == 0;
    for c in 0..chunks {
        if stream {
            b[0].prefetch(c + PREFETCH_CHUNKS);
            if two {
                b[1].prefetch(c + PREFETCH_CHUNKS);
            }
        }
        // SAFETY: the rows' `stride` pairs from `a` (checked above), chunk `c` at pair
        // 16·c < stride; each panel chunk is 16 lines of 64 bytes (`PanelChunks`).
        unsafe { t.chunk(a.add(c * CHUNK_PAIRS), stride * 4, [b[0].at(c), b[1].at(c)]) };
    }
    t.finish(acc);
}

/// The shapes both entry points check: `x` is `[m, inp]`, each pair panel and each output
/// (where given) matches its `out`.
fn check_shapes(x: &[f32], m: usize, ws: &[(&[u16], usize)], inp: usize, ys: &mut [&mut [MaybeUninit<f32>]]) {
    assert_eq!(x.len(), m * inp, "matmul input length");
    assert!(ys.is_empty() || ws.len() == ys.len(), "bf16 matmul: one output per matrix");
    for (j, &(w, out)) in ws.iter().enumerate() {
        assert_eq!(w.len(), out.div_ceil(PANEL) * pairs(inp) * STEP, "packed weight length");
        if let Some(y) = ys.get(j) {
            assert_eq!(y.len(), m * out, "matmul output length");
        }
    }
}

/// The rows rounded to bf16, padded to whole chunks (`stride` pairs per row), and the values per
/// panel, `n`: what both entry points start from.
fn padded_rows(isa: Isa, x: &[f32], m: usize, inp: usize) -> (Vec<u32>, usize, usize) {
    let kp = pairs(inp);
    let stride = kp.next_multiple_of(CHUNK_PAIRS);
    (round_rows_padded(isa, x, m, inp, stride), stride, kp * STEP)
}

/// A task's tiles: the hardware's where `isa` allows [`Isa::AmxBf16`] and the CPU has it, else
/// the emulation (the same bits, slowly). Tile state is per thread: one per task.
fn task_tiles(isa: Isa) -> Bf16TileUnit {
    Bf16TileUnit::new(isa.or_scalar() >= Isa::AmxBf16)
}

/// `ys[j] = round_bf16(x) · Wⱼᵀ` for pair panels `ws` of one input width, on AMX-BF16 tiles
/// (`tdpbf16ps`'s order of sums, see [`crate::kernels::amx_bf16`]), or their emulation where
/// `isa` or the CPU rules the hardware out. Every row count takes this path for a weight packed
/// for tiles, so a row's bits do not depend on its batch.
pub(crate) fn run_many(
    isa: Isa,
    x: &[f32],
    m: usize,
    ws: &[(&[u16], usize)],
    inp: usize,
    ys: &mut [&mut [MaybeUninit<f32>]],
) {
    check_shapes(x, m, ws, inp, ys);
    let (xs, stride, n) = padded_rows(isa, x, m, inp);
    let cols: Vec<usize> = ws.iter().map(|&(_, out)| out).collect();
    by_panel_stripes_many(m, &cols, PANEL, 2, ys, |j, p0, p1, stripe: &mut Stripe| {
        let (w, mut t) = (ws[j].0, task_tiles(isa));
        let mut acc = Box::new([[[0f32; PANEL]; BLOCK_ROWS]; 2]);
        for p in (p0..p1).step_by(2) {
            let two = p + 1 < p1;
            let b0 = PanelChunks::new(&w[p * n..(p + 1) * n]);
            let b1 = two.then(|| PanelChunks::new(&w[(p + 1) * n..(p + 2) * n]));
            for r0 in (0..m).step_by(BLOCK_ROWS) {
                let rows = (m - r0).min(BLOCK_ROWS);
                block(&mut t, &xs, stride, r0..r0 + rows, [&b0, b1.as_ref().unwrap_or(&b0)], two, &mut acc);
                for (jj, a) in acc.iter().enumerate().take(1 + usize::from(two)) {
                    for (i, row) in a.iter().enumerate().take(rows) {
                        stripe.put(r0 + i, p + jj - p0, row);
                    }
                }
            }
        }
    });
}

/// `silu(x·gateᵀ) · (x·upᵀ)` into uninitialised `y` (every value written), a gate panel and
/// its up panel as one block's two operands, on tiles as [`run_many`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_gated(
    isa: Isa,
    x: &[f32],
    m: usize,
    gate: &[u16],
    up: &[u16],
    out: usize,
    inp: usize,
    y: &mut [MaybeUninit<f32>],
) {
    check_shapes(x, m, &[(gate, out), (up, out)], inp, &mut []);
    assert_eq!(y.len(), m * out, "matmul output length");
    let (xs, stride, n) = padded_rows(isa, x, m, inp);
    by_panel_stripes_many(m, &[out], PANEL, 1, &mut [y], |_, p0, p1, stripe: &mut Stripe| {
        let mut t = task_tiles(isa);
        let mut acc = Box::new([[[0f32; PANEL]; BLOCK_ROWS]; 2]);
        for p in p0..p1 {
            let (g, u) = (PanelChunks::new(&gate[p * n..(p + 1) * n]), PanelChunks::new(&up[p * n..(p + 1) * n]));
            for r0 in (0..m).step_by(BLOCK_ROWS) {
                let rows = (m - r0).min(BLOCK_ROWS);
                block(&mut t, &xs, stride, r0..r0 + rows, [&g, &u], true, &mut acc);
                let [g, u] = &*acc;
                let mut o = [[0f32; PANEL]; BLOCK_ROWS];
                let len = rows * PANEL;
                crate::kernels::rowwise::silu_mul_row(
                    &g.as_flattened()[..len],
                    &u.as_flattened()[..len],
                    &mut o.as_flattened_mut()[..len],
                );
                for (i, row) in o.iter().enumerate().take(rows) {
                    stripe.put(r0 + i, p - p0, row);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::{round_to_bf16, run_tiles_gated, run_tiles_many, to_pair_panels};
    use crate::kernels::amx_bf16::{hardware_available, tdp_lane};
    use crate::kernels::test_data as data;
    use crate::kernels::{written, Isa};
    use std::mem::MaybeUninit;

    fn bf16(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| round_to_bf16(x)).collect()
    }

    fn tiles(isa: Isa, x: &[f32], m: usize, ws: &[(&[u16], usize)], inp: usize) -> Vec<Vec<f32>> {
        let mut ys: Vec<Vec<MaybeUninit<f32>>> =
            ws.iter().map(|&(_, o)| vec![MaybeUninit::new(f32::NAN); m * o]).collect();
        let mut views: Vec<&mut [MaybeUninit<f32>]> = ys.iter_mut().map(|y| &mut y[..]).collect();
        run_tiles_many(isa, x, m, ws, inp, &mut views);
        ys.iter().map(|y| written(y)).collect()
    }

    /// The matmul from the row-major weight, chunk by chunk through [`tdp_lane`], the padding
    /// zeros written out: what the panels, the tiling and the padding must amount to.
    fn reference(x: &[f32], m: usize, w: &[u16], out: usize, inp: usize) -> Vec<f32> {
        let kp = inp.div_ceil(2).next_multiple_of(16);
        let at = |v: &[u16], k: usize| if k < inp { v[k] } else { 0 };
        let mut y = vec![0f32; m * out];
        for r in 0..m {
            let xr = bf16(&x[r * inp..(r + 1) * inp]);
            let a: Vec<u32> = (0..kp).map(|j| at(&xr, 2 * j) as u32 | (at(&xr, 2 * j + 1) as u32) << 16).collect();
            for o in 0..out {
                let wo = &w[o * inp..(o + 1) * inp];
                y[r * out + o] = (0..kp / 16).fold(0f32, |c, ch| {
                    // This column's 16 pairs as lane 0 of a chunk.
                    let mut b = vec![0u16; 512];
                    for j in 0..16 {
                        (b[j * 32], b[j * 32 + 1]) = (at(wo, 2 * (ch * 16 + j)), at(wo, 2 * (ch * 16 + j) + 1));
                    }
                    tdp_lane(c, &a[ch * 16..], &b, 0)
                });
            }
        }
        y
    }

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    #[test]
    fn emulated_tiles_are_the_reference() {
        // Widths: one whole chunk, a partial one (25 pairs), an odd width, several chunks;
        // rows: one, a partial block, a whole one, more than one block; a ragged last panel.
        for (inp, out) in [(32, 16), (50, 37), (97, 20), (544, 48)] {
            let w = bf16(&data(out * inp, inp as u32));
            let packed = to_pair_panels(&w, out, inp);
            for m in [1, 2, 17, 32, 40] {
                let x = data(m * inp, 3 + m as u32);
                let got = tiles(Isa::Scalar, &x, m, &[(&packed, out)], inp);
                let want = reference(&x, m, &w, out, inp);
                assert!(same(&got[0], &want), "in {inp} out {out} rows {m}");
            }
        }
    }

    #[test]
    fn many_and_gated_give_the_bits_of_single_calls() {
        let (inp, out, m) = (96, 40, 35);
        let (g, u) = (bf16(&data(out * inp, 5)), bf16(&data(out * inp, 6)));
        let (pg, pu) = (to_pair_panels(&g, out, inp), to_pair_panels(&u, out, inp));
        let x = data(m * inp, 9);
        let both = tiles(Isa::Scalar, &x, m, &[(&pg, out), (&pu, out)], inp);
        let (alone_g, alone_u) =
            (tiles(Isa::Scalar, &x, m, &[(&pg, out)], inp), tiles(Isa::Scalar, &x, m, &[(&pu, out)], inp));
        assert!(same(&both[0], &alone_g[0]) && same(&both[1], &alone_u[0]));
        let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
        run_tiles_gated(Isa::Scalar, &x, m, &pg, &pu, out, inp, &mut y);
        let mut want = vec![0f32; m * out];
        crate::kernels::rowwise::silu_mul_row(&alone_g[0], &alone_u[0], &mut want);
        assert!(same(&written(&y), &want), "gated");
    }

    /// Where the process has AMX-BF16 (and `FLINT_CPU_ISA` allows it), the hardware path
    /// against the emulation over the whole matmul.
    #[test]
    fn hardware_matmul_gives_the_emulated_bits() {
        if !(hardware_available() && Isa::AmxBf16.available()) {
            eprintln!("AMX-BF16 not in use here: the hardware matmul did not run");
            return;
        }
        for (inp, out) in [(50, 37), (896, 160), (4864, 64)] {
            let w = bf16(&data(out * inp, inp as u32));
            let packed = to_pair_panels(&w, out, inp);
            for m in [1, 3, 16, 17, 33, 64] {
                let x = data(m * inp, 11 + m as u32);
                let hw = tiles(Isa::AmxBf16, &x, m, &[(&packed, out)], inp);
                let emu = tiles(Isa::Scalar, &x, m, &[(&packed, out)], inp);
                assert!(same(&hw[0], &emu[0]), "in {inp} out {out} rows {m}");
            }
        }
        let (inp, out, m) = (896, 48, 20);
        let (g, u) = (
            to_pair_panels(&bf16(&data(out * inp, 1)), out, inp),
            to_pair_panels(&bf16(&data(out * inp, 2)), out, inp),
        );
        let x = data(m * inp, 4);
        let (mut a, mut b) = (vec![MaybeUninit::new(0f32); m * out], vec![MaybeUninit::new(0f32); m * out]);
        run_tiles_gated(Isa::AmxBf16, &x, m, &g, &u, out, inp, &mut a);
        run_tiles_gated(Isa::Scalar, &x, m, &g, &u, out, inp, &mut b);
        assert!(same(&written(&a), &written(&b)), "gated");
    }
}
