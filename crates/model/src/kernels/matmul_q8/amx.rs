//! The int8 matmul on AMX tiles, for two or more rows (prefill chunks, decode batches, draft
//! verification; one row stays on VNNI, which is faster for it).
//!
//! The packed weight needs no second copy: a panel block's values are laid out `[8 groups of 4
//! inputs][16 columns][4]`, which is `tdpbssd`'s B operand (8 rows of 64 bytes). Per panel,
//! every block is made signed once (the stored value minus the format's offset; the nibble
//! formats unpacked to a byte each: Q4_0, Q4_K low nibbles are groups 0–3, high nibbles 4–7;
//! Q6_K adds its top two bits) into 512 bytes that then serve every row. The activations are the
//! rows quantized as for VNNI, laid out per group of 32 rows and block ([`TileRows`]) so that an
//! A tile is 512 contiguous bytes.
//!
//! Per panel block the tiles compute the exact integer sums of up to 32 rows (two A tiles
//! sharing the B tile) × 16 columns (Q6_K: of each 16-input half, its scales cover 16 inputs).
//! With signed weights the sums are `isum − offset·Σx` already, the integer the other paths
//! form; they are folded in block order with the same f32 operations as every other path
//! ([`fold`](super::fold)'s, 16 columns per AVX-512 instruction): the same bits as scalar, VNNI
//! and AVX2, for any number of rows and any grouping of them.
//!
//! **Why it stays opt-in** (`FLINT_CPU_ISA=amx`, see `isa::DEFAULT_CAP`). Every 32-input block
//! has its own scales, so each block's 16×16 sums leave the tiles through memory
//! (`tilestored`) to be folded. Measured on a 2-core Sapphire Rapids-class Xeon
//! (`q8_tile_cost`, 2048×2048, 2 threads, 2026-12-04): a `tdpbssd` over K = 32 takes as long as
//! over K = 64 (about 5.3 ns each, one core, back to back), a block step of two products with
//! its loads and stores took 19–25 ns when its C buffers stayed in the L1 and 60–75 ns when
//! they rotated through 16–32 buffers, and the fold of 32 rows (one conversion, one multiply
//! and one FMA per row and 16 columns) did not overlap with the tile work. With the step
//! software-pipelined (a block's products are issued before the previous block is folded, into
//! alternating sets of C tiles), A tiles contiguous and the fold's scales per group contiguous,
//! 512 rows ran at 0.96–1.18× VNNI (Q8_0 1.08×, Q4_0 1.18×, Q4_K 0.96×, Q6_K 1.03×), and 16–64
//! rows at 0.6–0.9×: not worth a default. Before (one row group of 16, fold after each
//! product) it was 0.6–0.9× at 512 rows.
//!
//! Where 16 rows' time goes (Q4_K 1024×2048 in the L2, one thread, `perf` on 2026-12-06):
//! making the panel signed 27%, the tile instructions 35% (half of it on the `tilestored`s),
//! the fold 26%; VNNI took 211–226 µs a call against 244–317 here. Runs of four blocks, each
//! run folded after the next run's products were issued, were slower: 331–393 µs with the four
//! products issued before any of their sums were stored (tiles 0–7 all used: A in two, B in
//! two, C in four), 306–332 with one tile call a block.

use std::mem::MaybeUninit;

use super::{by_panel_stripes_many, fold, Format, PackedQ8, QuantRow, COLS, QK};
use crate::kernels::amx::{Int8Tiles, Sums, MAX_ROWS};
use crate::kernels::Stripe;

/// A block's B operand: 8 rows of 64 bytes.
const B_BYTES: usize = 8 * 64;

/// Up to [`MAX_ROWS`] rows' outputs for one panel's 16 columns.
type Acc = [[f32; COLS]; MAX_ROWS];

/// The rows as the tiles and the fold read them, per group of up to [`MAX_ROWS`] rows (group
/// `g` from value `g · 32 · in` and scale `g · 32 · in / 32`), per block, the group's rows one
/// after another: their 32 values (an A tile then loads 512 contiguous bytes; read straight
/// from `[m][in]` rows, its 16 rows `in` bytes apart fell into two or three cache sets and
/// missed the L1), their scales `d` and their `d · Σq` (Q4_K's minimum term).
struct TileRows {
    q: Vec<i8>,
    d: Vec<f32>,
    dsum: Vec<f32>,
}

impl TileRows {
    fn new(rows: &[QuantRow], inp: usize) -> Self {
        let (m, nb) = (rows.len(), inp / QK);
        let mut t = TileRows {
            q: Vec::with_capacity(m * inp),
            d: Vec::with_capacity(m * nb),
            dsum: Vec::with_capacity(m * nb),
        };
        for group in rows.chunks(MAX_ROWS) {
            for b in 0..nb {
                for r in group {
                    t.q.extend_from_slice(&r.q[b * QK..(b + 1) * QK]);
                    t.d.push(r.d[b]);
                    t.dsum.push(r.dsum[b]);
                }
            }
        }
        t
    }

    /// Rows `r0..r1` (one group) of an `in`-wide input.
    fn group(&self, r0: usize, r1: usize, inp: usize) -> (&[i8], &[f32], &[f32]) {
        let nb = inp / QK;
        (&self.q[r0 * inp..r1 * inp], &self.d[r0 * nb..r1 * nb], &self.dsum[r0 * nb..r1 * nb])
    }
}

/// What a task reuses from panel to panel: the panel's B operands (two for the gated form), and
/// the tile sums of two blocks in flight (Q6_K: of each 16-input half).
struct Scratch {
    b: [Vec<i8>; 2],
    lo: Box<[Sums; 2]>,
    hi: Box<[Sums; 2]>,
}

impl Scratch {
    fn new() -> Self {
        let sums = || Box::new([[[0i32; 16]; MAX_ROWS]; 2]);
        Scratch { b: [Vec::new(), Vec::new()], lo: sums(), hi: sums() }
    }
}

/// Every block of one panel as the tiles' B operand, signed (the stored value minus the
/// format's offset), into `out`: unpacked once per panel, then read by every row group.
fn signed_panel(w: &PackedQ8, panel: &[u8], nb: usize, out: &mut Vec<i8>) {
    out.resize(nb * B_BYTES, 0);
    for (b, dst) in out.chunks_exact_mut(B_BYTES).enumerate() {
        let base = w.format.block_at(b);
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::Isa::Avx512.available() {
            // SAFETY: AVX-512 F/BW are available; `panel` holds the block at `base` (the values
            // and, for Q6_K, the 128 bytes of top bits after them); `dst` is 512 bytes.
            unsafe { signed_block_avx512(w.format, &panel[base..base + w.format.values()], dst) };
            continue;
        }
        signed_block_scalar(w, panel, base, dst);
    }
}

/// The reference: each layout entry as [`PackedQ8::stored`] reads it, minus the offset (which
/// makes Q8_0's 0..=255 a signed byte again, and leaves the 4- and 6-bit values in range).
fn signed_block_scalar(w: &PackedQ8, panel: &[u8], base: usize, out: &mut [i8]) {
    for (e, o) in out.iter_mut().enumerate() {
        *o = (w.stored(panel, base, e) - w.format.offset()) as i8;
    }
}

/// Q8_0: 512 stored bytes; the nibble formats: 256 bytes of nibbles (entry `j` low, `j + 256`
/// high), then for Q6_K 128 bytes of top bits (entry `e`'s at byte `(e / 256)·64 + e % 64`,
/// shift `2·((e / 64) % 4)`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn signed_block_avx512(format: Format, vals: &[u8], out: &mut [i8]) {
    use std::arch::x86_64::*;
    assert!(vals.len() >= format.values() && out.len() >= B_BYTES, "amx: one block");
    let offset = _mm512_set1_epi8(format.offset() as u8 as i8);
    // SAFETY (every load and store): `vals` holds the block's values (checked above), `out` 512
    // bytes.
    if format == Format::Q8_0 {
        for r in 0..8 {
            unsafe {
                let v = _mm512_loadu_si512(vals.as_ptr().add(r * 64).cast());
                _mm512_storeu_si512(out.as_mut_ptr().add(r * 64).cast(), _mm512_sub_epi8(v, offset));
            }
        }
        return;
    }
    let nib = _mm512_set1_epi8(0x0F);
    for r in 0..4 {
        unsafe {
            let v = _mm512_loadu_si512(vals.as_ptr().add(r * 64).cast());
            let mut lo = _mm512_and_si512(v, nib);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
            if format == Format::Q6_K {
                let three = _mm512_set1_epi8(3);
                let h0 = _mm512_loadu_si512(vals.as_ptr().add(256).cast());
                let h1 = _mm512_loadu_si512(vals.as_ptr().add(320).cast());
                let shift = _mm_cvtsi32_si128(2 * r as i32);
                let top = |h: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srl_epi16(h, shift), three));
                lo = _mm512_or_si512(lo, top(h0));
                hi = _mm512_or_si512(hi, top(h1));
            }
            _mm512_storeu_si512(out.as_mut_ptr().add(r * 64).cast(), _mm512_sub_epi8(lo, offset));
            _mm512_storeu_si512(out.as_mut_ptr().add(256 + r * 64).cast(), _mm512_sub_epi8(hi, offset));
        }
    }
}

/// Up to [`MAX_ROWS`] rows of one panel: `rows`, and their values `a`, scales `d` and `dsum`
/// as [`TileRows::group`] gives them, against the panel (for its scales) and its signed B
/// operands `bs`.
struct RowGroup<'a> {
    w: &'a PackedQ8,
    rows: &'a [QuantRow],
    a: &'a [i8],
    d: &'a [f32],
    dsum: &'a [f32],
    inp: usize,
    panel: &'a [u8],
    bs: &'a [i8],
}

/// [`tile_generic`] with the AVX-512 fold where the CPU has AVX-512 (every AMX CPU does), else
/// with [`fold`] value by value; the choice is made once per tile, not per block.
fn tile<T: Int8Tiles>(t: &mut T, g: &RowGroup, lo: &mut [Sums; 2], hi: &mut [Sums; 2], acc: &mut Acc) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::Isa::Avx512.available() {
        // SAFETY: AVX-512 F/BW and FMA are available (every AVX-512 CPU has FMA).
        return unsafe { tile_avx512(t, g, lo, hi, acc) };
    }
    tile_generic(t, g, lo, hi, acc, false)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn tile_avx512<T: Int8Tiles>(t: &mut T, g: &RowGroup, lo: &mut [Sums; 2], hi: &mut [Sums; 2], acc: &mut Acc) {
    tile_generic(t, g, lo, hi, acc, true)
}

/// Sets `acc[r][c]` to column `c` of the group's panel for its row `r` (rows past the group's
/// are left as they are); `avx512` (set only by [`tile_avx512`]) folds each block with
/// [`fold_block_avx512`].
///
/// Software-pipelined: block `b`'s tile products are issued (into `lo[b % 2]`, `hi[b % 2]`, C
/// tile set `b % 2`) before block `b − 1`'s sums are folded, so a product need not wait for the
/// previous block's sums to be stored (the tile unit and the fold overlapped little when
/// measured); the folds still run in block order, so the bits are unchanged.
#[inline(always)]
fn tile_generic<T: Int8Tiles>(
    t: &mut T,
    g: &RowGroup,
    lo: &mut [Sums; 2],
    hi: &mut [Sums; 2],
    acc: &mut Acc,
    avx512: bool,
) {
    let RowGroup { w, rows, a, d, dsum, inp, panel, bs } = *g;
    let (m, f, nb) = (rows.len(), w.format, inp / QK);
    assert!(
        (1..=MAX_ROWS).contains(&m)
            && a.len() >= m * inp
            && d.len() >= m * nb
            && dsum.len() >= m * nb
            && bs.len() >= nb * B_BYTES,
        "amx tile: rows, values and B operands"
    );
    for r in acc.iter_mut().take(m) {
        *r = [0.0; COLS];
    }
    // Q6_K's scales cover 16 inputs: two K-slices of 16 per block, into the two sets of C.
    t.configure(m, if f == Format::Q6_K { 16 } else { QK });
    // One pass more than there are blocks: the last folds the last block. (One call site for
    // each step, so that the fold inlines into the AVX-512 caller.)
    for b in 0..=nb {
        let [lo0, lo1] = &mut *lo;
        let [hi0, hi1] = &mut *hi;
        let ((lo_now, lo_prev), (hi_now, hi_prev)) =
            if b % 2 == 0 { ((lo0, &*lo1), (hi0, &*hi1)) } else { ((lo1, &*lo0), (hi1, &*hi0)) };
        if b < nb {
            let (ab, bt) = (a[b * QK * m..].as_ptr(), bs[b * B_BYTES..].as_ptr());
            // SAFETY: `a` holds `m` rows of 32 values per block ([`TileRows`]), `bs` block `b`'s
            // 512 bytes, whose first 256 are the first 16 inputs (checked above); `t` is
            // configured for `m` rows and this format's K.
            unsafe {
                if f == Format::Q6_K {
                    t.dot(ab, QK, bt, lo_now, 0);
                    t.dot(ab.add(16), QK, bt.add(B_BYTES / 2), hi_now, 1);
                } else {
                    t.dot(ab, QK, bt, lo_now, b % 2);
                }
            }
        }
        if b == 0 {
            continue;
        }
        let p = b - 1;
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            let (d, dsum) = (&d[p * m..(p + 1) * m], &dsum[p * m..(p + 1) * m]);
            // SAFETY: `avx512` is set only inside `tile_avx512`, which runs with AVX-512 F.
            unsafe { fold_block_avx512(f, panel, p, d, dsum, lo_prev, hi_prev, acc) };
            continue;
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = avx512; // only x86 has the AVX-512 fold
        fold_block_scalar(f, panel, p, rows, lo_prev, hi_prev, acc);
    }
}

/// [`fold`] for each row and column of a block, from the tiles' signed sums (`lo` over the
/// first 16 inputs for Q6_K, else over all 32; `hi` Q6_K's second half): [`fold`] takes the
/// stored values' sums, which are the signed ones plus the offset's share.
fn fold_block_scalar(f: Format, panel: &[u8], b: usize, rows: &[QuantRow], lo: &Sums, hi: &Sums, acc: &mut Acc) {
    for (r, row) in rows.iter().enumerate() {
        let (sum, half) = (row.sum[b], row.half[b]);
        for c in 0..COLS {
            let isum = match f {
                Format::Q6_K => [lo[r][c] + 32 * half, hi[r][c] + 32 * (sum - half)],
                _ => [lo[r][c] + f.offset() * sum, 0],
            };
            fold(f, panel, b, c, isum, row, &mut acc[r][c]);
        }
    }
}

/// [`fold`] for 16 columns per instruction: the scales are read once per block instead of once
/// per row and column, and each lane does [`fold`]'s operations in its order (the VNNI tile's
/// fold, on the signed sums read from the stored C tiles: `isum − offset·Σx` is what the tiles
/// summed).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)] // one block of one group: what `fold` reads, 16 lanes wide
unsafe fn fold_block_avx512(
    f: Format,
    panel: &[u8],
    b: usize,
    d: &[f32],
    dsum: &[f32],
    lo: &Sums,
    hi: &Sums,
    acc: &mut Acc,
) {
    use std::arch::x86_64::*;
    let (head, meta) = (f.header_at(b), f.block_at(b) + f.values());
    assert!(meta + f.meta() <= panel.len() && head + 4 * COLS <= panel.len(), "amx fold: block inside the panel");
    // SAFETY (every load below): `meta` has the block's scales after it (Q4_K 24 bytes, else 32),
    // and `head` the super-block's 64 (Q4_K) or 32 (Q6_K) bytes of f16 scales, inside `panel`
    // (checked above); `lo`, `hi` and `acc` rows are 16 values each.
    let p = panel.as_ptr();
    let sums = |v: &[i32; 16]| unsafe { _mm512_cvtepi32_ps(_mm512_loadu_si512(v.as_ptr().cast())) };
    let f16x16 = |at: usize| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.add(at).cast())) };
    let bytes = |at: usize| unsafe { _mm_loadu_si128(p.add(at).cast()) };
    // The weight side of the scale, once per block: Q8_0/Q4_0 `dw`; Q4_K `sc · d` and `m · −dmin`
    // (−dmin exactly: a sign flip, as `-dmin` in `fold`); Q6_K `sc · d` of each 16-input half.
    let (w0, w1) = match f {
        Format::Q8_0 | Format::Q4_0 => (f16x16(meta), _mm512_setzero_ps()),
        Format::Q4_K => {
            // SAFETY: as above.
            let (sc, m) = unsafe { super::x86::q4k_meta(p.add(meta)) };
            let (sc, m) = (_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
            let dmin = _mm512_castps_si512(f16x16(head + 2 * COLS));
            let nmin = _mm512_castsi512_ps(_mm512_xor_si512(dmin, _mm512_set1_epi32(i32::MIN)));
            (_mm512_mul_ps(sc, f16x16(head)), _mm512_mul_ps(m, nmin))
        }
        Format::Q6_K => {
            let d = f16x16(head);
            let s0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(meta)));
            let s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(meta + COLS)));
            (_mm512_mul_ps(s0, d), _mm512_mul_ps(s1, d))
        }
    };
    assert!(d.len() == dsum.len() && d.len() <= MAX_ROWS, "amx fold: one group's scales");
    for (r, (&dx, &ds)) in d.iter().zip(dsum).enumerate() {
        let xs = _mm512_set1_ps(dx);
        let a = unsafe { _mm512_loadu_ps(acc[r].as_ptr()) };
        let a = match f {
            // a += e · (dw · dx)
            Format::Q8_0 | Format::Q4_0 => _mm512_fmadd_ps(sums(&lo[r]), _mm512_mul_ps(w0, xs), a),
            // a += isum · ((sc · d) · dx); a += (m · −dmin) · (dx · Σx)
            Format::Q4_K => {
                let a = _mm512_fmadd_ps(sums(&lo[r]), _mm512_mul_ps(w0, xs), a);
                _mm512_fmadd_ps(w1, _mm512_set1_ps(ds), a)
            }
            // Per half: a += e · ((sc · d) · dx)
            Format::Q6_K => {
                let a = _mm512_fmadd_ps(sums(&lo[r]), _mm512_mul_ps(w0, xs), a);
                _mm512_fmadd_ps(sums(&hi[r]), _mm512_mul_ps(w1, xs), a)
            }
        };
        unsafe { _mm512_storeu_ps(acc[r].as_mut_ptr(), a) };
    }
}

/// `ys[j] = x·ws[j]ᵀ` for rows already quantized (`rows`), on the tiles `new_tiles` makes (one
/// per task: tile state is per thread).
pub(super) fn run<T: Int8Tiles>(
    new_tiles: &(impl Fn() -> T + Sync),
    rows: &[QuantRow],
    ws: &[&PackedQ8],
    ys: &mut [&mut [MaybeUninit<f32>]],
) {
    let (m, inp) = (rows.len(), ws[0].inp);
    let tr = TileRows::new(rows, inp);
    let cols: Vec<usize> = ws.iter().map(|w| w.out).collect();
    by_panel_stripes_many(m, &cols, COLS, 1, ys, |j, p0, p1, stripe| {
        let (w, mut t, mut s) = (ws[j], new_tiles(), Scratch::new());
        let mut acc = [[0f32; COLS]; MAX_ROWS];
        let (nb, panel_bytes) = (inp / QK, w.format.panel_bytes(inp / QK));
        // Panels outside, row groups inside: a panel is unpacked once and stays in cache for
        // every row, and the weights stream from memory once per call.
        for p in p0..p1 {
            let panel = &w.data[p * panel_bytes..(p + 1) * panel_bytes];
            signed_panel(w, panel, nb, &mut s.b[0]);
            for_row_groups(&mut t, m, |t, r0, r1| {
                let (a, d, dsum) = tr.group(r0, r1, inp);
                let g = RowGroup { w, rows: &rows[r0..r1], a, d, dsum, inp, panel, bs: &s.b[0] };
                tile(t, &g, &mut s.lo, &mut s.hi, &mut acc);
                put(stripe, r0, r1, p - p0, &acc);
            });
        }
    });
}

/// `silu(x·gateᵀ) · (x·upᵀ)` for rows already quantized, as [`super::matmul_gated_uninit`].
pub(super) fn gated<T: Int8Tiles>(
    new_tiles: &(impl Fn() -> T + Sync),
    rows: &[QuantRow],
    gate: &PackedQ8,
    up: &PackedQ8,
    y: &mut [MaybeUninit<f32>],
) {
    let (m, inp) = (rows.len(), gate.inp);
    let tr = TileRows::new(rows, inp);
    let nb = inp / QK;
    let (gb, ub) = (gate.format.panel_bytes(nb), up.format.panel_bytes(nb));
    by_panel_stripes_many(m, &[gate.out], COLS, 1, &mut [y], |_, p0, p1, stripe| {
        let (mut t, mut s) = (new_tiles(), Scratch::new());
        let (mut g, mut u) = ([[0f32; COLS]; MAX_ROWS], [[0f32; COLS]; MAX_ROWS]);
        for p in p0..p1 {
            let (gp, upn) = (&gate.data[p * gb..(p + 1) * gb], &up.data[p * ub..(p + 1) * ub]);
            let [bg, bu] = &mut s.b;
            signed_panel(gate, gp, nb, bg);
            signed_panel(up, upn, nb, bu);
            for_row_groups(&mut t, m, |t, r0, r1| {
                let (rows, (a, d, dsum)) = (&rows[r0..r1], tr.group(r0, r1, inp));
                let gg = RowGroup { w: gate, rows, a, d, dsum, inp, panel: gp, bs: bg };
                tile(t, &gg, &mut s.lo, &mut s.hi, &mut g);
                let ug = RowGroup { w: up, rows, a, d, dsum, inp, panel: upn, bs: bu };
                tile(t, &ug, &mut s.lo, &mut s.hi, &mut u);
                for (i, (g, u)) in g.iter().zip(&u).enumerate().take(r1 - r0) {
                    let mut o = [0f32; COLS];
                    crate::kernels::rowwise::silu_mul_row(g, u, &mut o);
                    stripe.put(r0 + i, p - p0, &o);
                }
            });
        }
    });
}

/// Groups of up to [`MAX_ROWS`] rows (the tile configures itself for its group's size and
/// format; a configuration is loaded only when they change).
fn for_row_groups<T: Int8Tiles>(t: &mut T, m: usize, mut each: impl FnMut(&mut T, usize, usize)) {
    for r0 in (0..m).step_by(MAX_ROWS) {
        each(t, r0, (r0 + MAX_ROWS).min(m));
    }
}

fn put(stripe: &mut Stripe, r0: usize, r1: usize, panel: usize, acc: &Acc) {
    for (i, a) in acc.iter().enumerate().take(r1 - r0) {
        stripe.put(r0 + i, panel, a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::amx::EmulatedTiles;

    #[test]
    fn simd_unpacking_is_the_reference() {
        if !crate::kernels::Isa::Avx512.available() {
            eprintln!("skipped: no AVX-512 here");
            return;
        }
        for (fi, format) in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K].into_iter().enumerate() {
            let w = super::super::tests::random_packed(format, 32, 512, 7 + fi as u32);
            let nb = 512 / QK;
            let panel_bytes = format.panel_bytes(nb);
            for p in 0..2 {
                let panel = &w.data[p * panel_bytes..(p + 1) * panel_bytes];
                let mut got = Vec::new();
                signed_panel(&w, panel, nb, &mut got);
                for b in 0..nb {
                    let mut want = [0i8; B_BYTES];
                    signed_block_scalar(&w, panel, format.block_at(b), &mut want);
                    assert_eq!(want[..], got[b * B_BYTES..(b + 1) * B_BYTES], "{format:?} panel {p} block {b}");
                }
            }
        }
    }

    /// Every format, row counts 1–67 (one and two A tiles, partial groups of 32 and ragged
    /// last panels), input widths of 1 to 17 blocks (odd counts: not a multiple of any tile's K),
    /// several matrices sharing one call, and the gated form, on the tiles `new_tiles` makes.
    fn tiles_give_the_scalar_bits<T: Int8Tiles>(new_tiles: &(impl Fn() -> T + Sync)) {
        let mut seed = 3u32;
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let widths: &[usize] =
                if matches!(format, Format::Q4_K | Format::Q6_K) { &[256, 768] } else { &[32, 96, 544] };
            for &inp in widths {
                for m in [1, 2, 3, 15, 16, 17, 31, 32, 33, 67] {
                    seed += 1;
                    let out = 16 * (1 + seed as usize % 3) + seed as usize % 7;
                    let x = super::super::tests::random_x(m * inp, seed);
                    let w1 = super::super::tests::random_packed(format, out, inp, seed);
                    let w2 = super::super::tests::random_packed(format, out, inp, seed + 99);
                    let mut want1 = vec![0f32; m * out];
                    let mut want2 = vec![0f32; m * out];
                    super::super::matmul_with(crate::kernels::Isa::Scalar, &x, m, &w1, &mut want1);
                    super::super::matmul_with(crate::kernels::Isa::Scalar, &x, m, &w2, &mut want2);
                    let rows = super::super::quantize_rows(crate::kernels::Isa::Scalar, &x, m, inp);
                    let (mut y1, mut y2) = (vec![0f32; m * out], vec![0f32; m * out]);
                    let mut ys = [crate::kernels::as_uninit(&mut y1), crate::kernels::as_uninit(&mut y2)];
                    run(new_tiles, &rows, &[&w1, &w2], &mut ys);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&y1), bits(&want1), "{format:?} in {inp} out {out} rows {m}");
                    assert_eq!(bits(&y2), bits(&want2), "{format:?} in {inp} out {out} rows {m}, second matrix");
                    let mut want_g = vec![0f32; m * out];
                    super::super::gated_with(
                        crate::kernels::Isa::Scalar,
                        &x,
                        m,
                        &w1,
                        &w2,
                        crate::kernels::as_uninit(&mut want_g),
                    );
                    let mut g = vec![0f32; m * out];
                    gated(new_tiles, &rows, &w1, &w2, crate::kernels::as_uninit(&mut g));
                    assert_eq!(bits(&g), bits(&want_g), "{format:?} gated, in {inp} out {out} rows {m}");
                }
            }
        }
    }

    #[test]
    fn emulated_tiles_give_the_scalar_bits() {
        tiles_give_the_scalar_bits(&EmulatedTiles::default);
    }

    /// The same on the hardware tiles, where this CPU lets the process use them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hardware_tiles_give_the_scalar_bits() {
        if crate::kernels::amx::HardwareTiles::new().is_none() {
            eprintln!("skipped: no usable AMX tiles here ({})", crate::kernels::amx::status().describe());
            return;
        }
        let tiles = || crate::kernels::amx::HardwareTiles::new().expect("usable above");
        tiles_give_the_scalar_bits(&tiles);
    }
}
