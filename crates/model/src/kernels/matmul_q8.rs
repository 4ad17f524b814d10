//! `y = x·Wᵀ` for GGUF's Q8_0, Q4_0, Q4_K and Q6_K weights, with activations quantized to int8
//! per 32-block as llama.cpp does for Q8_0, and exact integer dot products (AVX-512 VNNI, AVX2, or
//! the portable reference).
//!
//! The weight is repacked once at load into panels of 16 output columns. Within a panel, per
//! 32-wide block of the input ("panel block"), the values are laid out `[8 groups of 4
//! inputs][16 columns][4]`, so one `vpdpbusd` multiplies four inputs of a row into all 16
//! columns at once; then the block's scales (32 bytes; Q4_K's six-bit ones in 24). The K-quants'
//! 256-wide super-blocks put their f16 super-scales in a header before every eighth panel block.
//!
//! `vpdpbusd` wants one unsigned operand, so weights are stored unsigned (Q8_0: `w + 128`; Q4_0:
//! the nibble, `w + 8`; Q4_K: its nibble, which is unsigned already; Q6_K: its 6 bits, `w + 32`)
//! and the offset's share, `offset · Σx` per row and block, is subtracted from the integer sum.
//! 4-bit values keep 4 bits: byte `j` of a block holds layout entry `j` in its low nibble and
//! entry `j + 256` in its high one, so one 64-byte load yields groups `g` and `g + 4`. Q6_K adds
//! its top two bits as four 2-bit fields per byte. The packed weight is exactly as compact as
//! GGUF's (Q8_0 8.5, Q4_0 4.5, Q4_K 4.5, Q6_K 6.5625 bits per value), which matters because decode
//! streams all of it per token.
//!
//! Per block and column the integer sums are exact, then folded into the f32 accumulator by one
//! fixed sequence of f32 operations (see [`tile_scalar`]) in input order — the same bits for any
//! number of rows, any tiling and any instruction set, which keeps batches from changing a
//! request's tokens. The scalar path is the reference the SIMD paths are tested against.

#![allow(clippy::needless_range_loop)] // index loops mirror the SIMD lanes they stand for

use std::mem::MaybeUninit;

use super::huge_buf::HugeBuf;
use super::{as_uninit, by_panel_stripes_many, pool, streamed, Isa};

mod amx;
mod grouped;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use grouped::{grouped_gated_uninit, grouped_uninit, ExpertJob};

pub const QK: usize = 32;
const COLS: usize = 16;
const ROWS: usize = 8;
/// The most rows for which two panels are computed side by side (see `tile_pair`): decode's
/// rows, and a mixture's experts' in a decode batch. More rows are compute-bound, and two
/// panels' sums would crowd the registers.
const PAIR_ROWS: usize = 3;
/// Panel blocks per K-quant super-block (256 values).
const SUPER: usize = 8;

/// The block formats this kernel reads (named as GGUF names them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// f16 scale, 32 × i8 (34 bytes).
    Q8_0,
    /// f16 scale, 16 bytes of nibbles: value `j` low, `j + 16` high, each minus 8 (18 bytes).
    Q4_0,
    /// 256 values: f16 `d` and `dmin`, eight 6-bit scales and mins, 128 bytes of nibbles;
    /// value = `d·sc·q − dmin·m` per 32 (144 bytes).
    Q4_K,
    /// 256 values: 4 low bits, 2 high bits, sixteen i8 scales, f16 `d`; value =
    /// `d·sc·(q − 32)` per 16 (210 bytes).
    Q6_K,
}

impl Format {
    /// The kernels' compile-time tag for the format.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const fn tag(self) -> u8 {
        self as u8
    }

    fn ggml_block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => 34,
            Format::Q4_0 => 18,
            Format::Q4_K => 144,
            Format::Q6_K => 210,
        }
    }

    /// Values per GGUF block.
    fn ggml_values(self) -> usize {
        match self {
            Format::Q8_0 | Format::Q4_0 => QK,
            Format::Q4_K | Format::Q6_K => QK * SUPER,
        }
    }

    /// Bytes of weight values per panel block (16 columns × 32 inputs).
    const fn values(self) -> usize {
        match self {
            Format::Q8_0 => COLS * QK,
            Format::Q4_0 | Format::Q4_K => COLS * QK / 2,
            Format::Q6_K => COLS * QK / 2 + COLS * QK / 4,
        }
    }

    /// Bytes of per-block scales after the values: Q8_0/Q4_0 16 f16; Q6_K 16 scales of the
    /// first 16 inputs, then 16 of the second; Q4_K its 16 six-bit `sc` and `m` in 24 bytes
    /// ([`q4k_meta`]).
    const fn meta(self) -> usize {
        match self {
            Format::Q4_K => Q4K_META,
            _ => COLS * 2,
        }
    }

    /// One panel block: the values, then the scales.
    const fn panel_block(self) -> usize {
        self.values() + self.meta()
    }

    /// The f16 super-scales before each super-block's panel blocks: 16 `d` (and 16 `dmin`).
    const fn header(self) -> usize {
        match self {
            Format::Q8_0 | Format::Q4_0 => 0,
            Format::Q4_K => COLS * 4,
            Format::Q6_K => COLS * 2,
        }
    }

    /// What the stored (unsigned) weight adds to the signed value.
    const fn offset(self) -> i32 {
        match self {
            Format::Q8_0 => 128,
            Format::Q4_0 => 8,
            Format::Q4_K => 0,
            Format::Q6_K => 32,
        }
    }

    /// Where panel block `b` starts within its panel.
    const fn block_at(self, b: usize) -> usize {
        if self.header() == 0 {
            b * self.panel_block()
        } else {
            (b / SUPER) * (self.header() + SUPER * self.panel_block())
                + self.header()
                + (b % SUPER) * self.panel_block()
        }
    }

    /// Where the header of the super-block holding panel block `b` starts.
    const fn header_at(self, b: usize) -> usize {
        (b / SUPER) * (self.header() + SUPER * self.panel_block())
    }

    /// One panel of `nb` blocks (for the K-quants a whole number of super-blocks). Not
    /// `block_at(nb)`: that counts the header of a super-block after the last, which padded every
    /// K-quant panel with an unused header (Q4_K 64 bytes: 0.3% of a 2048-wide weight, 0.9% of
    /// a 768-wide one; Q6_K 32).
    fn panel_bytes(self, nb: usize) -> usize {
        if self.header() == 0 {
            self.block_at(nb)
        } else {
            self.header_at(nb.next_multiple_of(SUPER))
        }
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const fn from_tag(tag: u8) -> Format {
        match tag {
            0 => Format::Q8_0,
            1 => Format::Q4_0,
            2 => Format::Q4_K,
            _ => Format::Q6_K,
        }
    }
}

/// Q4_K's scales of a panel block: byte `c` holds column `c`'s `sc` (6 bits) and the low two bits
/// of its `m`; then 8 bytes of nibbles, column `c`'s in byte `c / 2` (even columns low), hold the
/// top four bits of `m`. 24 bytes where one byte a value took 32: Q4_K streams 4.5 bits a weight,
/// as in the file, instead of 4.625 (2.7% fewer bytes for a decode step to read). The x86 paths
/// unpack it with a few 16-byte operations per block (`x86::q4k_meta`).
const Q4K_META: usize = COLS + COLS / 2;

/// Column `c`'s (`sc`, `m`) from a Q4_K panel block's scales at `meta`.
fn q4k_meta(panel: &[u8], meta: usize, c: usize) -> (u8, u8) {
    let (lo, hi) = (panel[meta + c], panel[meta + COLS + c / 2] >> (4 * (c % 2)));
    (lo & 63, (lo >> 6) | ((hi & 0x0F) << 2))
}

/// One GGUF block decoded for packing: per value the stored (offset) value, per 32-block its two
/// scale bytes (Q8_0/Q4_0: the f16; Q4_K: `sc`, `m`; Q6_K: the two i8 scales), per super-block
/// the f16 header values.
struct Decoded {
    stored: [u8; QK * SUPER],
    meta: [[u8; 2]; SUPER],
    head: [[u8; 2]; 2],
}

/// Q4_K's 6-bit scale and min of 32-block `j` (0..8) from its 12 packed bytes.
fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

fn decode(format: Format, blk: &[u8]) -> Decoded {
    let mut d = Decoded { stored: [0; QK * SUPER], meta: [[0; 2]; SUPER], head: [[0; 2]; 2] };
    match format {
        Format::Q8_0 => {
            d.meta[0] = [blk[0], blk[1]];
            for k in 0..QK {
                d.stored[k] = (blk[2 + k] as i8 as i32 + 128) as u8;
            }
        }
        Format::Q4_0 => {
            d.meta[0] = [blk[0], blk[1]];
            for k in 0..QK {
                let byte = blk[2 + k % 16];
                d.stored[k] = if k < 16 { byte & 0x0F } else { byte >> 4 };
            }
        }
        Format::Q4_K => {
            d.head = [[blk[0], blk[1]], [blk[2], blk[3]]];
            for j in 0..SUPER {
                let (sc, m) = q4k_scale_min(j, &blk[4..16]);
                d.meta[j] = [sc, m];
            }
            for i in 0..QK * SUPER {
                let (chunk, l) = (i / 64, i % 64);
                let byte = blk[16 + chunk * 32 + l % 32];
                d.stored[i] = if l < 32 { byte & 0x0F } else { byte >> 4 };
            }
        }
        Format::Q6_K => {
            let (ql, qh, sc) = (&blk[..128], &blk[128..192], &blk[192..208]);
            d.head[0] = [blk[208], blk[209]];
            for i in 0..QK * SUPER {
                let (n, quarter, l) = (i / 128, (i % 128) / 32, i % 32);
                let low = ql[n * 64 + l + (quarter & 1) * 32];
                let low = if quarter < 2 { low & 0x0F } else { low >> 4 };
                d.stored[i] = low | (((qh[n * 32 + l] >> (2 * quarter)) & 3) << 4);
            }
            for j in 0..SUPER {
                let (n, quarter) = (j / 4, j % 4);
                d.meta[j] = [sc[n * 8 + 2 * quarter], sc[n * 8 + 2 * quarter + 1]];
            }
        }
    }
    d
}

/// A quantized `[out, in]` weight repacked for [`matmul`].
pub struct PackedQ8 {
    format: Format,
    out: usize,
    inp: usize,
    data: HugeBuf<u8>,
}

/// Layout entry of input `k` (0..32) of column `c` in a panel block.
fn entry(k: usize, c: usize) -> usize {
    (k / 4) * COLS * 4 + c * 4 + k % 4
}

/// Where layout entry `e` lives among a block's nibbles: (byte, high nibble).
fn q4_slot(e: usize) -> (usize, bool) {
    (e % 256, e >= 256)
}

/// Where Q6_K's top two bits of layout entry `e` live: (byte after the nibbles, shift).
fn q6_high_slot(e: usize) -> (usize, u32) {
    (COLS * QK / 2 + (e / 256) * 64 + e % 64, 2 * ((e / 64) % 4) as u32)
}

/// Write column `c` of one decoded GGUF block, whose first 32-block is panel block `b0`, into
/// its panel.
fn pack_block(format: Format, dec: &Decoded, b0: usize, c: usize, panel: &mut [u8]) {
    for j in 0..format.ggml_values() / QK {
        let base = format.block_at(b0 + j);
        for k in 0..QK {
            let (v, e) = (dec.stored[j * QK + k], entry(k, c));
            match format {
                Format::Q8_0 => panel[base + e] = v,
                Format::Q4_0 | Format::Q4_K | Format::Q6_K => {
                    let (byte, high) = q4_slot(e);
                    panel[base + byte] |= if high { (v & 0x0F) << 4 } else { v & 0x0F };
                    if format == Format::Q6_K {
                        let (byte, shift) = q6_high_slot(e);
                        panel[base + byte] |= (v >> 4) << shift;
                    }
                }
            }
        }
        let meta = base + format.values();
        match format {
            Format::Q8_0 | Format::Q4_0 => panel[meta + 2 * c..meta + 2 * c + 2].copy_from_slice(&dec.meta[j]),
            Format::Q4_K => {
                let [sc, m] = dec.meta[j];
                panel[meta + c] = sc | (m & 3) << 6;
                panel[meta + COLS + c / 2] |= (m >> 2) << (4 * (c % 2));
            }
            Format::Q6_K => {
                panel[meta + c] = dec.meta[j][0];
                panel[meta + COLS + c] = dec.meta[j][1];
            }
        }
    }
    if format.header() > 0 {
        let h = format.header_at(b0);
        for (i, v) in dec.head.iter().enumerate().take(format.header() / (2 * COLS)) {
            panel[h + i * 2 * COLS + 2 * c..][..2].copy_from_slice(v);
        }
    }
}

impl PackedQ8 {
    /// Repack GGUF blocks, row-major `[out][in / values per block]`. `None` when the sizes do
    /// not fit the format.
    pub fn from_ggml(format: Format, raw: &[u8], out: usize, inp: usize) -> Option<Self> {
        let (gv, gb) = (format.ggml_values(), format.ggml_block_bytes());
        if inp == 0 || !inp.is_multiple_of(gv) || raw.len() != out * (inp / gv) * gb {
            return None;
        }
        let nb = inp / QK;
        let panel_bytes = format.panel_bytes(nb);
        let mut data = HugeBuf::<u8>::zeroed(out.div_ceil(COLS) * panel_bytes);
        let row_bytes = (inp / gv) * gb;
        // Panels are independent: a 7B checkpoint's worth is worth packing on every thread.
        pool::run_chunks(&mut data, panel_bytes, |p, panel| {
            for c in 0..COLS.min(out - p * COLS) {
                let o = p * COLS + c;
                for (g, blk) in raw[o * row_bytes..(o + 1) * row_bytes].chunks_exact(gb).enumerate() {
                    pack_block(format, &decode(format, blk), g * (gv / QK), c, panel);
                }
            }
        });
        Some(Self { format, out, inp, data })
    }

    /// Layout entry `e` of the panel block at `base`, as stored (the value plus the format's
    /// offset).
    fn stored(&self, panel: &[u8], base: usize, e: usize) -> i32 {
        match self.format {
            Format::Q8_0 => panel[base + e] as i32,
            Format::Q4_0 | Format::Q4_K | Format::Q6_K => {
                let (byte, high) = q4_slot(e);
                let v = panel[base + byte];
                let low = (if high { v >> 4 } else { v & 0x0F }) as i32;
                if self.format != Format::Q6_K {
                    return low;
                }
                let (byte, shift) = q6_high_slot(e);
                low | ((((panel[base + byte] >> shift) & 3) as i32) << 4)
            }
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The bytes a product with this weight streams: the packed panels, scales included (as many
    /// as the file's blocks hold, plus the zero columns that fill a last panel of under 16).
    pub fn packed_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn out_features(&self) -> usize {
        self.out
    }

    pub fn in_features(&self) -> usize {
        self.inp
    }
}

/// One row of activations quantized per 32-block: the int8 values, the block scales, and per
/// block `Σq` and the sum of its first 16 values (Q6_K's scales cover 16 inputs).
#[derive(Clone)]
struct QuantRow {
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<i32>,
    half: Vec<i32>,
    /// Per block, the integer offset terms the stored weights carry, negated, for the VNNI tile
    /// to start its sums from ([`offset_terms`]).
    neg: Vec<[i32; 4]>,
    /// Per block, `d · Σq` rounded to f32: Q4_K's minimum term needs it for every column panel,
    /// so it is computed once per row here rather than once per panel in the tiles.
    dsum: Vec<f32>,
}

/// Which of [`QuantRow::neg`]'s terms: `−128·Σq` (Q8_0), `−8·Σq` (Q4_0), and Q6_K's `−32·Σq`
/// over the first and the second 16 inputs.
const NEG_Q8_0: usize = 0;
const NEG_Q4_0: usize = 1;
const NEG_Q6_LO: usize = 2;
const NEG_Q6_HI: usize = 3;

/// [`QuantRow::neg`] from the block sums. Starting an exact integer sum at `−offset·Σq` instead
/// of subtracting it afterwards gives the same integer, so the same bits; the VNNI tile then
/// loads the start value (a load-port broadcast) instead of spending two vector ALU operations
/// per row and block on it.
fn offset_terms(sum: &[i32], half: &[i32]) -> Vec<[i32; 4]> {
    sum.iter().zip(half).map(|(&s, &h)| [-128 * s, -8 * s, -32 * h, -32 * (s - h)]).collect()
}

/// [`QuantRow::dsum`] from the block scales and sums.
fn scaled_sums(d: &[f32], sum: &[i32]) -> Vec<f32> {
    d.iter().zip(sum).map(|(&d, &s)| d * s as f32).collect()
}

fn quantize_row(isa: Isa, x: &[f32]) -> QuantRow {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512Vnni | Isa::Amx) {
        // SAFETY: `path` only gives `Avx512Vnni` or `Amx` where AVX-512F/BW/VNNI are available.
        return unsafe { x86::quantize_row(x) };
    }
    let _ = isa;
    quantize_row_scalar(x)
}

/// The reference quantization; the AVX-512 one gives the same bytes.
fn quantize_row_scalar(x: &[f32]) -> QuantRow {
    let nb = x.len() / QK;
    let mut row = QuantRow {
        q: vec![0i8; x.len()],
        d: vec![0f32; nb],
        sum: vec![0; nb],
        half: vec![0; nb],
        neg: Vec::new(),
        dsum: Vec::new(),
    };
    for b in 0..nb {
        let blk = &x[b * QK..(b + 1) * QK];
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        row.d[b] = scale;
        if scale > 0.0 {
            let inv = 1.0 / scale;
            for (k, &v) in blk.iter().enumerate() {
                // Round to nearest (ties to even) by the 1.5·2^23 trick: |v·inv| ≤ 127 here, and
                // unlike `f32::round` it vectorises instead of calling libm per value.
                const MAGIC: f32 = 12_582_912.0;
                let r = (v * inv + MAGIC) - MAGIC;
                row.q[b * QK + k] = (r as i32).clamp(-127, 127) as i8;
            }
        }
        let q = &row.q[b * QK..(b + 1) * QK];
        row.half[b] = q[..16].iter().map(|&v| v as i32).sum();
        row.sum[b] = row.half[b] + q[16..].iter().map(|&v| v as i32).sum::<i32>();
    }
    row.neg = offset_terms(&row.sum, &row.half);
    row.dsum = scaled_sums(&row.d, &row.sum);
    row
}

/// The path this kernel takes on `isa` (one the CPU lacks gives the scalar path: same bits):
/// AMX tiles for two or more rows (VNNI for one), VNNI, else AVX2 (on AVX-512 without VNNI too),
/// else scalar.
fn path(isa: Isa) -> Isa {
    match isa.or_scalar() {
        Isa::Amx => Isa::Amx,
        Isa::Avx512Vnni | Isa::Avx512Bf16 | Isa::AmxBf16 => Isa::Avx512Vnni,
        Isa::Avx2 | Isa::Avx512 => Isa::Avx2,
        Isa::Scalar => Isa::Scalar,
    }
}

pub fn matmul(x: &[f32], m: usize, w: &PackedQ8, y: &mut [f32]) {
    matmul_with(Isa::detected(), x, m, w, y)
}

/// [`matmul`] into an uninitialised `y`; every one of its `m · out` values is written.
pub fn matmul_uninit(x: &[f32], m: usize, w: &PackedQ8, y: &mut [MaybeUninit<f32>]) {
    run(Isa::detected(), x, m, &[w], &mut [y])
}

/// Several matrices with the same input width applied to the same `x` (a layer's q/k/v, or its
/// gate/up), into uninitialised `ys[j]` (`[m][ws[j].out]`), every value written. The rows are
/// quantized once and all the matrices share one parallel region; each output has exactly the
/// bits [`matmul`] gives it alone. The formats may differ (Q4_K_M mixes Q4_K and Q6_K).
pub fn matmul_many_uninit(x: &[f32], m: usize, ws: &[&PackedQ8], ys: &mut [&mut [MaybeUninit<f32>]]) {
    run(Isa::detected(), x, m, ws, ys)
}

/// [`matmul`] on a chosen path (one this CPU lacks falls back to scalar: same bits).
pub fn matmul_with(isa: Isa, x: &[f32], m: usize, w: &PackedQ8, y: &mut [f32]) {
    run(isa, x, m, &[w], &mut [as_uninit(y)])
}

fn run(isa: Isa, x: &[f32], m: usize, ws: &[&PackedQ8], ys: &mut [&mut [MaybeUninit<f32>]]) {
    let isa = path(isa);
    let inp = ws.first().map_or(0, |w| w.inp);
    assert_eq!(ws.len(), ys.len(), "q8 matmul: one output per matrix");
    for (w, y) in ws.iter().zip(ys.iter()) {
        assert_eq!(w.inp, inp, "q8 matmul: matrices of one input width");
        assert_eq!(y.len(), m * w.out, "q8 matmul output length");
    }
    assert_eq!(x.len(), m * inp, "q8 matmul input length");
    if ws.is_empty() {
        return;
    }
    streamed::add(ws.iter().map(|w| w.packed_bytes()).sum());
    let rows = quantize_rows(isa, x, m, inp);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && m >= 2 {
        return amx::run(&hardware_tiles, &rows, ws, ys);
    }
    let isa = if isa == Isa::Amx { Isa::Avx512Vnni } else { isa };
    let rows: Vec<&QuantRow> = rows.iter().collect();
    let cols: Vec<usize> = ws.iter().map(|w| w.out).collect();
    by_panel_stripes_many(m, &cols, COLS, 1, ys, |j, p0, p1, stripe| {
        let mut accs = [[[0f32; COLS]; ROWS]; 2];
        panel_run(isa, ws[j], &rows, p0..p1, &mut accs, &mut |r, k, a| stripe.put(r, k, a));
    });
}

/// `silu(x·gateᵀ) · (x·upᵀ)`, elementwise, into uninitialised `y` `[m][out]` (every value
/// written): a SiLU-gated MLP's first half in one pass. Each task computes the gate and up tiles
/// of the same panel and combines them while they are in registers, so neither product is
/// written out, read back or allocated, and no serial elementwise pass follows the parallel
/// region. The bits are those of [`matmul`] for each matrix followed by
/// [`rowwise::silu_mul`](super::rowwise::silu_mul).
pub fn matmul_gated_uninit(x: &[f32], m: usize, gate: &PackedQ8, up: &PackedQ8, y: &mut [MaybeUninit<f32>]) {
    gated_with(Isa::detected(), x, m, gate, up, y)
}

fn gated_with(isa: Isa, x: &[f32], m: usize, gate: &PackedQ8, up: &PackedQ8, y: &mut [MaybeUninit<f32>]) {
    let isa = path(isa);
    let (inp, out) = (gate.inp, gate.out);
    assert!(up.inp == inp && up.out == out, "gated matmul: gate and up of one shape");
    assert_eq!(y.len(), m * out, "gated matmul output length");
    assert_eq!(x.len(), m * inp, "gated matmul input length");
    streamed::add(gate.packed_bytes() + up.packed_bytes());
    let rows = quantize_rows(isa, x, m, inp);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && m >= 2 {
        return amx::gated(&hardware_tiles, &rows, gate, up, y);
    }
    let isa = if isa == Isa::Amx { Isa::Avx512Vnni } else { isa };
    let rows: Vec<&QuantRow> = rows.iter().collect();
    let order = gated_order(isa, [gate, up], m);
    by_panel_stripes_many(m, &[out], COLS, 1, &mut [y], |_, p0, p1, stripe| {
        let mut accs = [[[0f32; COLS]; ROWS]; 2];
        gated_panels(isa, order, [gate, up], &rows, p0..p1, &mut accs, &mut |r, k, o| stripe.put(r, k, o));
    });
}

/// The order in which a gated task reads its gate and up panels. The bits are the same either
/// way: each panel's tiles are the same calls on the same rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GatedOrder {
    /// Panel by panel: a panel's gate tiles, then its up tiles, combined at once (every row
    /// chunk while the two panels are in cache). Prefill's many rows, and every CPU but Zen 5.
    Interleaved,
    /// All of the task's gate panels, their products held, then all of its up panels: one
    /// weight stream at a time instead of two alternating every panel. Zen 5, up to `ROWS`
    /// rows (see [`x86::gate_then_up`]).
    GateThenUp,
}

/// The order for `rows` rows of `ws` (gate, up) on `isa`.
fn gated_order(isa: Isa, ws: [&PackedQ8; 2], rows: usize) -> GatedOrder {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Amx | Isa::Avx512Vnni)
        && (1..=ROWS).contains(&rows)
        && !pairs(isa, ws, rows)
        && x86::gate_then_up()
    {
        return GatedOrder::GateThenUp;
    }
    let _ = (isa, ws, rows);
    GatedOrder::Interleaved
}

thread_local! {
    /// [`GatedOrder::GateThenUp`]'s gate products of a task, `[panel][row]`.
    static GATE_HELD: std::cell::RefCell<Vec<[f32; COLS]>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `silu(x·gateᵀ) · (x·upᵀ)` over panels `range` of `gate` and `up` for the quantized `rows`, row
/// `r`'s 16 outputs of panel `range.start + k` handed to `put(r, k, ..)`, reading the panels in
/// `order` (`GateThenUp` only for one to `ROWS` rows). `accs` are the task's tile accumulators.
fn gated_panels(
    isa: Isa,
    order: GatedOrder,
    [gate, up]: [&PackedQ8; 2],
    rows: &[&QuantRow],
    range: std::ops::Range<usize>,
    [g, u]: &mut [Acc; 2],
    put: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let nb = gate.inp / QK;
    let (gb, ub) = (gate.format.panel_bytes(nb), up.format.panel_bytes(nb));
    let (gate_panel, up_panel) = (|p: usize| &gate.data[p * gb..][..gb], |p: usize| &up.data[p * ub..][..ub]);
    let combine = |g: &[f32; COLS], u: &[f32; COLS]| {
        let mut o = [0f32; COLS];
        super::rowwise::silu_mul_row(g, u, &mut o);
        o
    };
    match order {
        GatedOrder::GateThenUp => {
            let m = rows.len();
            // A tile is never called with no rows (it would read a whole tile's).
            assert!((1..=ROWS).contains(&m), "gate-then-up: one tile of rows");
            // The thread's buffer, grown as needed and kept: a decode step makes thousands of
            // these calls (one per expert and task range), each of which would allocate its own.
            GATE_HELD.with_borrow_mut(|held| {
                held.clear();
                held.resize(range.len() * m, [0f32; COLS]);
                for (k, p) in range.clone().enumerate() {
                    tile(isa, gate, rows, gate_panel(p), nb, g);
                    held[k * m..(k + 1) * m].copy_from_slice(&g[..m]);
                }
                for (k, p) in range.enumerate() {
                    tile(isa, up, rows, up_panel(p), nb, u);
                    for (r, (gv, uv)) in held[k * m..(k + 1) * m].iter().zip(u.iter()).enumerate() {
                        put(r, k, &combine(gv, uv));
                    }
                }
            });
        }
        GatedOrder::Interleaved => {
            for (k, p) in range.enumerate() {
                for r0 in (0..rows.len()).step_by(ROWS) {
                    let r1 = (r0 + ROWS).min(rows.len());
                    tile_pair(isa, [gate, up], &rows[r0..r1], [gate_panel(p), up_panel(p)], nb, [&mut *g, &mut *u]);
                    for (i, (gv, uv)) in g.iter().zip(u.iter()).enumerate().take(r1 - r0) {
                        put(r0 + i, k, &combine(gv, uv));
                    }
                }
            }
        }
    }
}

/// A task's AMX tiles. `path` gives [`Isa::Amx`] only where the tiles are usable, so this
/// cannot fail; were it to, the emulation gives the same bits (slowly).
#[cfg(target_arch = "x86_64")]
fn hardware_tiles() -> AmxTiles {
    match super::amx::HardwareTiles::new() {
        Some(t) => AmxTiles::Hardware(t),
        None => AmxTiles::Emulated(super::amx::EmulatedTiles::default()),
    }
}

/// The tiles a task computes on.
#[cfg(target_arch = "x86_64")]
enum AmxTiles {
    Hardware(super::amx::HardwareTiles),
    Emulated(super::amx::EmulatedTiles),
}

#[cfg(target_arch = "x86_64")]
impl super::amx::Int8Tiles for AmxTiles {
    fn configure(&mut self, m: usize, k: usize) {
        match self {
            AmxTiles::Hardware(t) => t.configure(m, k),
            AmxTiles::Emulated(t) => t.configure(m, k),
        }
    }

    #[inline(always)]
    unsafe fn dot(&mut self, a: *const i8, stride: usize, b: *const i8, c: &mut super::amx::Sums, set: usize) {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                AmxTiles::Hardware(t) => t.dot(a, stride, b, c, set),
                AmxTiles::Emulated(t) => t.dot(a, stride, b, c, set),
            }
        }
    }
}

/// Each row of `x` `[m][inp]` quantized to int8 blocks (see [`quantize_each`]).
fn quantize_rows(isa: Isa, x: &[f32], m: usize, inp: usize) -> Vec<QuantRow> {
    let rows: Vec<&[f32]> = x.chunks_exact(inp).take(m).collect();
    quantize_each(isa, &rows)
}

/// Each of `rows` quantized to int8 blocks. Rows are independent; eight or more (a prompt's
/// worth, or a mixture's down projections in a decode batch, whose routed rows arrive as one
/// list across the experts) are split across the threads.
fn quantize_each(isa: Isa, rows: &[&[f32]]) -> Vec<QuantRow> {
    if rows.len() >= 8 {
        let mut done: Vec<Option<QuantRow>> = (0..rows.len()).map(|_| None).collect();
        pool::run_chunks(&mut done, 1, |r, slot| slot[0] = Some(quantize_row(isa, rows[r])));
        // `run` runs every task, so each row is there; recomputing is the (unreachable) fallback.
        done.into_iter().zip(rows).map(|(q, x)| q.unwrap_or_else(|| quantize_row(isa, x))).collect()
    } else {
        rows.iter().map(|x| quantize_row(isa, x)).collect()
    }
}

/// One tile's outputs: up to `ROWS` rows of a panel's `COLS` columns.
type Acc = [[f32; COLS]; ROWS];

/// Sets rows `0..rows.len()` of `acc` to those rows' products with one panel and leaves the
/// rest as they are, so a task reuses one `acc` for all its panels: zeroing a fresh one per
/// panel (a `memset` call) was about 1% of a 16-sequence MoE decode step.
fn tile(isa: Isa, w: &PackedQ8, rows: &[&QuantRow], panel: &[u8], nb: usize, acc: &mut Acc) {
    match isa {
        // One row (decode): VNNI is faster than a tile of one row.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AMX CPUs have AVX-512 F/BW/VNNI; the rest as below.
        Isa::Amx => unsafe { x86::tile_vnni(w.format, rows, panel, nb, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `path` only gives an ISA this CPU has; `panel` holds `nb` blocks of this
        // format and every row `nb · 32` values.
        Isa::Avx512Vnni => unsafe { x86::tile_vnni(w.format, rows, panel, nb, acc) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::tile_avx2(w.format, rows, panel, nb, acc) },
        _ => tile_scalar(w, rows, panel, nb, acc),
    }
}

/// Whether [`tile_pair`] takes two panels of `ws` in one pass for these rows (else it runs them
/// one after the other).
fn pairs(isa: Isa, ws: [&PackedQ8; 2], rows: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return matches!(isa, Isa::Amx | Isa::Avx512Vnni)
        && ws[0].format == ws[1].format
        && (1..=PAIR_ROWS).contains(&rows)
        && x86::pair_panels();
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// [`tile`] for two panels and the same rows, `accs[k]` from `panels[k]` of `ws[k]`: on VNNI (where
/// [`x86::pair_panels`]), for one to [`PAIR_ROWS`] rows of panels of one format, both in one
/// pass that streams their weights side by side (see `x86::vnni_pair`); otherwise one panel after
/// the other. The same bits either way.
fn tile_pair(isa: Isa, ws: [&PackedQ8; 2], rows: &[&QuantRow], panels: [&[u8]; 2], nb: usize, accs: [&mut Acc; 2]) {
    #[cfg(target_arch = "x86_64")]
    if pairs(isa, ws, rows.len()) {
        // SAFETY: as in `tile` (AMX CPUs have AVX-512 F/BW/VNNI); both panels hold `nb` blocks of
        // this format.
        return unsafe { x86::tile_vnni_pair(ws[0].format, rows, panels, nb, accs) };
    }
    let [a0, a1] = accs;
    tile(isa, ws[0], rows, panels[0], nb, a0);
    tile(isa, ws[1], rows, panels[1], nb, a1);
}

/// Panels `range` of `w` for `rows`, row `r`'s 16 outputs of panel `range.start + k` handed to
/// `put(r, k, ..)`. Where [`tile_pair`] takes two panels a pass (decode's few rows), the first
/// half of the range goes with the second half, panel by panel, so that each of the two weight
/// streams runs on through memory from one pass to the next. Pairing neighbouring panels instead
/// started one of the streams afresh at every pass, its first blocks not yet prefetched, which
/// cost most where panels are short. On the Sapphire Rapids-class Xeon (2026-12-06, 2 threads,
/// the two ways alternated):
/// - a 768-input Q4_K weight of 1.1 GB (the shape of a mixture's down projections;
///   `q8_tile_cost --out 2621440 --in 768 --rows 1,2,3 --calls 2`) streamed 30.1–30.5, 29.2–29.6
///   and 27.6–28.0 GB/s for 1, 2 and 3 rows against 26.6–27.2, 25.0–25.2 and 23.8; a
///   2048-input one 31.4–31.6 against 29.6–31.2 for one row;
/// - qwen3-30b-a3b's experts (`moe_cost`): 0.92–0.94 of plain reads at one row against 0.88, and
///   0.89 at 16 rows against 0.84–0.85;
/// - the whole model, every decode step alternated between the two ways in one process: step
///   time 0.978 of the neighbours' at one sequence (126 pairs of steps), 0.965 at 16 (63).
///
/// Otherwise one panel after the other, each over all the rows (prefill's order).
fn panel_run(
    isa: Isa,
    w: &PackedQ8,
    rows: &[&QuantRow],
    range: std::ops::Range<usize>,
    [acc, next]: &mut [Acc; 2],
    put: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let nb = w.inp / QK;
    let pb = w.format.panel_bytes(nb);
    let panel = |k: usize| &w.data[(range.start + k) * pb..][..pb];
    let n = range.len();
    if pairs(isa, [w, w], rows.len()) {
        let half = n.div_ceil(2);
        for k in 0..n / 2 {
            tile_pair(isa, [w, w], rows, [panel(k), panel(half + k)], nb, [&mut *acc, &mut *next]);
            for r in 0..rows.len() {
                put(r, k, &acc[r]);
                put(r, half + k, &next[r]);
            }
        }
        if n % 2 == 1 {
            tile(isa, w, rows, panel(half - 1), nb, acc);
            for (r, a) in acc.iter().enumerate().take(rows.len()) {
                put(r, half - 1, a);
            }
        }
        return;
    }
    for k in 0..n {
        for r0 in (0..rows.len()).step_by(ROWS) {
            let r1 = (r0 + ROWS).min(rows.len());
            tile(isa, w, &rows[r0..r1], panel(k), nb, acc);
            for (i, a) in acc.iter().enumerate().take(r1 - r0) {
                put(r0 + i, k, a);
            }
        }
    }
}

fn read_f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The reference. Per block and column, exact integer sums `isum = Σ xq·stored` (Q6_K: one per
/// 16-input half), then, in block order, with `d_x` the activation block's scale:
/// - Q8_0/Q4_0: `e = isum − offset·Σxq`; `acc = fma(e, d_w·d_x, acc)`.
/// - Q4_K: `acc = fma(isum, (sc·d)·d_x, acc)`, then `acc = fma(m·(−dmin), d_x·Σxq, acc)`.
/// - Q6_K: per half `h`: `acc = fma(isum_h − 32·Σxq_h, (sc_h·d)·d_x, acc)`.
///
/// The integer-to-float conversions and the products of a 6- or 8-bit integer with an f16 are
/// exact; the SIMD paths perform the same roundings in the same order.
fn tile_scalar(w: &PackedQ8, rows: &[&QuantRow], panel: &[u8], nb: usize, acc: &mut Acc) {
    for (r, row) in rows.iter().enumerate() {
        acc[r] = [0.0; COLS];
        for b in 0..nb {
            for c in 0..COLS {
                let mut isum = [0i32; 2];
                for k in 0..QK {
                    isum[k / 16] += row.q[b * QK + k] as i32 * w.stored(panel, w.format.block_at(b), entry(k, c));
                }
                fold(w.format, panel, b, c, isum, row, &mut acc[r][c]);
            }
        }
    }
}

/// Folds block `b`'s exact integer sums for column `c` of one row (`isum`: over its first and
/// second 16 inputs; only Q6_K needs them apart) into the row's f32 accumulator `a`: the fixed
/// sequence of roundings [`tile_scalar`] documents, shared by every path that computes the sums
/// some other way (the AMX tiles).
#[inline(always)]
fn fold(f: Format, panel: &[u8], b: usize, c: usize, isum: [i32; 2], row: &QuantRow, a: &mut f32) {
    let (base, head, vals) = (f.block_at(b), f.header_at(b), f.values());
    let (sum, half, dx) = (row.sum[b], row.half[b], row.d[b]);
    let (m0, m1) = match f {
        Format::Q4_K => q4k_meta(panel, base + vals, c),
        _ => (panel[base + vals + c], panel[base + vals + COLS + c]),
    };
    match f {
        Format::Q8_0 | Format::Q4_0 => {
            let e = isum[0] + isum[1] - f.offset() * sum;
            *a = (e as f32).mul_add(read_f16(panel, base + vals + 2 * c) * dx, *a);
        }
        Format::Q4_K => {
            let (d, dmin) = (read_f16(panel, head + 2 * c), read_f16(panel, head + 2 * COLS + 2 * c));
            *a = ((isum[0] + isum[1]) as f32).mul_add((m0 as f32 * d) * dx, *a);
            *a = (m1 as f32 * -dmin).mul_add(row.dsum[b], *a);
        }
        Format::Q6_K => {
            let d = read_f16(panel, head + 2 * c);
            let e0 = isum[0] - 32 * half;
            *a = (e0 as f32).mul_add((m0 as i8 as f32 * d) * dx, *a);
            let e1 = isum[1] - 32 * (sum - half);
            *a = (e1 as f32).mul_add((m1 as i8 as f32 * d) * dx, *a);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

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
        crate::kernels::xorshift(seed.wrapping_mul(747_796_405).wrapping_add(1))
            .take(n)
            .map(|s| (s % 2000) as f32 / 1000.0 - 1.0)
            .collect()
    }

    fn ggml_dtype(format: Format) -> GgmlDType {
        match format {
            Format::Q8_0 => GgmlDType::Q8_0,
            Format::Q4_0 => GgmlDType::Q4_0,
            Format::Q4_K => GgmlDType::Q4K,
            Format::Q6_K => GgmlDType::Q6K,
        }
    }

    /// Random GGUF blocks: every bit pattern is a valid block once its f16 scales are sane, so
    /// this reaches every scale bit (Q4_K's packed high bits, Q6_K's negative scales, Q8_0's
    /// −128) that a quantizer might rarely emit.
    pub(super) fn random_blocks(format: Format, out: usize, inp: usize, seed: u32) -> Vec<u8> {
        let n = out * inp / format.ggml_values() * format.ggml_block_bytes();
        let mut raw: Vec<u8> = data(n, seed).iter().map(|v| ((v + 1.0) * 127.9) as u8).collect();
        let d = |k: usize| half::f16::from_f32(0.001 + 0.0005 * (k % 7) as f32).to_le_bytes();
        for (k, blk) in raw.chunks_exact_mut(format.ggml_block_bytes()).enumerate() {
            match format {
                Format::Q8_0 | Format::Q4_0 => blk[..2].copy_from_slice(&d(k)),
                Format::Q4_K => {
                    blk[..2].copy_from_slice(&d(k));
                    blk[2..4].copy_from_slice(&d(k + 3));
                }
                Format::Q6_K => blk[208..].copy_from_slice(&d(k)),
            }
        }
        raw
    }

    /// A packed matrix of random blocks (for other modules' tests).
    pub(super) fn random_packed(format: Format, out: usize, inp: usize, seed: u32) -> PackedQ8 {
        PackedQ8::from_ggml(format, &random_blocks(format, out, inp, seed), out, inp).unwrap()
    }

    /// Random activations in [-1, 1).
    pub(super) fn random_x(n: usize, seed: u32) -> Vec<f32> {
        data(n, seed)
    }

    /// candle's dequantization of the same bytes: an independent reading of the format.
    fn dequantized(format: Format, raw: &[u8], out: usize, inp: usize) -> Vec<f32> {
        let q = QTensor::quantize(
            &Tensor::zeros((out, inp), candle_core::DType::F32, &Device::Cpu).unwrap(),
            ggml_dtype(format),
        )
        .unwrap();
        assert_eq!(q.data().unwrap().len(), raw.len());
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Borrowed(raw),
            &Device::Cpu,
            ggml_dtype(format),
        )
        .unwrap();
        let q = QTensor::new(storage, (out, inp)).unwrap();
        q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// The kernel's paths (AMX, for two or more rows, only where the CPU has the tiles; its
    /// emulation runs everywhere, in `amx`'s tests).
    const ISAS: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx];

    /// Every path gives the scalar path's bits, and the scalar path is the f64 product of the
    /// dequantized weight (read by candle) with the quantized activations, to f32 rounding.
    fn check(format: Format, raw: &[u8], out: usize, inp: usize) {
        let p = PackedQ8::from_ggml(format, raw, out, inp).unwrap();
        let w = dequantized(format, raw, out, inp);
        for m in 1..=9 {
            let x = data(m * inp, 2 + m as u32);
            let mut ys = vec![0f32; m * out];
            matmul_with(Isa::Scalar, &x, m, &p, &mut ys);
            for isa in ISAS {
                if !isa.available() {
                    eprintln!("{isa:?} not on this CPU: not compared");
                    continue;
                }
                let mut y = vec![0f32; m * out];
                matmul_with(isa, &x, m, &p, &mut y);
                assert_eq!(ys, y, "{format:?} m={m}: {isa:?} must give the scalar path's bits");
            }
            for i in 0..m {
                let q = quantize_row_scalar(&x[i * inp..(i + 1) * inp]);
                for o in 0..out {
                    let (mut r, mut mag) = (0f64, 0f64);
                    for k in 0..inp {
                        let t = q.q[k] as f64 * q.d[k / QK] as f64 * w[o * inp + k] as f64;
                        (r, mag) = (r + t, mag + t.abs());
                    }
                    let got = ys[i * out + o] as f64;
                    assert!((got - r).abs() <= 1e-5 * mag + 1e-6, "{format:?} ({i},{o}): {got} vs {r}");
                }
            }
        }
    }

    #[test]
    fn every_path_matches_the_scalar_reference_and_the_dequantized_product() {
        let (out, inp) = (37, 96);
        let w = data(out * inp, 1);
        check(Format::Q8_0, &q8_blocks(&w, out, inp), out, inp);
        check(Format::Q4_0, &q4_blocks(&w, out, inp), out, inp);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let inp = 2 * format.ggml_values().max(QK * 3);
            check(format, &random_blocks(format, out, inp, 11), out, inp);
        }
    }

    /// Blocks from candle's own quantizer of a smooth weight (what `flint synth` writes).
    #[test]
    fn quantizer_output_round_trips() {
        let (out, inp) = (20, 512);
        let w = data(out * inp, 21);
        for format in [Format::Q4_K, Format::Q6_K] {
            let t = Tensor::from_vec(w.clone(), (out, inp), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&t, ggml_dtype(format)).unwrap();
            check(format, &q.data().unwrap(), out, inp);
        }
    }

    #[test]
    fn extreme_values_stay_exact() {
        // Q8_0 at −128 against ±127 activations: AVX2's `vpmaddubsw` pairs at their limit.
        let (out, inp) = (16, 64);
        let mut raw = random_blocks(Format::Q8_0, out, inp, 3);
        for blk in raw.chunks_exact_mut(34) {
            for (k, v) in blk[2..].iter_mut().enumerate() {
                *v = if k % 3 == 0 { 0x80 } else { 0x7F };
            }
        }
        let p = PackedQ8::from_ggml(Format::Q8_0, &raw, out, inp).unwrap();
        let x: Vec<f32> = (0..inp).map(|k| if k % 2 == 0 { -1.0 } else { 1.0 }).collect();
        let mut want = vec![0f32; out];
        matmul_with(Isa::Scalar, &x, 1, &p, &mut want);
        for isa in ISAS.into_iter().filter(|i| i.available()) {
            let mut y = vec![0f32; out];
            matmul_with(isa, &x, 1, &p, &mut y);
            assert_eq!(y, want, "{isa:?}");
        }
    }

    /// Two panels in one pass (`tile_pair`) give each panel the bits `tile` gives it alone: every
    /// format, one to four rows (four takes the one-panel-at-a-time way), on every path this CPU
    /// has; and two weights of different formats (taken one at a time).
    #[test]
    fn paired_panels_give_each_panels_own_bits() {
        let (out, inp) = (32, 512);
        let nb = inp / QK;
        let x = random_x(4 * inp, 41);
        let q6 = random_packed(Format::Q6_K, out, inp, 42);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let w = random_packed(format, out, inp, 43);
            let pb = format.panel_bytes(nb);
            let panels = [&w.data[..pb], &w.data[pb..2 * pb]];
            let mixed = [&w.data[pb..2 * pb], &q6.data[..Format::Q6_K.panel_bytes(nb)]];
            for isa in ISAS.into_iter().filter(|i| i.available()) {
                for m in 1..=4 {
                    let quantized = quantize_rows(isa, &x, m, inp);
                    let rows: Vec<&QuantRow> = quantized.iter().collect();
                    for (ws, panels) in [([&w, &w], panels), ([&w, &q6], mixed)] {
                        let (mut alone, mut paired) = ([[[0f32; COLS]; ROWS]; 2], [[[0f32; COLS]; ROWS]; 2]);
                        for k in 0..2 {
                            tile(isa, ws[k], &rows, panels[k], nb, &mut alone[k]);
                        }
                        let [p0, p1] = &mut paired;
                        tile_pair(isa, ws, &rows, panels, nb, [p0, p1]);
                        for k in 0..2 {
                            assert_eq!(alone[k][..m], paired[k][..m], "{format:?} {isa:?} m={m} panel {k}");
                        }
                        // The two-panel loop itself, whether or not `tile_pair` takes it on this CPU.
                        #[cfg(target_arch = "x86_64")]
                        if isa == Isa::Avx512Vnni && ws[0].format == ws[1].format && m <= PAIR_ROWS {
                            let mut direct = [[[0f32; COLS]; ROWS]; 2];
                            let [d0, d1] = &mut direct;
                            // SAFETY: this CPU has AVX-512 VNNI (checked above); the panels hold `nb`
                            // blocks of this format; one to three rows.
                            unsafe { x86::tile_vnni_pair(format, &rows, panels, nb, [d0, d1]) };
                            for k in 0..2 {
                                assert_eq!(alone[k][..m], direct[k][..m], "{format:?} pair loop m={m} panel {k}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// `panel_run` over ranges of every length from 1 to 7 (odd ones leave a panel unpaired) and
    /// several starts hands each panel's outputs, once, to its own place, with the bits `tile`
    /// gives that panel alone: every format, one to four rows, every path this CPU has.
    #[test]
    fn panel_runs_put_each_panel_once_with_its_own_bits() {
        let (out, inp) = (16 * 12, 256);
        let nb = inp / QK;
        let x = random_x(4 * inp, 61);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let w = random_packed(format, out, inp, 62);
            let pb = format.panel_bytes(nb);
            for isa in ISAS.into_iter().filter(|i| i.available()) {
                for m in 1..=4 {
                    let quantized = quantize_rows(isa, &x[..m * inp], m, inp);
                    let rows: Vec<&QuantRow> = quantized.iter().collect();
                    for (start, len) in [(0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 7)] {
                        let mut got = vec![vec![None; len]; m];
                        let mut accs = [[[0f32; COLS]; ROWS]; 2];
                        panel_run(isa, &w, &rows, start..start + len, &mut accs, &mut |r, k, vals| {
                            assert!(got[r][k].replace(vals.to_vec()).is_none(), "panel {k} row {r} put twice");
                        });
                        for k in 0..len {
                            let mut alone = [[0f32; COLS]; ROWS];
                            tile(isa, &w, &rows, &w.data[(start + k) * pb..][..pb], nb, &mut alone);
                            for (r, row) in got.iter().enumerate() {
                                let want = Some(alone[r].to_vec());
                                assert_eq!(row[k], want, "{format:?} {isa:?} m={m} {start}+{len}: panel {k} row {r}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (out, inp) = (50, 256);
        for format in [Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let p = PackedQ8::from_ggml(format, &random_blocks(format, out, inp, 5), out, inp).unwrap();
            let target = data(inp, 6);
            let mut alone = vec![0f32; out];
            matmul(&target, 1, &p, &mut alone);
            for m in [2, 3, 4, 5, 8, 13] {
                let mut x = data(m * inp, 7 + m as u32);
                let pos = m / 2;
                x[pos * inp..(pos + 1) * inp].copy_from_slice(&target);
                let mut y = vec![0f32; m * out];
                matmul(&x, m, &p, &mut y);
                assert_eq!(&y[pos * out..(pos + 1) * out], &alone[..], "{format:?} m={m}");
            }
        }
    }

    /// Reading all of a range's gate panels before its up panels gives the bits of reading them
    /// panel by panel, and of the scalar reference, on every path this CPU has, for every row
    /// count one tile holds (on Zen 5 the gated calls of decode take that order).
    #[test]
    fn gate_then_up_gives_the_panel_by_panel_bits() {
        let (out, inp) = (64, 512);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let gate = PackedQ8::from_ggml(format, &random_blocks(format, out, inp, 21), out, inp).unwrap();
            let up = PackedQ8::from_ggml(format, &random_blocks(format, out, inp, 22), out, inp).unwrap();
            for m in 1..=ROWS {
                let x = random_x(m * inp, 40 + m as u32);
                let mut reference = vec![MaybeUninit::new(f32::NAN); m * out];
                gated_with(Isa::Scalar, &x, m, &gate, &up, &mut reference);
                let reference = crate::kernels::written(&reference);
                for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni] {
                    let isa = path(isa);
                    let quantized = quantize_rows(isa, &x, m, inp);
                    let rows: Vec<&QuantRow> = quantized.iter().collect();
                    // Panels 1..4 of the 4: a range that starts past the first panel.
                    let run = |order| {
                        let mut y = vec![f32::NAN; m * out];
                        let mut accs = [[[0f32; COLS]; ROWS]; 2];
                        gated_panels(isa, order, [&gate, &up], &rows, 1..4, &mut accs, &mut |r, k, o| {
                            y[r * out + (1 + k) * COLS..][..COLS].copy_from_slice(o)
                        });
                        y
                    };
                    let (interleaved, gate_first) = (run(GatedOrder::Interleaved), run(GatedOrder::GateThenUp));
                    for r in 0..m {
                        let (row, at) = (r * out, r * out + COLS);
                        assert!(
                            gate_first[row..at].iter().all(|v| v.is_nan()),
                            "{format:?} {isa:?}: panel 0 untouched"
                        );
                        assert_eq!(&gate_first[at..row + out], &interleaved[at..row + out], "{format:?} {isa:?} m={m}");
                        assert_eq!(&gate_first[at..row + out], &reference[at..row + out], "{format:?} {isa:?} m={m}");
                    }
                }
            }
        }
    }

    /// `matmul_uninit` writes every output (the caller treats the buffer as initialised after).
    #[test]
    fn uninit_output_is_fully_written() {
        let (out, inp) = (37, 256);
        for format in [Format::Q8_0, Format::Q6_K] {
            let p = PackedQ8::from_ggml(format, &random_blocks(format, out, inp, 31), out, inp).unwrap();
            for m in [1, 7, 8, 9, 20] {
                let x = data(m * inp, 32);
                let mut want = vec![0f32; m * out];
                matmul(&x, m, &p, &mut want);
                let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
                matmul_uninit(&x, m, &p, &mut y);
                let got = crate::kernels::written(&y);
                assert_eq!(got, want, "{format:?} m={m}");
            }
        }
    }

    /// Several matrices (mixed formats, ragged widths) in one call give each one's own bits.
    #[test]
    fn many_matrices_in_one_call_match_each_alone() {
        let inp = 256;
        let specs = [(Format::Q4_K, 40), (Format::Q6_K, 16), (Format::Q8_0, 9), (Format::Q4_0, 33)];
        let ps: Vec<PackedQ8> = specs
            .iter()
            .enumerate()
            .map(|(i, &(f, out))| PackedQ8::from_ggml(f, &random_blocks(f, out, inp, 40 + i as u32), out, inp).unwrap())
            .collect();
        for m in [1, 3, 9] {
            let x = data(m * inp, 50 + m as u32);
            let mut ys: Vec<Vec<MaybeUninit<f32>>> =
                ps.iter().map(|p| vec![MaybeUninit::new(f32::NAN); m * p.out]).collect();
            let mut views: Vec<&mut [MaybeUninit<f32>]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
            matmul_many_uninit(&x, m, &ps.iter().collect::<Vec<_>>(), &mut views);
            for (p, y) in ps.iter().zip(&ys) {
                let mut alone = vec![0f32; m * p.out];
                matmul(&x, m, p, &mut alone);
                let got = crate::kernels::written(y);
                assert_eq!(got, alone, "{:?} m={m}", p.format);
            }
        }
    }

    /// The fused gate/up epilogue gives the bits of the two products followed by `silu_mul`, on
    /// every path, for mixed formats, a ragged last panel and several row counts.
    #[test]
    fn gated_matmul_is_the_two_products_then_silu_mul() {
        let (inp, out) = (256, 40);
        for (fg, fu) in [(Format::Q4_0, Format::Q4_0), (Format::Q8_0, Format::Q4_K), (Format::Q6_K, Format::Q4_K)] {
            let g = PackedQ8::from_ggml(fg, &random_blocks(fg, out, inp, 61), out, inp).unwrap();
            let u = PackedQ8::from_ggml(fu, &random_blocks(fu, out, inp, 62), out, inp).unwrap();
            for m in [1, 5, 9] {
                let x = data(m * inp, 70 + m as u32);
                let (mut gy, mut uy) = (vec![0f32; m * out], vec![0f32; m * out]);
                matmul(&x, m, &g, &mut gy);
                matmul(&x, m, &u, &mut uy);
                let mut want = vec![0f32; m * out];
                crate::kernels::rowwise::silu_mul_row(&gy, &uy, &mut want);
                for isa in ISAS {
                    let mut y = vec![MaybeUninit::new(f32::NAN); m * out];
                    gated_with(isa, &x, m, &g, &u, &mut y);
                    let got = crate::kernels::written(&y);
                    assert_eq!(got, want, "{fg:?}/{fu:?} m={m} {isa:?}");
                }
            }
        }
    }

    /// A packed weight is its panels' blocks and super-block headers, nothing more (a K-quant
    /// panel once carried the header of a super-block after its last), and exactly the file's
    /// bytes when the columns fill whole panels (Q4_K's scales once took 32 bytes a block, not 24).
    #[test]
    fn packed_weights_hold_no_padding() {
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            for (out, inp) in [(16, 768), (37, 2048), (48, 256)] {
                let raw = random_blocks(format, out, inp, 9);
                let p = PackedQ8::from_ggml(format, &raw, out, inp).unwrap();
                let nb = inp / QK;
                let per_panel = nb * format.panel_block() + nb / SUPER * format.header();
                assert_eq!(p.packed_bytes(), out.div_ceil(COLS) * per_panel, "{format:?} {out}x{inp}");
                if out % COLS == 0 {
                    assert_eq!(p.packed_bytes(), raw.len(), "{format:?} {out}x{inp}: the file's size");
                }
            }
        }
    }

    #[test]
    fn malformed_input_is_refused() {
        assert!(PackedQ8::from_ggml(Format::Q8_0, &[0; 34], 1, 33).is_none());
        assert!(PackedQ8::from_ggml(Format::Q8_0, &[0; 33], 1, 32).is_none());
        assert!(PackedQ8::from_ggml(Format::Q4_0, &[0; 34], 1, 32).is_none());
        // K-quant rows must be whole 256-value super-blocks.
        assert!(PackedQ8::from_ggml(Format::Q4_K, &[0; 144], 2, 128).is_none());
        assert!(PackedQ8::from_ggml(Format::Q6_K, &[0; 209], 1, 256).is_none());
        assert!(PackedQ8::from_ggml(Format::Q6_K, &[], 1, 0).is_none());
    }
}
