//! The int8 matmul on AMX tiles, for two or more rows (prefill chunks, decode batches, draft
//! verification; one row stays on VNNI, which is faster for it).
//!
//! The packed weight needs no second copy: a panel block's values are already laid out
//! `[8 groups of 4 inputs][16 columns][4]`, which is `tdpbsud`'s B operand (8 rows of 64 bytes)
//! for Q8_0 as stored; the nibble formats are unpacked into that layout per block (Q4_0, Q4_K:
//! low nibbles are groups 0–3, high nibbles groups 4–7; Q6_K adds its top two bits), 512 bytes
//! that then serve 16 rows. The activations are the rows quantized as for VNNI, copied once into
//! one `[m][in]` array for the A tiles.
//!
//! Per panel block the tile computes the exact integer sums of up to 16 rows × 16 columns
//! (Q6_K: of each 16-input half, its scales cover 16 inputs), and they are folded in block order
//! with the same f32 operations as every other path ([`fold`](super::fold)'s, 16 columns per
//! AVX-512 instruction): the same bits as scalar, VNNI and AVX2, for any number of rows and any
//! grouping of them. On a Sapphire Rapids-class Xeon this path ran pp512 about 20× slower than
//! VNNI with the fold one value at a time, and at 0.6–0.9× VNNI with it vectorised, when row
//! groups were the outer loop (each 16 rows streamed the weights from memory again; panels are
//! outside now, as in the VNNI path, unmeasured on tiles). So it runs only under
//! `FLINT_CPU_ISA=amx` (`isa::DEFAULT_CAP`).

use std::mem::MaybeUninit;

use super::{by_panel_stripes_many, fold, Format, PackedQ8, QuantRow, COLS, QK};
use crate::kernels::amx::{Int8Tiles, MAX_ROWS};
use crate::kernels::Stripe;

/// A block's B operand: 8 rows of 64 bytes.
const B_BYTES: usize = 8 * 64;

/// The rows' quantized values, one after another (`[m][in]`): the A tiles read them with a
/// stride of `in` bytes.
fn contiguous(rows: &[QuantRow]) -> Vec<i8> {
    rows.iter().flat_map(|r| r.q.iter().copied()).collect()
}

/// Panel block `b`'s weights as `tdpbsud` reads them: stored values in the VNNI layout.
fn b_operand<'a>(w: &PackedQ8, panel: &'a [u8], b: usize, scratch: &'a mut [u8; B_BYTES]) -> &'a [u8] {
    let base = w.format.block_at(b);
    if w.format == Format::Q8_0 {
        return &panel[base..base + B_BYTES];
    }
    unpack(w, panel, base, scratch);
    scratch
}

/// The nibble formats' values of the block at `base`, unpacked to a byte each.
fn unpack(w: &PackedQ8, panel: &[u8], base: usize, out: &mut [u8; B_BYTES]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::Isa::Avx512.available() {
        // SAFETY: AVX-512 F/BW are available; `panel` holds the block at `base` (the values
        // and, for Q6_K, the 128 bytes of top bits after them).
        unsafe { unpack_avx512(w.format, &panel[base..base + w.format.values()], out) };
        return;
    }
    unpack_scalar(w, panel, base, out);
}

/// The reference unpacking: each layout entry as [`PackedQ8::stored`] reads it.
fn unpack_scalar(w: &PackedQ8, panel: &[u8], base: usize, out: &mut [u8; B_BYTES]) {
    for (e, o) in out.iter_mut().enumerate() {
        *o = w.stored(panel, base, e) as u8;
    }
}

/// 256 bytes of nibbles (entry `j` low, `j + 256` high), then for Q6_K 128 bytes of top bits
/// (entry `e`'s at byte `(e / 256)·64 + e % 64`, shift `2·((e / 64) % 4)`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack_avx512(format: Format, vals: &[u8], out: &mut [u8; B_BYTES]) {
    use std::arch::x86_64::*;
    let nib = _mm512_set1_epi8(0x0F);
    for r in 0..4 {
        // SAFETY: `vals` holds 256 bytes of nibbles; `out` 512 bytes.
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
            _mm512_storeu_si512(out.as_mut_ptr().add(r * 64).cast(), lo);
            _mm512_storeu_si512(out.as_mut_ptr().add(256 + r * 64).cast(), hi);
        }
    }
}

/// Up to 16 rows of one panel: `rows`, whose values start at `a` with a stride of `inp`.
struct RowGroup<'a> {
    w: &'a PackedQ8,
    rows: &'a [QuantRow],
    a: &'a [i8],
    inp: usize,
    panel: &'a [u8],
}

/// [`tile_generic`] with the AVX-512 fold where the CPU has AVX-512 (every AMX CPU does), else
/// with [`fold`] value by value; the choice is made once per tile, not per block.
fn tile<T: Int8Tiles>(t: &mut T, g: &RowGroup, acc: &mut [[f32; COLS]; MAX_ROWS]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::Isa::Avx512.available() {
        // SAFETY: AVX-512 F/BW and FMA are available (every AVX-512 CPU has FMA).
        return unsafe { tile_avx512(t, g, acc) };
    }
    tile_generic(t, g, acc, false)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma")]
unsafe fn tile_avx512<T: Int8Tiles>(t: &mut T, g: &RowGroup, acc: &mut [[f32; COLS]; MAX_ROWS]) {
    tile_generic(t, g, acc, true)
}

/// `acc[r][c]`: column `c` of the group's panel for its row `r`; `avx512` (set only by
/// [`tile_avx512`]) folds each block with [`fold_block_avx512`].
#[inline(always)]
fn tile_generic<T: Int8Tiles>(t: &mut T, g: &RowGroup, acc: &mut [[f32; COLS]; MAX_ROWS], avx512: bool) {
    let RowGroup { w, rows, a, inp, panel } = *g;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx512; // only x86 has the AVX-512 fold
    let (m, f) = (rows.len(), w.format);
    assert!(m <= MAX_ROWS && a.len() >= (m - 1) * inp + inp, "amx tile: rows and values");
    let mut scratch = [0u8; B_BYTES];
    let (mut lo, mut hi) = ([[0i32; 16]; MAX_ROWS], [[0i32; 16]; MAX_ROWS]);
    for b in 0..inp / QK {
        let bt = b_operand(w, panel, b, &mut scratch);
        let ab = a[b * QK..].as_ptr();
        // SAFETY: `a` holds `m` rows of `inp` values from `b · 32` on (checked above); `bt` is
        // 8 rows of 64 bytes, whose first 4 are the first 16 inputs; `t` is configured for `m`.
        unsafe {
            if f == Format::Q6_K {
                t.dot(ab, inp, bt.as_ptr(), 16, &mut lo);
                t.dot(ab.add(16), inp, bt[256..].as_ptr(), 16, &mut hi);
            } else {
                t.dot(ab, inp, bt.as_ptr(), QK, &mut lo);
            }
        }
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: `avx512` is set only inside `tile_avx512`, which runs with AVX-512 F.
            unsafe { fold_block_avx512(f, panel, b, rows, &lo, &hi, acc) };
            continue;
        }
        for (r, row) in rows.iter().enumerate() {
            for c in 0..COLS {
                let isum = if f == Format::Q6_K { [lo[r][c], hi[r][c]] } else { [lo[r][c], 0] };
                fold(f, panel, b, c, isum, row, &mut acc[r][c]);
            }
        }
    }
}

/// [`fold`] for 16 columns per instruction: the scales are read once per block instead of once
/// per row and column, and each lane does [`fold`]'s operations in its order (the VNNI tile's
/// fold, on sums read from the stored C tile).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fold_block_avx512(
    f: Format,
    panel: &[u8],
    b: usize,
    rows: &[QuantRow],
    lo: &[[i32; 16]; MAX_ROWS],
    hi: &[[i32; 16]; MAX_ROWS],
    acc: &mut [[f32; COLS]; MAX_ROWS],
) {
    use std::arch::x86_64::*;
    let (head, meta) = (f.header_at(b), f.block_at(b) + f.values());
    assert!(meta + 2 * COLS <= panel.len() && head + 4 * COLS <= panel.len(), "amx fold: block inside the panel");
    // SAFETY (every load below): `meta` has the block's 32 bytes of scales after it and `head` the
    // super-block's 64 (Q4_K) or 32 (Q6_K) bytes of f16 scales, inside `panel` (checked above);
    // `lo`, `hi` and `acc` rows are 16 values each.
    let p = panel.as_ptr();
    let sums = |v: &[i32; 16]| unsafe { _mm512_loadu_si512(v.as_ptr().cast()) };
    let f16x16 = |at: usize| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.add(at).cast())) };
    let bytes = |at: usize| unsafe { _mm_loadu_si128(p.add(at).cast()) };
    // The weight side of the scale, once per block: Q8_0/Q4_0 `dw`; Q4_K `sc · d` and `m · −dmin`
    // (−dmin exactly: a sign flip, as `-dmin` in `fold`); Q6_K `sc · d` of each 16-input half.
    let (w0, w1) = match f {
        Format::Q8_0 | Format::Q4_0 => (f16x16(meta), _mm512_setzero_ps()),
        Format::Q4_K => {
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(meta)));
            let m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(meta + COLS)));
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
    for (r, row) in rows.iter().enumerate() {
        let (x, sum, half) = (row.d[b], row.sum[b], row.half[b]);
        let xs = _mm512_set1_ps(x);
        let a = unsafe { _mm512_loadu_ps(acc[r].as_ptr()) };
        let a = match f {
            // e = isum − offset·Σx; a += e · (dw · dx)
            Format::Q8_0 | Format::Q4_0 => {
                let e = _mm512_sub_epi32(sums(&lo[r]), _mm512_set1_epi32(f.offset() * sum));
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), _mm512_mul_ps(w0, xs), a)
            }
            // a += isum · ((sc · d) · dx); a += (m · −dmin) · (dx · Σx)
            Format::Q4_K => {
                let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums(&lo[r])), _mm512_mul_ps(w0, xs), a);
                _mm512_fmadd_ps(w1, _mm512_set1_ps(row.dsum[b]), a)
            }
            // Per half: e = isum − 32·Σx(half); a += e · ((sc · d) · dx)
            Format::Q6_K => {
                let e0 = _mm512_sub_epi32(sums(&lo[r]), _mm512_set1_epi32(32 * half));
                let e1 = _mm512_sub_epi32(sums(&hi[r]), _mm512_set1_epi32(32 * (sum - half)));
                let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e0), _mm512_mul_ps(w0, xs), a);
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(e1), _mm512_mul_ps(w1, xs), a)
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
    let a = contiguous(rows);
    let cols: Vec<usize> = ws.iter().map(|w| w.out).collect();
    by_panel_stripes_many(m, &cols, COLS, 1, ys, |j, p0, p1, stripe| {
        let (w, mut t) = (ws[j], new_tiles());
        let panel_bytes = w.format.panel_bytes(inp / QK);
        // Panels outside, row groups inside: a panel stays in cache for every row, and the
        // weights stream from memory once per call.
        for p in p0..p1 {
            let panel = &w.data[p * panel_bytes..(p + 1) * panel_bytes];
            for_row_groups(&mut t, m, |t, r0, r1| {
                let mut acc = [[0f32; COLS]; MAX_ROWS];
                let g = RowGroup { w, rows: &rows[r0..r1], a: &a[r0 * inp..r1 * inp], inp, panel };
                tile(t, &g, &mut acc);
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
    let a = contiguous(rows);
    let nb = inp / QK;
    let (gb, ub) = (gate.format.panel_bytes(nb), up.format.panel_bytes(nb));
    by_panel_stripes_many(m, &[gate.out], COLS, 1, &mut [y], |_, p0, p1, stripe| {
        let mut t = new_tiles();
        for p in p0..p1 {
            let (gp, upn) = (&gate.data[p * gb..(p + 1) * gb], &up.data[p * ub..(p + 1) * ub]);
            for_row_groups(&mut t, m, |t, r0, r1| {
                let (mut g, mut u) = ([[0f32; COLS]; MAX_ROWS], [[0f32; COLS]; MAX_ROWS]);
                let (rs, ar) = (&rows[r0..r1], &a[r0 * inp..r1 * inp]);
                tile(t, &RowGroup { w: gate, rows: rs, a: ar, inp, panel: gp }, &mut g);
                tile(t, &RowGroup { w: up, rows: rs, a: ar, inp, panel: upn }, &mut u);
                for (i, (g, u)) in g.iter().zip(&u).enumerate().take(r1 - r0) {
                    let mut o = [0f32; COLS];
                    crate::kernels::rowwise::silu_mul_row(g, u, &mut o);
                    stripe.put(r0 + i, p - p0, &o);
                }
            });
        }
    });
}

/// Groups of up to 16 rows, each with the tiles configured for its size (a configuration is
/// loaded only when the size changes).
fn for_row_groups<T: Int8Tiles>(t: &mut T, m: usize, mut each: impl FnMut(&mut T, usize, usize)) {
    for r0 in (0..m).step_by(MAX_ROWS) {
        let r1 = (r0 + MAX_ROWS).min(m);
        t.configure(r1 - r0);
        each(t, r0, r1);
    }
}

fn put(stripe: &mut Stripe, r0: usize, r1: usize, panel: usize, acc: &[[f32; COLS]; MAX_ROWS]) {
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
            return;
        }
        for (fi, format) in [Format::Q4_0, Format::Q4_K, Format::Q6_K].into_iter().enumerate() {
            let w = super::super::tests::random_packed(format, 32, 512, 7 + fi as u32);
            let panel_bytes = format.panel_bytes(512 / QK);
            for p in 0..2 {
                let panel = &w.data[p * panel_bytes..(p + 1) * panel_bytes];
                for b in 0..512 / QK {
                    let (mut want, mut got) = ([0u8; B_BYTES], [0u8; B_BYTES]);
                    unpack_scalar(&w, panel, format.block_at(b), &mut want);
                    unpack(&w, panel, format.block_at(b), &mut got);
                    assert_eq!(want, got, "{format:?} panel {p} block {b}");
                }
            }
        }
    }

    #[test]
    fn emulated_tiles_give_the_scalar_bits() {
        // Every format, row counts 1–67 (partial groups of 16 and ragged last panels), input
        // widths of 1 to 17 blocks (odd counts: not a multiple of any tile's K), several
        // matrices sharing one call, and the gated form.
        let mut seed = 3u32;
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let widths: &[usize] =
                if matches!(format, Format::Q4_K | Format::Q6_K) { &[256, 768] } else { &[32, 96, 544] };
            for &inp in widths {
                for m in [1, 2, 3, 15, 16, 17, 33, 67] {
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
                    run(&EmulatedTiles::default, &rows, &[&w1, &w2], &mut ys);
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
                    gated(&EmulatedTiles::default, &rows, &w1, &w2, crate::kernels::as_uninit(&mut g));
                    assert_eq!(bits(&g), bits(&want_g), "{format:?} gated, in {inp} out {out} rows {m}");
                }
            }
        }
    }
}
