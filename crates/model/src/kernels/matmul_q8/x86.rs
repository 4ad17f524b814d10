//! The x86 paths of [`super`]: AVX-512 quantization, the VNNI tile and the AVX2 tile. Each
//! computes exactly [`super::tile_scalar`]'s integers and f32 operations, in its order.

use super::{
    offset_terms, scaled_sums, Acc, Format, QuantRow, COLS, NEG_Q4_0, NEG_Q6_HI, NEG_Q6_LO, NEG_Q8_0, QK, SUPER,
};
use crate::kernels::isa::{streamer, Streamer};
use std::arch::x86_64::*;

const Q8_0: u8 = Format::Q8_0.tag();
const Q4_0: u8 = Format::Q4_0.tag();
const Q4_K: u8 = Format::Q4_K.tag();
const Q6_K: u8 = Format::Q6_K.tag();

/// `$by_rows!(TAG, extra..)` with the const tag of the runtime `$format`: where a tile entry point
/// turns the weight's format into its loops' const parameter.
macro_rules! by_format {
    ($format:expr, $by_rows:ident $(, $extra:expr)*) => {
        match $format {
            Format::Q8_0 => $by_rows!(Q8_0 $(, $extra)*),
            Format::Q4_0 => $by_rows!(Q4_0 $(, $extra)*),
            Format::Q4_K => $by_rows!(Q4_K $(, $extra)*),
            Format::Q6_K => $by_rows!(Q6_K $(, $extra)*),
        }
    };
}

/// [`super::quantize_row_scalar`] sixteen lanes at a time: the same max, the same `1/scale`, the
/// same round-to-nearest-even, so the same bytes.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn quantize_row(x: &[f32]) -> QuantRow {
    let nb = x.len() / QK;
    let mut row = QuantRow {
        q: vec![0i8; nb * QK],
        d: vec![0f32; nb],
        sum: vec![0; nb],
        half: vec![0; nb],
        neg: Vec::new(),
        dsum: Vec::new(),
    };
    let magic = _mm512_set1_ps(12_582_912.0);
    let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
    for b in 0..nb {
        let p = x.as_ptr().add(b * QK);
        let (v0, v1) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        let scale = amax / 127.0;
        *row.d.get_unchecked_mut(b) = scale;
        if scale > 0.0 {
            let inv = _mm512_set1_ps(1.0 / scale);
            let round = |v| {
                let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, inv), magic), magic);
                _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(r), lo), hi)
            };
            let (i0, i1) = (round(v0), round(v1));
            let out = row.q.as_mut_ptr().add(b * QK);
            _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(i0));
            _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(i1));
            let half = _mm512_reduce_add_epi32(i0);
            *row.half.get_unchecked_mut(b) = half;
            *row.sum.get_unchecked_mut(b) = half + _mm512_reduce_add_epi32(i1);
        }
    }
    row.neg = offset_terms(&row.sum, &row.half);
    row.dsum = scaled_sums(&row.d, &row.sum);
    row
}

/// How far ahead of the block being read the weight stream is prefetched, in bytes (rounded to
/// whole panel blocks): into L2 well ahead, then into L1 shortly before use (which of the two a
/// tile issues depends on the CPU and the rows: [`vnni_ahead`]). The loop carries enough
/// arithmetic per byte that the out-of-order window alone does not keep enough misses in flight.
/// Measured on Zen 4 on Q4_0 at one row (a 150 MB matrix, medians
/// of 30 alternated runs): 9 KB to L2 plus 2.3 KB to L1 streamed 13–15% faster than 2.3 KB to
/// L1 alone, and 6% faster than L2 alone; the non-temporal hint and no prefetch were slower.
///
/// Checked again on the whole qwen3-30b-a3b Q4_K model, 16 sequences' decode (`flint bench
/// throughput`, 3 pairs of runs alternated in one process, Zen 4, 2 threads), against these
/// distances: the L2 one doubled 0.96–0.99×, halved 0.87–0.93×; the L1 one doubled 0.91–1.00×;
/// no prefetch in the 1–3-row tiles (the experts' case) 0.84–0.94×. With no prefetch at all, a
/// lone 180 MB matrix at one row streamed faster while the host's bandwidth peaked (55–59
/// against 46 GB/s), and the model's 16-token prefill lost 15–20%. One-row tiles on Zen 4 do
/// better without it: see [`vnni_ahead`]. The L1 distance reaches the tiles opaque to the
/// compiler: see [`Ahead::new`].
const PREFETCH_L2_BYTES: usize = 9216;
const PREFETCH_L1_BYTES: usize = 2304;

fn intel() -> bool {
    streamer() == Streamer::Intel
}

/// Up to how many rows a Zen 5 tile prefetches into L2 only (see [`vnni_ahead`]).
const FAR_ONLY_ROWS: usize = 4;

/// Which prefetches a VNNI tile of `rows` rows issues (`None`: none), per CPU. One- to few-row
/// tiles are every matmul of a single sequence's decode and a mixture's experts at any batch.
///
/// **Intel: into L1 only, at every row count.** On the project's Sapphire Rapids-class Xeon (2
/// threads, alternated runs) the L1 prefetch alone streamed faster than with the far one too:
/// the grouped experts of qwen3-30b-a3b at 16 rows (`moe_cost`) 24.9–25.0 against 23.0–23.1 GB/s
/// (none at all: 21.4–21.5; L2 alone: 22.8–23.1), a Q4_K qwen2.5-1.5b decoded 28.9–29.7 tok/s
/// against 25.9–28.0. There the L2 streamer runs ahead on its own, and a software prefetch holds
/// one of the core's few fill buffers until its line arrives, as a demand miss does: in a profile
/// of the 16-sequence decode there, 41% of the tile's samples sat on its `prefetcht0`s. Other L1
/// prefetches on the same Xeon (`moe_cost --rows 16`, 2 alternations, time against these
/// distances): twice as far 1.10–1.15×, half as far 0.98×, every other line 0.98–1.04×, into L2
/// (T1) 0.95–0.97×; none clear of the noise. Asking for the first two lines of each 4 KiB page 16
/// KiB ahead (Intel's L2 streamer stops at every 4 KiB boundary and trains again) looked better
/// alone while `membw` read 25.5 GB/s: one-row calls (`call_cost`) 24.4–25.3 against 17.7–18.9
/// GB/s, the experts at 16 rows (`moe_cost`) 9.9–10.4 against 12.4–12.7 ms a layer. On the whole
/// model, alternated with the same binary without it, it was level: 16 sequences 25.91 and 25.27
/// against 24.38 and 25.78 tok/s, tg128 11.83 against 12.03. Not kept. One-row calls without any
/// prefetch streamed at 0.77× (`call_cost`, 3 alternated rounds: one lm_head-sized Q4_K call
/// 21.5–22.1 against 28.1–29.1 GB/s, qwen3-30b-a3b's per-layer calls 20.2–21.1 against 26.3–27.5;
/// adding the far prefetch was level, 27.8–28.8).
///
/// **Zen 5 (AMD family 26): into L2 only up to [`FAR_ONLY_ROWS`] rows, into both beyond.**
/// Measured 2026-12-06 on a 2-core EPYC of family 26 model 2 (2 threads, the ways alternated
/// call by call or decode step by decode step within one process, so each pair saw the same
/// moments of this shared host, whose `membw` huge-page read moved between 44 and 74 GB/s):
/// - a 1.2 GB Q4_K weight (`--out 1048576 --in 2048`) at one row: none (Zen 4's choice) 33–38
///   GB/s, both prefetches 60–64, L1 only 66–70, L2 only 73–76 while `membw` read 68–74; a 1.1 GB
///   768-input one (the experts' down shape) 35 against 71; L2 at half the distance level, at
///   twice 0.95;
/// - two and three rows, L2 only against both: 72–78 against 61–70 GB/s (and 40–49 against 39–45
///   in a slower minute); four rows 67 against 64; eight and sixteen rows (compute-bound) L2 only
///   was slower, 35 against 40 and 20.1 against 20.8;
/// - the whole of qwen3-30b-a3b Q4_K, one sequence, every decode step alternated: L2-only one-row
///   tiles took 0.597 of the steps without prefetch (quartiles 0.584–0.614; 30.6 against 50.9 ms),
///   qwen2.5-1.5b Q4_K 0.600 and 0.759 (two runs); 16 sequences 0.845 (0.828–0.860); at 16
///   sequences L2 only at every row count against both beyond one row 0.993, level;
/// - the pair loop ([`pair_panels`]) on top was slower at one row (64–68 against 71–74 GB/s) and
///   three (46–55 against 61–70).
///
/// **Zen 4 (AMD family 25) and others: none at one row, both beyond.** On the project's Zen 4 (2
/// threads, every decode step alternated with the prefetching tile in one process), step time
/// without the one-row prefetch against with it: qwen3-30b-a3b Q4_K single stream 0.89–0.99× (ten
/// runs of 256 tokens), qwen2.5-1.5b Q4_K 0.97–0.99×, qwen3-30b-a3b's 16 sequences 0.96–1.02× (six
/// windows of 30 pairs). At 16 sequences, dropping it in the two-row tiles as well was 1.01–1.02×
/// and keeping the far prefetch alone in one-row tiles 1.14–1.16×. Why Zen 4 and Zen 5 differ so
/// much is not known: these hosts expose no hardware counters.
fn vnni_ahead(rows: usize, pb: usize) -> Option<Ahead> {
    match (streamer(), rows) {
        (Streamer::Intel, _) => Some(Ahead::new(pb, false, true)),
        (Streamer::Zen5, r) if r <= FAR_ONLY_ROWS => Some(Ahead::new(pb, true, false)),
        (Streamer::Other, 1) => None,
        _ => Some(Ahead::new(pb, true, true)),
    }
}

/// How far ahead a tile's weight stream is prefetched, in bytes: whole panel blocks of `pb`
/// bytes, into L2 at `l2` (where `far`) and into L1 at `l1` (where `near`). Worked out once per
/// tile call.
#[derive(Clone, Copy)]
struct Ahead {
    l1: usize,
    l2: usize,
    far: bool,
    near: bool,
}

impl Ahead {
    /// The L1 distance passes through `black_box`, so the compiler does not fold it into the
    /// prefetch instructions' displacements. With it folded, the three-row Q4_K and Q6_K tiles
    /// streamed a third slower than the two- and four-row ones on the Sapphire Rapids-class
    /// Xeon, in the examples and in the `flint` binary alike, while the in-cache tile was as fast
    /// as ever. The instructions were the same either way; only where the loops landed differed
    /// (the slow three-row loops began on a 32-byte boundary, the fast ones 16 bytes past one),
    /// so this is code placement, which a change to this function, or to code that shifts where
    /// it starts (functions are aligned to 16 bytes only), can move again. Measured
    /// 2026-12-06, 2 threads, this against the folded build alternated:
    /// - `q8_tile_cost --out 262144 --in 2048 --rows 1,2,3,4,5,6,7,8 --calls 3` (a 302 MB Q4_K
    ///   weight streamed mostly from memory; about a tenth faster than a 1.2 GB one, which the
    ///   last-level cache cannot help: see `q8_tile_cost`): three rows 22.5–22.6 against 15.1–15.3 GB/s (Q6_K 22.5
    ///   against 15.5); the other row counts within ±4%.
    /// - qwen2.5-1.5b Q4_K (`flint synth`) decoding N sequences (`flint bench throughput
    ///   --num-prompts N --max-num-seqs N`): 3 sequences 66.8–68.8 against 54.2–54.4 tok/s (so
    ///   three cost more a step than four did); 1, 2, 4, 8 and 16 sequences −3% to +7%.
    /// - qwen3-30b-a3b's experts at 16 rows (`moe_cost --rows 16 --iters 10`, where a tenth of
    ///   the chosen experts have three rows): 9.3–9.7 against 9.6–10.7 ms a layer, 0.78–0.79
    ///   against 0.72–0.76 of plain reads; the whole model's 16 sequences level within this
    ///   host's noise (2 alternated rounds).
    ///
    /// A row count that streams well below both neighbours in the first command is this again.
    fn new(pb: usize, far: bool, near: bool) -> Self {
        let l1 = std::hint::black_box(PREFETCH_L1_BYTES);
        Ahead { l1: (l1 / pb).max(1) * pb, l2: (PREFETCH_L2_BYTES / pb).max(1) * pb, far, near }
    }
}

/// Prefetch the panel blocks `ahead` gives after the one at `base` (past the panel's end the
/// addresses are only hints, never read).
#[inline(always)]
unsafe fn prefetch_ahead(base: *const u8, pb: usize, ahead: Ahead) {
    let (l2, l1) = (base.wrapping_add(ahead.l2), base.wrapping_add(ahead.l1));
    let mut line = 0;
    while line < pb {
        if ahead.far {
            _mm_prefetch(l2.wrapping_add(line) as *const i8, _MM_HINT_T1);
        }
        if ahead.near {
            _mm_prefetch(l1.wrapping_add(line) as *const i8, _MM_HINT_T0);
        }
        line += 64;
    }
}

/// Up to how many rows the Q4 tile keeps the high nibbles' sums apart (see `vnni`). With more,
/// the shift is shared by enough rows to cost little, and the extra accumulators crowd the 32
/// vector registers: at 8 rows that version measured 0.91× the shift's speed.
const MASKED_HIGH_ROWS: usize = 3;

/// The VNNI tile for `rows.len()` (≤ `ROWS`) rows of `format`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn tile_vnni(format: Format, rows: &[&QuantRow], panel: &[u8], nb: usize, acc: &mut Acc) {
    macro_rules! by_rows {
        ($f:expr) => {
            match rows.len() {
                1 => vnni::<{ $f }, 1>(rows, panel, nb, acc),
                2 => vnni::<{ $f }, 2>(rows, panel, nb, acc),
                3 => vnni::<{ $f }, 3>(rows, panel, nb, acc),
                4 => vnni::<{ $f }, 4>(rows, panel, nb, acc),
                5 => vnni::<{ $f }, 5>(rows, panel, nb, acc),
                6 => vnni::<{ $f }, 6>(rows, panel, nb, acc),
                7 => vnni::<{ $f }, 7>(rows, panel, nb, acc),
                _ => vnni::<{ $f }, 8>(rows, panel, nb, acc),
            }
        };
    }
    by_format!(format, by_rows)
}

/// [`super::q4k_meta`] for all 16 columns of a Q4_K panel block's scales at `meta`: (`sc`, `m`),
/// a byte per column. Plain SSE2, so every path's target features cover it.
#[inline(always)]
pub(super) unsafe fn q4k_meta(meta: *const u8) -> (__m128i, __m128i) {
    let low = _mm_loadu_si128(meta as *const __m128i);
    let high = _mm_loadl_epi64(meta.add(COLS) as *const __m128i);
    let nibble = _mm_set1_epi8(0x0F);
    // Column c's nibble (byte c / 2, even columns low) into byte c. The 16-bit shifts carry bits
    // across bytes only into positions the masks drop; `top << 2` stays within its byte (≤ 60).
    let top = _mm_unpacklo_epi8(_mm_and_si128(high, nibble), _mm_and_si128(_mm_srli_epi16(high, 4), nibble));
    let sc = _mm_and_si128(low, _mm_set1_epi8(63));
    let m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(low, 6), _mm_set1_epi8(3)), _mm_slli_epi16(top, 2));
    (sc, m)
}

/// Q6_K's top two bits of group `g % 4` from its 2-bit-field vector, at bits 4–5 of each byte.
/// (The 16-bit shifts carry bits across bytes only into positions the mask drops.)
#[inline(always)]
unsafe fn q6_high_512(h: __m512i, g: usize) -> __m512i {
    let m = _mm512_set1_epi8(0x30);
    match g % 4 {
        0 => _mm512_and_si512(_mm512_slli_epi16(h, 4), m),
        1 => _mm512_and_si512(_mm512_slli_epi16(h, 2), m),
        2 => _mm512_and_si512(h, m),
        _ => _mm512_and_si512(_mm512_srli_epi16(h, 2), m),
    }
}

/// The VNNI tile's loop for `R` rows of format `F`. Its speed where the weights are cached (the
/// dense projections of a batch): on the Sapphire Rapids-class Xeon, one thread, a 1024 × 2048
/// Q4_K weight (`q8_tile_cost`), 8 rows ran at 150–157 GMAC/s, about 2.4 `vpdpbusd` a
/// nanosecond, where a loop of nothing but independent `vpdpbusd`s retires 6.3 (two a cycle)
/// and one that also broadcasts each from memory 5.2. With the fold's four vector instructions
/// a row and block, the loop issues about 4.3 a nanosecond against the 6.3 sustained above.
/// Dropping the whole fold (timing only, wrong sums) made it 1.2–1.3× faster. No faster, in a C
/// model of this loop that ran at the same speed: separate high-nibble sums at 8 rows,
/// 64-byte-aligned value loads, the rows' activations in one interleaved array, two to four
/// panels sharing each broadcast (2 × 4, 2 × 6, 3 × 4 and 4 × 2 panels × rows: 0.67–1.05× of
/// 1 × 8); nor, here, `-C llvm-args=-align-loops=32` or `64`. No hardware counters to say more.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn vnni<const F: u8, const R: usize>(rows: &[&QuantRow], panel: &[u8], nb: usize, acc: &mut Acc) {
    let format = Format::from_tag(F);
    let ahead = vnni_ahead(R, format.panel_block());
    let x = RowPtrs::<R>::new(rows);
    let mut s = PanelSums::<R>::new();
    for b in 0..nb {
        vnni_block::<F, R>(panel.as_ptr(), b, &x, ahead, &mut s);
    }
    s.store(acc);
}

/// [`vnni`] over two panels at once, block by block, for the same rows: the same operations on
/// each panel in the same order (so the same bits), with two weight streams in flight instead of
/// one. Measured on the Sapphire Rapids-class Xeon, 2 threads (2026-12-06), a loop of this shape
/// in C (`scripts/tile_stream.c`, 2 GiB of Q4_K panels, medians of 5) streamed 1, 2 and 3 rows at
/// 34.6–35.2, 34.4–35.2 and 33.9–35.2 GB/s against 33.3–34.0, 30.8–31.2 and 28.6–29.4 for one
/// panel at a time, while `membw` read 33.1–34.2: the tile's arithmetic slows one stream, not
/// two (four panels at once were no faster than two). This loop itself, on a 1.2 GB Q4_K weight
/// (`q8_tile_cost --out 1048576 --in 2048 --rows 1,2,3 --calls 2`, 2 alternated rounds): 30.3–30.7,
/// 32.0–32.1 and 27.2–28.0 GB/s against 29.7–30.0, 26.7–27.0 and 24.7–24.8. On qwen3-30b-a3b Q4_K,
/// every decode step alternated between the two ways in one process (so both saw the same
/// moments of this shared host's memory), step time against one panel at a time: 16 sequences
/// 0.927 (median of 56 adjacent pairs), one sequence 0.932 (124 pairs). Up to `PAIR_ROWS`
/// rows; with more the tile is compute-bound and two panels' sums would crowd the registers.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn vnni_pair<const F: u8, const R: usize>(
    rows: &[&QuantRow],
    panels: [&[u8]; 2],
    nb: usize,
    accs: [&mut Acc; 2],
) {
    let format = Format::from_tag(F);
    let ahead = vnni_ahead(R, format.panel_block());
    let x = RowPtrs::<R>::new(rows);
    let (mut s0, mut s1) = (PanelSums::<R>::new(), PanelSums::<R>::new());
    for b in 0..nb {
        vnni_block::<F, R>(panels[0].as_ptr(), b, &x, ahead, &mut s0);
        vnni_block::<F, R>(panels[1].as_ptr(), b, &x, ahead, &mut s1);
    }
    let [a0, a1] = accs;
    s0.store(a0);
    s1.store(a1);
}

/// Whether the VNNI paths take two panels at a time where they can ([`tile_vnni_pair`]): on
/// Intel, where it won (see [`vnni_pair`]). On Zen 4 (2026-12-06, 2 threads) it was level, so
/// the simpler one-panel loop stays there:
/// - qwen3-30b-a3b Q4_K, every decode step alternated between the two ways in one process: step
///   time 1.010 of one panel's at one sequence (256 pairs of steps, quartiles 0.983–1.041), 1.000
///   at 16 sequences (61 pairs, 0.969–1.021);
/// - a 1.1 GB 768-input Q4_K weight (`q8_tile_cost --out 2621440 --in 768 --calls 1`), the two
///   ways alternated call by call within one process: time 0.99–1.05 of one panel's at one row,
///   0.90–0.99 at two, 1.01–1.20 at three;
/// - `scripts/tile_stream.c`: two panels at once streamed slower than one (R1 29.3 against 33.2
///   GB/s, R2 28.7 against 33.1).
///
/// This host's bandwidth moved between about 35 and 60 GB/s from one minute to the next: the
/// two ways in alternate runs of the example (a minute each) showed the pair 1.4–1.7× faster at
/// one and two rows, which the call-by-call alternation did not.
///
/// On Zen 5 (AMD family 26, 2026-12-06, alternated call by call) it was slower, on top of that
/// CPU's L2-only prefetch: see [`vnni_ahead`].
pub fn pair_panels() -> bool {
    intel()
}

/// Whether a gated call reads each task's gate panels before its up panels
/// ([`super::GatedOrder::GateThenUp`]) where its rows fit one tile: on Zen 5, where one long
/// run of one weight read faster than two alternating every panel (18 KB of a 2048-wide Q4_K
/// panel), as it did than two side by side ([`pair_panels`]). Measured 2026-12-06 on a 2-core
/// EPYC of family 26 model 2, 2 threads, the same bits either way:
/// - qwen3-30b-a3b's experts, one layer (`moe_cost`, the kernel against plain reads of the same
///   bytes pass by pass, separate runs alternated): 16 rows 0.95–1.00 of plain reads (five
///   runs) against 0.91–0.93 panel by panel; four rows 0.94–0.96 against 0.91–0.93; one row
///   noisy both ways (0.86 and 0.78 against 0.97 and 0.76);
/// - the whole model, Q4_K, every decode step alternated between the two orders in one process
///   (step time against its two neighbours'): 16 sequences of 128 + 128 tokens (`bench
///   throughput`) 0.962 (median of 59 steps, quartiles 0.939–0.994; the gate/up calls 0.927),
///   and 0.943 (0.926–0.962) for a first version that held whole tiles; one sequence 0.982
///   (0.945–1.027, 124 steps);
/// - qwen2.5-1.5b Q4_K, one sequence, every step alternated: 0.973 (0.913–1.026, 249 steps),
///   the MLP 0.968.
///
/// Not measured on Zen 4 or Intel, which keep panel by panel (Intel's pair loop reads the two
/// side by side).
pub fn gate_then_up() -> bool {
    streamer() == Streamer::Zen5
}

/// [`tile_vnni`] for two panels of one format and the same rows (one to `PAIR_ROWS`), both at
/// once (see [`vnni_pair`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn tile_vnni_pair(format: Format, rows: &[&QuantRow], panels: [&[u8]; 2], nb: usize, accs: [&mut Acc; 2]) {
    macro_rules! by_rows {
        ($f:expr) => {
            match rows.len() {
                1 => vnni_pair::<{ $f }, 1>(rows, panels, nb, accs),
                2 => vnni_pair::<{ $f }, 2>(rows, panels, nb, accs),
                _ => vnni_pair::<{ $f }, 3>(rows, panels, nb, accs),
            }
        };
    }
    by_format!(format, by_rows)
}

/// Where the VNNI loop reads its `R` rows: their int8 values, block scales, scaled sums and
/// negated offset terms.
struct RowPtrs<const R: usize> {
    xq: [*const i8; R],
    dx: [*const f32; R],
    dsum: [*const f32; R],
    neg: [*const [i32; 4]; R],
}

impl<const R: usize> RowPtrs<R> {
    #[inline(always)]
    unsafe fn new(rows: &[&QuantRow]) -> Self {
        let mut p = RowPtrs {
            xq: [std::ptr::null(); R],
            dx: [std::ptr::null(); R],
            dsum: [std::ptr::null(); R],
            neg: [std::ptr::null(); R],
        };
        for r in 0..R {
            let row = rows.get_unchecked(r);
            (p.xq[r], p.dx[r], p.dsum[r], p.neg[r]) =
                (row.q.as_ptr(), row.d.as_ptr(), row.dsum.as_ptr(), row.neg.as_ptr());
        }
        p
    }
}

/// One panel's running state in the VNNI loop: the current super-block's scales (K-quants) and
/// each row's 16 f32 sums.
struct PanelSums<const R: usize> {
    d: __m512,
    nmin: __m512,
    f: [__m512; R],
}

impl<const R: usize> PanelSums<R> {
    #[inline(always)]
    unsafe fn new() -> Self {
        PanelSums { d: _mm512_setzero_ps(), nmin: _mm512_setzero_ps(), f: [_mm512_setzero_ps(); R] }
    }

    #[inline(always)]
    unsafe fn store(&self, acc: &mut Acc) {
        for r in 0..R {
            _mm512_storeu_ps(acc[r].as_mut_ptr(), self.f[r]);
        }
    }
}

/// Block `b` of the panel at `panel` for the rows `x`, folded into `s` (and its weights
/// prefetched `ahead`, where given).
#[inline(always)]
unsafe fn vnni_block<const F: u8, const R: usize>(
    panel: *const u8,
    b: usize,
    x: &RowPtrs<R>,
    ahead: Option<Ahead>,
    s: &mut PanelSums<R>,
) {
    let format = Format::from_tag(F);
    let (vals, pb) = (format.values(), format.panel_block());
    let (xq, dx, dsum, neg) = (&x.xq, &x.dx, &x.dsum, &x.neg);
    let low = _mm512_set1_epi8(0x0F);
    if (F == Q4_K || F == Q6_K) && b.is_multiple_of(SUPER) {
        let h = panel.add(format.header_at(b));
        s.d = _mm512_cvtph_ps(_mm256_loadu_si256(h as *const __m256i));
        if F == Q4_K {
            let dmin = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(h.add(2 * COLS) as *const __m256i)));
            // −dmin exactly (a sign flip: `0 − dmin` would give +0 for dmin = +0).
            s.nmin = _mm512_castsi512_ps(_mm512_xor_si512(dmin, _mm512_set1_epi32(i32::MIN)));
        }
    }
    let (d, nmin, f) = (s.d, s.nmin, &mut s.f);
    let base = panel.add(format.block_at(b));
    if let Some(ahead) = ahead {
        prefetch_ahead(base, pb, ahead);
    }
    // Integer sums over the block; Q6_K keeps inputs 16..32 apart in `ib` (their own scale), and
    // the Q4 formats their high nibbles for a few rows (below).
    // They start at the negated offset terms (`x·stored − offset·Σx` = `x·w`, exactly), so
    // nothing is subtracted after the dot products.
    let (mut ia, mut ib) = ([_mm512_setzero_si512(); R], [_mm512_setzero_si512(); R]);
    for r in 0..R {
        let n = &*neg[r].add(b);
        match F {
            Q8_0 => ia[r] = _mm512_set1_epi32(n[NEG_Q8_0]),
            Q4_0 => ia[r] = _mm512_set1_epi32(n[NEG_Q4_0]),
            Q6_K => (ia[r], ib[r]) = (_mm512_set1_epi32(n[NEG_Q6_LO]), _mm512_set1_epi32(n[NEG_Q6_HI])),
            _ => {}
        }
    }
    macro_rules! dot {
        ($acc:ident, $g:expr, $w:expr) => {{
            let w = $w;
            for r in 0..R {
                let x = (xq[r].add(b * QK + $g * 4) as *const i32).read_unaligned();
                $acc[r] = _mm512_dpbusd_epi32($acc[r], w, _mm512_set1_epi32(x));
            }
        }};
    }
    let load = |at: usize| _mm512_loadu_si512(base.add(at) as *const _);
    if F == Q8_0 {
        for g in 0..8 {
            dot!(ia, g, load(g * COLS * 4));
        }
    } else if F == Q6_K {
        let (h0, h1) = (load(COLS * QK / 2), load(COLS * QK / 2 + 64));
        for g in 0..4 {
            let v = load(g * COLS * 4);
            let wa = _mm512_or_si512(_mm512_and_si512(v, low), q6_high_512(h0, g));
            dot!(ia, g, wa);
            let wb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            dot!(ib, g + 4, _mm512_or_si512(wb, q6_high_512(h1, g)));
        }
    } else {
        // Few rows (decode): the high nibbles go in unshifted, as 16 × their value
        // (`vpdpbusd`'s unsigned operand holds up to 255), into sums of their own that are
        // shifted right by 4 at the end: exact, since each is a multiple of 16. One mask
        // per 64 bytes instead of a shift and a mask, and two dependency chains per row
        // instead of one. Zen 4, one thread, a Q4_K matrix in L2, 24 alternated pairs: one
        // row 3.8% faster, three rows 0.9%.
        let high = _mm512_set1_epi8(0xF0u8 as i8);
        for g in 0..4 {
            let v = load(g * COLS * 4);
            dot!(ia, g, _mm512_and_si512(v, low));
            if R <= MASKED_HIGH_ROWS {
                dot!(ib, g + 4, _mm512_and_si512(v, high));
            } else {
                dot!(ia, g + 4, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
        }
        if R <= MASKED_HIGH_ROWS {
            for r in 0..R {
                ia[r] = _mm512_add_epi32(ia[r], _mm512_srai_epi32(ib[r], 4));
            }
        }
    }
    let meta = base.add(vals);
    match F {
        Q4_K => {
            let (sc, m) = q4k_meta(meta);
            let (sc, m) = (_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
            let (ds, mn) = (_mm512_mul_ps(sc, d), _mm512_mul_ps(m, nmin));
            for r in 0..R {
                let x = *dx[r].add(b);
                f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(ds, _mm512_set1_ps(x)), f[r]);
                f[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(*dsum[r].add(b)), f[r]);
            }
        }
        Q6_K => {
            let s0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(meta as *const __m128i)));
            let s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(meta.add(COLS) as *const __m128i)));
            let (ds0, ds1) = (_mm512_mul_ps(s0, d), _mm512_mul_ps(s1, d));
            for r in 0..R {
                let x = _mm512_set1_ps(*dx[r].add(b));
                f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(ds0, x), f[r]);
                f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib[r]), _mm512_mul_ps(ds1, x), f[r]);
            }
        }
        _ => {
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(meta as *const __m256i));
            for r in 0..R {
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*dx[r].add(b)));
                f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), scale, f[r]);
            }
        }
    }
}

/// The AVX2 tile: rows four at a time, each pass over one half (8 columns) of the panel so the
/// accumulators stay in the 16 registers (the panel is re-read from cache, not memory).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_avx2(format: Format, rows: &[&QuantRow], panel: &[u8], nb: usize, acc: &mut Acc) {
    macro_rules! by_rows {
        ($f:expr, $rows:expr, $out:expr, $h:expr) => {
            match $rows.len() {
                1 => avx2::<{ $f }, 1>($rows, panel, nb, $out, $h),
                2 => avx2::<{ $f }, 2>($rows, panel, nb, $out, $h),
                3 => avx2::<{ $f }, 3>($rows, panel, nb, $out, $h),
                _ => avx2::<{ $f }, 4>($rows, panel, nb, $out, $h),
            }
        };
    }
    for (chunk, out) in rows.chunks(4).zip(acc.chunks_mut(4)) {
        for h in 0..2 {
            by_format!(format, by_rows, chunk, out, h)
        }
    }
}

/// [`q6_high_512`] on 32 bytes.
#[inline(always)]
unsafe fn q6_high_256(h: __m256i, g: usize) -> __m256i {
    let m = _mm256_set1_epi8(0x30);
    match g % 4 {
        0 => _mm256_and_si256(_mm256_slli_epi16(h, 4), m),
        1 => _mm256_and_si256(_mm256_slli_epi16(h, 2), m),
        2 => _mm256_and_si256(h, m),
        _ => _mm256_and_si256(_mm256_srli_epi16(h, 2), m),
    }
}

/// Columns `8h..8h + 8` of `R` rows. `vpmaddubsw` adds pairs into i16 with saturation, so it
/// may only see products that cannot overflow: the 4- and 6-bit weights (≤ 63 × 127 × 2) go in
/// as stored, while Q8_0 goes in as `|w|` against `x` carrying `w`'s sign (≤ 128 × 127 × 2),
/// which yields `Σ x·w` with no offset to take back.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const F: u8, const R: usize>(
    rows: &[&QuantRow],
    panel: &[u8],
    nb: usize,
    out: &mut [[f32; COLS]],
    h: usize,
) {
    let format = Format::from_tag(F);
    let (vals, pb) = (format.values(), format.panel_block());
    // The AVX2 CPUs are older than the tunings of `vnni_ahead`: both, but not L2 on Intel.
    let ahead = Ahead::new(pb, !intel(), true);
    let mut f = [_mm256_setzero_ps(); R];
    let (low, ones, flip) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1), _mm256_set1_epi8(-128));
    let (mut d, mut nmin) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..nb {
        if (F == Q4_K || F == Q6_K) && b.is_multiple_of(SUPER) {
            let hd = panel.as_ptr().add(format.header_at(b) + h * 16);
            d = _mm256_cvtph_ps(_mm_loadu_si128(hd as *const __m128i));
            if F == Q4_K {
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(hd.add(2 * COLS) as *const __m128i));
                nmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0));
            }
        }
        let base = panel.as_ptr().add(format.block_at(b));
        if h == 0 {
            prefetch_ahead(base, pb, ahead);
        }
        let (mut ia, mut ib) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
        macro_rules! dot {
            ($acc:ident, $g:expr, $w:expr) => {{
                let w = $w;
                // Q8_0: `|w|` unsigned, the sign moved onto x.
                let (wu, ws) = if F == Q8_0 {
                    let s = _mm256_xor_si256(w, flip);
                    (_mm256_abs_epi8(s), s)
                } else {
                    (w, w)
                };
                for r in 0..R {
                    let xv = (rows.get_unchecked(r).q.as_ptr().add(b * QK + $g * 4) as *const i32).read_unaligned();
                    let mut x = _mm256_set1_epi32(xv);
                    if F == Q8_0 {
                        x = _mm256_sign_epi8(x, ws);
                    }
                    $acc[r] = _mm256_add_epi32($acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), ones));
                }
            }};
        }
        let load = |at: usize| _mm256_loadu_si256(base.add(at + h * 32) as *const __m256i);
        if F == Q8_0 {
            for g in 0..8 {
                dot!(ia, g, load(g * COLS * 4));
            }
        } else if F == Q6_K {
            let (h0, h1) = (load(COLS * QK / 2), load(COLS * QK / 2 + 64));
            for g in 0..4 {
                let v = load(g * COLS * 4);
                dot!(ia, g, _mm256_or_si256(_mm256_and_si256(v, low), q6_high_256(h0, g)));
                let wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                dot!(ib, g + 4, _mm256_or_si256(wb, q6_high_256(h1, g)));
            }
        } else {
            for g in 0..4 {
                let v = load(g * COLS * 4);
                dot!(ia, g, _mm256_and_si256(v, low));
                dot!(ia, g + 4, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
        }
        let meta = base.add(vals);
        let bytes = |at: usize| _mm_loadl_epi64(meta.add(at + h * 8) as *const __m128i);
        // Q4_K's six-bit scales, this half's 8 columns in the low 8 bytes.
        let (sc, m) = if F == Q4_K {
            let (sc, m) = q4k_meta(meta);
            if h == 0 {
                (sc, m)
            } else {
                (_mm_srli_si128(sc, 8), _mm_srli_si128(m, 8))
            }
        } else {
            (_mm_setzero_si128(), _mm_setzero_si128())
        };
        for r in 0..R {
            let row = rows.get_unchecked(r);
            let (x, sm, hf) = (*row.d.get_unchecked(b), *row.sum.get_unchecked(b), *row.half.get_unchecked(b));
            let xv = _mm256_set1_ps(x);
            match F {
                Q4_K => {
                    let ds = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)), d);
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), _mm256_mul_ps(ds, xv), f[r]);
                    let mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)), nmin);
                    f[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(*row.dsum.get_unchecked(b)), f[r]);
                }
                Q6_K => {
                    let ds0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(0))), d);
                    let e0 = _mm256_sub_epi32(ia[r], _mm256_set1_epi32(32 * hf));
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e0), _mm256_mul_ps(ds0, xv), f[r]);
                    let ds1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(COLS))), d);
                    let e1 = _mm256_sub_epi32(ib[r], _mm256_set1_epi32(32 * (sm - hf)));
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e1), _mm256_mul_ps(ds1, xv), f[r]);
                }
                _ => {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(meta.add(h * 16) as *const __m128i));
                    // Q8_0's sums are signed already (see above).
                    let off = if F == Q8_0 { 0 } else { format.offset() };
                    let e = _mm256_sub_epi32(ia[r], _mm256_set1_epi32(off * sm));
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_mul_ps(dw, xv), f[r]);
                }
            }
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(out[r].as_mut_ptr().add(h * 8), f[r]);
    }
}
