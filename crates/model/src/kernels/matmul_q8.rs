//! `y = x·Wᵀ` for Q8_0 and Q4_0 weights (blocks of 32 int8 or 4-bit values with one scale), with
//! activations quantized to int8 per 32-block as llama.cpp does, and integer dot products on
//! AVX-512 VNNI.
//!
//! The weight is repacked once at load: panels of 16 output columns, and within a panel, per
//! 32-wide block of the input, the values laid out `[8 groups of 4 inputs][16 columns][4]` so one
//! `vpdpbusd` multiplies four inputs of one row into all 16 columns at once, then the 16 f16
//! scales. `vpdpbusd` wants one unsigned operand, so the weight is stored offset to be unsigned
//! (Q8_0: `w + 128`; Q4_0: the nibble as GGUF has it, `w + 8`) and the offset's contribution,
//! `offset · Σx` per row and block, is subtracted once per block. Q4_0 keeps 4 bits: byte `j`
//! of a block holds layout entry `j` in its low nibble and entry `j + 256` in its high one, so
//! one 64-byte load yields groups `g` and `g + 4`. The packed weight is as compact as GGUF's
//! (4.5 and 8.5 bits per value), which matters because decode streams all of it per token.
//! Each output is then, block by block in input order, `acc = fma(isum as f32, d_w · d_x, acc)`
//! with `isum` an exact integer — the same bits for any number of rows, any tiling and any
//! instruction set, which keeps batches from changing a request's tokens. The scalar path is
//! the reference.

#![allow(clippy::needless_range_loop)] // index loops mirror the SIMD lanes they stand for

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::{as_uninit, by_panel_stripes, pool};

pub const QK: usize = 32;
const COLS: usize = 16;
const ROWS: usize = 8;

/// The block formats this kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// f16 scale, 32 × i8 (34 bytes).
    Q8_0,
    /// f16 scale, 16 bytes of nibbles: value `j` low, `j + 16` high, each minus 8 (18 bytes).
    Q4_0,
}

impl Format {
    fn ggml_block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => 34,
            Format::Q4_0 => 18,
        }
    }

    /// Bytes of weight values per panel block (16 columns × 32 inputs).
    fn values(self) -> usize {
        match self {
            Format::Q8_0 => COLS * QK,
            Format::Q4_0 => COLS * QK / 2,
        }
    }

    /// One panel block: the values, then 16 f16 scales.
    fn panel_block(self) -> usize {
        self.values() + COLS * 2
    }

    /// What the stored (unsigned) weight adds to the signed value.
    fn offset(self) -> i32 {
        match self {
            Format::Q8_0 => 128,
            Format::Q4_0 => 8,
        }
    }

    /// Element `k` of a GGUF block, as a signed integer.
    fn ggml_value(self, blk: &[u8], k: usize) -> i8 {
        match self {
            Format::Q8_0 => blk[2 + k] as i8,
            Format::Q4_0 => {
                let byte = blk[2 + k % 16];
                (if k < 16 { byte & 0x0F } else { byte >> 4 }) as i8 - 8
            }
        }
    }
}

/// A Q8_0 or Q4_0 `[out, in]` weight repacked for [`matmul`].
pub struct PackedQ8 {
    format: Format,
    out: usize,
    inp: usize,
    data: Vec<u8>,
}

/// Where layout entry `e` (`(k / 4) · 64 + c · 4 + k % 4`) of a block lives: (byte, high nibble).
fn q4_slot(e: usize) -> (usize, bool) {
    if e < 256 {
        (e, false)
    } else {
        (e - 256, true)
    }
}

impl PackedQ8 {
    /// Repack GGUF blocks, row-major `[out][in/32]`.
    pub fn from_ggml(format: Format, raw: &[u8], out: usize, inp: usize) -> Option<Self> {
        let gb = format.ggml_block_bytes();
        if !inp.is_multiple_of(QK) || raw.len() != out * (inp / QK) * gb {
            return None;
        }
        let (nb, pb) = (inp / QK, format.panel_block());
        let panels = out.div_ceil(COLS);
        let mut data = vec![0u8; panels * nb * pb];
        for o in 0..out {
            let (p, c) = (o / COLS, o % COLS);
            for b in 0..nb {
                let blk = &raw[(o * nb + b) * gb..(o * nb + b + 1) * gb];
                let base = (p * nb + b) * pb;
                for k in 0..QK {
                    let stored = (format.ggml_value(blk, k) as i32 + format.offset()) as u8;
                    let e = (k / 4) * COLS * 4 + c * 4 + k % 4;
                    match format {
                        Format::Q8_0 => data[base + e] = stored,
                        Format::Q4_0 => {
                            let (byte, high) = q4_slot(e);
                            data[base + byte] |= if high { stored << 4 } else { stored };
                        }
                    }
                }
                // The f16 scale as GGUF stores it (widened exactly when used).
                let s = base + format.values() + c * 2;
                data[s..s + 2].copy_from_slice(&blk[..2]);
            }
        }
        Some(Self { format, out, inp, data })
    }

    /// Layout entry `e` of panel block `base`, as stored (the value plus the format's offset).
    fn stored(&self, panel: &[u8], base: usize, e: usize) -> i32 {
        match self.format {
            Format::Q8_0 => panel[base + e] as i32,
            Format::Q4_0 => {
                let (byte, high) = q4_slot(e);
                let v = panel[base + byte];
                (if high { v >> 4 } else { v & 0x0F }) as i32
            }
        }
    }

    pub fn out_features(&self) -> usize {
        self.out
    }

    pub fn in_features(&self) -> usize {
        self.inp
    }
}

/// One row of activations quantized per 32-block: the int8 values, the block scales, and per
/// block `offset · Σq`, what the weight's storage offset adds to each block's integer sum.
struct QuantRow {
    q: Vec<i8>,
    d: Vec<f32>,
    corr: Vec<i32>,
}

fn quantize_row(isa: Isa, x: &[f32], offset: i32) -> QuantRow {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Vnni {
        // SAFETY: `Vnni` is only chosen after detecting AVX-512F/BW/VNNI.
        return unsafe { x86::quantize_row(x, offset) };
    }
    let _ = isa;
    quantize_row_scalar(x, offset)
}

/// The reference quantization; the AVX-512 one gives the same bytes.
fn quantize_row_scalar(x: &[f32], offset: i32) -> QuantRow {
    let nb = x.len() / QK;
    let (mut q, mut d, mut corr) = (vec![0i8; x.len()], vec![0f32; nb], vec![0i32; nb]);
    for b in 0..nb {
        let blk = &x[b * QK..(b + 1) * QK];
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        d[b] = scale;
        if scale > 0.0 {
            let inv = 1.0 / scale;
            for (k, &v) in blk.iter().enumerate() {
                // Round to nearest (ties to even) by the 1.5·2^23 trick: |v·inv| ≤ 127 here, and
                // unlike `f32::round` it vectorises instead of calling libm per value.
                const MAGIC: f32 = 12_582_912.0;
                let r = (v * inv + MAGIC) - MAGIC;
                q[b * QK + k] = (r as i32).clamp(-127, 127) as i8;
            }
        }
        corr[b] = offset * q[b * QK..(b + 1) * QK].iter().map(|&v| v as i32).sum::<i32>();
    }
    QuantRow { q, d, corr }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Vnni,
}

pub fn detect_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            return Isa::Vnni;
        }
    }
    Isa::Scalar
}

pub fn matmul(x: &[f32], m: usize, w: &PackedQ8, y: &mut [f32]) {
    matmul_with(detect_isa(), x, m, w, y)
}

/// [`matmul`] into an uninitialised `y`; every one of its `m · out` values is written.
pub fn matmul_uninit(x: &[f32], m: usize, w: &PackedQ8, y: &mut [MaybeUninit<f32>]) {
    run(detect_isa(), x, m, w, y)
}

/// [`matmul`] on a chosen path (an unsupported one falls back to scalar: same bits).
pub fn matmul_with(isa: Isa, x: &[f32], m: usize, w: &PackedQ8, y: &mut [f32]) {
    run(isa, x, m, w, as_uninit(y))
}

fn run(isa: Isa, x: &[f32], m: usize, w: &PackedQ8, y: &mut [MaybeUninit<f32>]) {
    let isa = if isa == Isa::Vnni && detect_isa() != Isa::Vnni { Isa::Scalar } else { isa };
    assert_eq!(x.len(), m * w.inp, "q8 matmul input length");
    assert_eq!(y.len(), m * w.out, "q8 matmul output length");
    let off = w.format.offset();
    // Rows quantize independently; a prompt's worth is worth splitting across the threads.
    let rows: Vec<QuantRow> = if m >= 8 {
        let done: Vec<OnceLock<QuantRow>> = (0..m).map(|_| OnceLock::new()).collect();
        pool::run(m, |r| {
            let _ = done[r].set(quantize_row(isa, &x[r * w.inp..(r + 1) * w.inp], off));
        });
        // `run` runs every task, so each row is there; recomputing is the (unreachable) fallback.
        let redo = |r: usize| quantize_row(isa, &x[r * w.inp..(r + 1) * w.inp], off);
        done.into_iter().enumerate().map(|(r, q)| q.into_inner().unwrap_or_else(|| redo(r))).collect()
    } else {
        x.chunks_exact(w.inp).map(|r| quantize_row(isa, r, off)).collect()
    };
    let (nb, pb) = (w.inp / QK, w.format.panel_block());
    by_panel_stripes(m, w.out, COLS, 1, y, |p0, p1, stripe| {
        for p in p0..p1 {
            let panel = &w.data[p * nb * pb..(p + 1) * nb * pb];
            for r0 in (0..m).step_by(ROWS) {
                let r1 = (r0 + ROWS).min(m);
                let mut acc = [[0f32; COLS]; ROWS];
                tile(isa, w, &rows[r0..r1], panel, nb, &mut acc);
                for (i, a) in acc.iter().enumerate().take(r1 - r0) {
                    stripe.put(r0 + i, p - p0, a);
                }
            }
        }
    });
}

fn tile(isa: Isa, w: &PackedQ8, rows: &[QuantRow], panel: &[u8], nb: usize, acc: &mut [[f32; COLS]; ROWS]) {
    match (isa, w.format) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul_with` only passes Vnni after detecting AVX-512F/BW/VNNI; `panel` holds
        // `nb` blocks of this format and every row `nb · 32` values.
        (Isa::Vnni, Format::Q8_0) => unsafe { x86::tile_vnni_rows::<false>(rows, panel, nb, acc) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Vnni, Format::Q4_0) => unsafe { x86::tile_vnni_rows::<true>(rows, panel, nb, acc) },
        _ => tile_scalar(w, rows, panel, nb, acc),
    }
}

fn read_f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The reference: exact integer block sums, then one `mul_add` per block, in block order.
fn tile_scalar(w: &PackedQ8, rows: &[QuantRow], panel: &[u8], nb: usize, acc: &mut [[f32; COLS]; ROWS]) {
    let (pb, vals) = (w.format.panel_block(), w.format.values());
    for (r, row) in rows.iter().enumerate() {
        for b in 0..nb {
            let base = b * pb;
            for c in 0..COLS {
                let mut isum = 0i32;
                for k in 0..QK {
                    let wv = w.stored(panel, base, (k / 4) * COLS * 4 + c * 4 + k % 4);
                    isum += row.q[b * QK + k] as i32 * wv;
                }
                isum -= row.corr[b];
                let scale = read_f16(panel, base + vals + c * 2) * row.d[b];
                acc[r][c] = (isum as f32).mul_add(scale, acc[r][c]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{QuantRow, COLS, QK, ROWS};
    use std::arch::x86_64::*;

    /// [`super::quantize_row_scalar`] sixteen lanes at a time: the same max, the same
    /// `1/scale`, the same round-to-nearest-even, so the same bytes.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_row(x: &[f32], offset: i32) -> QuantRow {
        let nb = x.len() / QK;
        let (mut q, mut d, mut corr) = (vec![0i8; nb * QK], vec![0f32; nb], vec![0i32; nb]);
        let magic = _mm512_set1_ps(12_582_912.0);
        let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
        for b in 0..nb {
            let p = x.as_ptr().add(b * QK);
            let (v0, v1) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let scale = amax / 127.0;
            *d.get_unchecked_mut(b) = scale;
            if scale > 0.0 {
                let inv = _mm512_set1_ps(1.0 / scale);
                let round = |v| {
                    let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, inv), magic), magic);
                    _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(r), lo), hi)
                };
                let (i0, i1) = (round(v0), round(v1));
                let out = q.as_mut_ptr().add(b * QK);
                _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(i0));
                _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(i1));
                *corr.get_unchecked_mut(b) = offset * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            }
        }
        QuantRow { q, d, corr }
    }

    const PREFETCH_BLOCKS: usize = 8;

    /// Dispatch on the row count so the accumulators of [`tile_vnni`] are registers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn tile_vnni_rows<const Q4: bool>(
        rows: &[QuantRow],
        panel: &[u8],
        nb: usize,
        acc: &mut [[f32; COLS]; ROWS],
    ) {
        match rows.len() {
            1 => tile_vnni::<Q4, 1>(rows, panel, nb, acc),
            2 => tile_vnni::<Q4, 2>(rows, panel, nb, acc),
            3 => tile_vnni::<Q4, 3>(rows, panel, nb, acc),
            4 => tile_vnni::<Q4, 4>(rows, panel, nb, acc),
            5 => tile_vnni::<Q4, 5>(rows, panel, nb, acc),
            6 => tile_vnni::<Q4, 6>(rows, panel, nb, acc),
            7 => tile_vnni::<Q4, 7>(rows, panel, nb, acc),
            _ => tile_vnni::<Q4, 8>(rows, panel, nb, acc),
        }
    }

    /// `Q4`: 4-bit panel blocks (Q4_0), else int8 (Q8_0). `R` rows (≤ `ROWS`, = `rows.len()`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile_vnni<const Q4: bool, const R: usize>(
        rows: &[QuantRow],
        panel: &[u8],
        nb: usize,
        acc: &mut [[f32; COLS]; ROWS],
    ) {
        let vals = if Q4 { COLS * QK / 2 } else { COLS * QK };
        let pb = vals + COLS * 2;
        let mut xq = [std::ptr::null::<i8>(); R];
        let mut dx = [std::ptr::null::<f32>(); R];
        let mut corr = [std::ptr::null::<i32>(); R];
        for r in 0..R {
            xq[r] = rows.get_unchecked(r).q.as_ptr();
            dx[r] = rows.get_unchecked(r).d.as_ptr();
            corr[r] = rows.get_unchecked(r).corr.as_ptr();
        }
        let mut f = [_mm512_setzero_ps(); R];
        let low = _mm512_set1_epi8(0x0F);
        for b in 0..nb {
            let base = panel.as_ptr().add(b * pb);
            // Software prefetch a few blocks ahead: the loop carries enough arithmetic per byte
            // that the out-of-order window alone does not keep enough cache misses in flight.
            let ahead = base.wrapping_add(PREFETCH_BLOCKS * pb);
            let mut line = 0;
            while line < pb {
                _mm_prefetch(ahead.wrapping_add(line) as *const i8, _MM_HINT_T0);
                line += 64;
            }
            let mut isum = [_mm512_setzero_si512(); R];
            macro_rules! dot {
                ($g:expr, $w:expr) => {{
                    let w = $w;
                    for r in 0..R {
                        let x = (xq[r].add(b * QK + $g * 4) as *const i32).read_unaligned();
                        isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(x));
                    }
                }};
            }
            if Q4 {
                for g in 0..4 {
                    let v = _mm512_loadu_si512(base.add(g * COLS * 4) as *const _);
                    dot!(g, _mm512_and_si512(v, low));
                    dot!(g + 4, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
            } else {
                for g in 0..QK / 4 {
                    dot!(g, _mm512_loadu_si512(base.add(g * COLS * 4) as *const _));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(vals) as *const __m256i));
            for r in 0..R {
                let exact = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(*corr[r].add(b)));
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*dx[r].add(b)));
                f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, f[r]);
            }
        }
        for r in 0..R {
            _mm512_storeu_ps(acc[r].as_mut_ptr(), f[r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q4_blocks(w: &[f32], out: usize, inp: usize) -> Vec<u8> {
        let mut raw = Vec::new();
        for o in 0..out {
            for b in 0..inp / QK {
                let blk = &w[o * inp + b * QK..o * inp + (b + 1) * QK];
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 8.0;
                raw.extend(half::f16::from_f32(d).to_le_bytes());
                let q = |v: f32| if d > 0.0 { ((v / d).round() + 8.0).clamp(0.0, 15.0) as u8 } else { 8 };
                for j in 0..16 {
                    raw.push(q(blk[j]) | (q(blk[j + 16]) << 4));
                }
            }
        }
        raw
    }

    fn q8_blocks(w: &[f32], out: usize, inp: usize) -> Vec<u8> {
        let mut raw = Vec::new();
        for o in 0..out {
            for b in 0..inp / QK {
                let blk = &w[o * inp + b * QK..o * inp + (b + 1) * QK];
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                raw.extend(half::f16::from_f32(d).to_le_bytes());
                for &v in blk {
                    raw.push(if d > 0.0 { (v / d).round().clamp(-127.0, 127.0) as i8 as u8 } else { 0 });
                }
            }
        }
        raw
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(747_796_405).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn vnni_matches_the_scalar_reference_and_the_dequantized_product() {
        for format in [Format::Q8_0, Format::Q4_0] {
            check_format(format);
        }
    }

    fn check_format(format: Format) {
        let (out, inp) = (37, 96);
        let w = data(out * inp, 1);
        let raw = if format == Format::Q8_0 { q8_blocks(&w, out, inp) } else { q4_blocks(&w, out, inp) };
        let gb = format.ggml_block_bytes();
        let p = PackedQ8::from_ggml(format, &raw, out, inp).unwrap();
        for m in 1..=9 {
            let x = data(m * inp, 2 + m as u32);
            let mut ys = vec![0f32; m * out];
            matmul_with(Isa::Scalar, &x, m, &p, &mut ys);
            let mut yv = vec![0f32; m * out];
            matmul_with(Isa::Vnni, &x, m, &p, &mut yv);
            assert_eq!(ys, yv, "{format:?} m={m}: the VNNI path must give the scalar path's bits");
            // Against the f32 product of the dequantized weight: only activation rounding differs.
            for i in 0..m {
                for o in 0..out {
                    let mut r = 0f64;
                    for b in 0..inp / QK {
                        let blk = &raw[(o * (inp / QK) + b) * gb..][..gb];
                        let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32() as f64;
                        for k in 0..QK {
                            r += x[i * inp + b * QK + k] as f64 * format.ggml_value(blk, k) as f64 * d;
                        }
                    }
                    assert!((ys[i * out + o] as f64 - r).abs() < 0.05, "({i},{o}): {} vs {r}", ys[i * out + o]);
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (out, inp) = (50, 64);
        let p = PackedQ8::from_ggml(Format::Q4_0, &q4_blocks(&data(out * inp, 5), out, inp), out, inp).unwrap();
        let target = data(inp, 6);
        let mut alone = vec![0f32; out];
        matmul(&target, 1, &p, &mut alone);
        for m in [2, 3, 4, 5, 8, 13] {
            let mut x = data(m * inp, 7 + m as u32);
            let pos = m / 2;
            x[pos * inp..(pos + 1) * inp].copy_from_slice(&target);
            let mut y = vec![0f32; m * out];
            matmul(&x, m, &p, &mut y);
            assert_eq!(&y[pos * out..(pos + 1) * out], &alone[..], "m={m}");
        }
    }

    /// `matmul_uninit` writes every output (the caller treats the buffer as initialised after).
    #[test]
    fn uninit_output_is_fully_written() {
        let (out, inp) = (37, 64);
        let p = PackedQ8::from_ggml(Format::Q8_0, &q8_blocks(&data(out * inp, 31), out, inp), out, inp).unwrap();
        for m in [1, 7, 8, 9, 20] {
            let x = data(m * inp, 32);
            let mut want = vec![0f32; m * out];
            matmul(&x, m, &p, &mut want);
            let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
            matmul_uninit(&x, m, &p, &mut y);
            // SAFETY: filled with NaN above, so initialised whatever the kernel wrote.
            let got: Vec<f32> = y.iter().map(|v| unsafe { v.assume_init() }).collect();
            assert_eq!(got, want, "m={m}");
        }
    }

    #[test]
    fn malformed_input_is_refused() {
        assert!(PackedQ8::from_ggml(Format::Q8_0, &[0; 34], 1, 33).is_none());
        assert!(PackedQ8::from_ggml(Format::Q8_0, &[0; 33], 1, 32).is_none());
        assert!(PackedQ8::from_ggml(Format::Q4_0, &[0; 34], 1, 32).is_none());
    }
}
