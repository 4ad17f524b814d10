//! flint's own CPU kernels for the hot path, each bit-for-bit independent of batch composition
//! (see each module for how) and tested against a plain reference.

pub mod amx;
pub mod amx_bf16;
pub mod argmax;
pub mod attention;
pub mod huge_buf;
mod isa;
pub mod kv_quant;
pub mod matmul_bf16;
pub mod matmul_f32;
pub mod matmul_q8;
pub mod pool;
pub mod read_probe;
pub mod rowwise;
pub mod streamed;

pub use isa::Isa;

/// The start-up line about the CPU paths: the instruction-set level the kernels use and what
/// became of AMX (absent, refused by the kernel, which tiles are in use, or off: by default or by
/// `FLINT_CPU_ISA`).
pub fn describe() -> String {
    let isa = Isa::detected();
    let asked = std::env::var("FLINT_CPU_ISA").is_ok_and(|v| !v.is_empty());
    let int8_off = if asked {
        "AMX-INT8 capped off by FLINT_CPU_ISA"
    } else {
        "AMX-INT8 off by default: no faster than VNNI; FLINT_CPU_ISA=amx turns it on"
    };
    let amx = match amx::status() {
        amx::AmxStatus::Usable { .. } if isa < Isa::AmxBf16 => "AMX capped off by FLINT_CPU_ISA".to_string(),
        amx::AmxStatus::Usable { bf16 } => {
            let bf16 = if bf16 { "AMX-BF16 tiles for bf16 weights" } else { "no AMX-BF16 on this CPU" };
            let int8 = if isa >= Isa::Amx { "AMX-INT8 tiles for int8 weights" } else { int8_off };
            format!("{bf16}; {int8}")
        }
        other => other.describe().to_string(),
    };
    format!("CPU kernels: {isa:?} ({amx})")
}

use std::mem::MaybeUninit;

use pool::Disjoint;

/// A task's share of the output `y` (`[m][cols]`): the columns of its panel range, which no
/// other task writes.
pub(crate) struct Stripe<'a> {
    y: &'a Disjoint<'a, MaybeUninit<f32>>,
    cols: usize,
    col0: usize,
    col1: usize,
    width: usize,
}

impl Stripe<'_> {
    /// Write the outputs of `row` for panel `panel` (counted from the stripe's first); columns
    /// past the matrix's edge (a ragged last panel) are dropped.
    pub(crate) fn put(&mut self, row: usize, panel: usize, vals: &[f32]) {
        let c0 = self.col0 + panel * self.width;
        if c0 >= self.col1 {
            return;
        }
        let n = self.width.min(self.col1 - c0).min(vals.len());
        let at = row * self.cols + c0;
        // SAFETY: inside this stripe's own columns, which no other stripe of the call writes
        // (`by_panel_stripes_many` cuts disjoint column ranges).
        let dst = unsafe { self.y.part(at..at + n) };
        // A whole 16-wide panel (nearly every call) as one fixed-size copy, which compiles to
        // a vector store; a variable length goes through `memcpy`, a call per 64 bytes.
        if let (16, Some(src)) = (n, vals.first_chunk::<16>()) {
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = MaybeUninit::new(v);
            }
            return;
        }
        // SAFETY: `vals` holds at least `n` values and `dst` is `n` long: an f32 copy into slots
        // of f32's layout.
        unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), dst.as_mut_ptr().cast::<f32>(), n) }
    }
}

/// View an initialised output as one the kernels may overwrite (same layout; they only write).
pub fn as_uninit(y: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and every value written through the view
    // is an initialised f32, so `y` stays initialised.
    unsafe { &mut *(y as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// The split both matrix kernels use: ranges of `width`-column panels (a multiple of `group`
/// panels each) run in parallel, `fill(p0, p1, stripe)` computes panels `p0..p1` for all `m` rows
/// straight into their columns of `y` (`[m][cols]`). A row's values do not depend on the split:
/// each output is computed whole by one `fill`.
///
/// Each thread takes a contiguous share of the panels and steals halves of the others' at the
/// end ([`pool::run_ranges`]), so the threads finish together (with equal fixed ranges, the last
/// one ran alone while the others waited: about 10% of q4_0 decode spent spinning at the end of a
/// matrix) and each streams its weights in a few long runs. It replaced a shared list of ranges
/// that shrank as the work ran out (a quarter of what was left, for two threads): about 17 ranges
/// a call, each thread's a new stream scattered between the other's. Zen 4, 2 threads, one row,
/// the same step or call alternated in one process: qwen3-30b-a3b's q/k/v and o sized Q4_K calls
/// (48 layers' worth, `call_cost`) streamed 5.7–8.4% faster while the host's memory was fast
/// (about 65 GB/s; eight runs), −0.3 to +1.4% while it was slow (37 GB/s; fourteen runs); the
/// whole qwen3-30b-a3b Q4_K model's single-stream decode step 4.6% faster (median of 768 pairs,
/// 23 tokens/s), its 16-sequence step 0.7% (83 triples, 0.4% in the slower steps, 1.0% in the
/// faster). A burst of software prefetches at the start of each range (4, 16, 64 KB) was 0 to 5%
/// slower, and one for the next expert's first panel in the grouped kernels 0.2%.
pub(crate) fn by_panel_stripes(
    m: usize,
    cols: usize,
    width: usize,
    group: usize,
    y: &mut [MaybeUninit<f32>],
    fill: impl Fn(usize, usize, &mut Stripe) + Sync,
) {
    by_panel_stripes_many(m, &[cols], width, group, &mut [y], |_, p0, p1, stripe| fill(p0, p1, stripe));
}

/// [`by_panel_stripes`] over several matrices that read the same rows, in one parallel region:
/// output `j` is `ys[j]` (`[m][cols[j]]`), and `fill(j, p0, p1, stripe)` computes its panels
/// `p0..p1`. The ranges are cut from all the panels in sequence (and at the matrices' borders),
/// so small matrices (a layer's k/v projections) share one start and one finish with the rest.
pub(crate) fn by_panel_stripes_many(
    m: usize,
    cols: &[usize],
    width: usize,
    group: usize,
    ys: &mut [&mut [MaybeUninit<f32>]],
    fill: impl Fn(usize, usize, usize, &mut Stripe) + Sync,
) {
    by_panel_stripes_grouped(&vec![m; cols.len()], cols, width, group, ys, fill)
}

/// [`by_panel_stripes_many`] where output `j` has its own row count `ms[j]` (`ys[j]` is
/// `[ms[j]][cols[j]]`): the experts of a mixture, each over the rows routed to it.
pub(crate) fn by_panel_stripes_grouped(
    ms: &[usize],
    cols: &[usize],
    width: usize,
    group: usize,
    ys: &mut [&mut [MaybeUninit<f32>]],
    fill: impl Fn(usize, usize, usize, &mut Stripe) + Sync,
) {
    assert_eq!(cols.len(), ys.len(), "one output per matrix");
    assert_eq!(ms.len(), ys.len(), "one row count per matrix");
    let (mut start, mut ranges) = (0, Vec::new()); // (matrix, first panel, end panel), all panels in sequence
    for (j, (&c, y)) in cols.iter().zip(ys.iter()).enumerate() {
        assert!(y.len() >= ms[j] * c, "output too short");
        ranges.push((j, start, start + c.div_ceil(width)));
        start += c.div_ceil(width);
    }
    let outs: Vec<Disjoint<MaybeUninit<f32>>> = ys.iter_mut().map(|y| Disjoint::new(y)).collect();
    let run = |p0: usize, p1: usize| {
        for &(j, s, e) in &ranges {
            let (a, b) = (p0.max(s), p1.min(e));
            if a < b {
                let cols = cols[j];
                let (a, b) = (a - s, b - s);
                let mut stripe = Stripe { y: &outs[j], cols, col0: a * width, col1: (b * width).min(cols), width };
                fill(j, a, b, &mut stripe);
            }
        }
    };
    // Units of `group` panels, each thread a contiguous share of them (see `pool::run_ranges`).
    pool::run_ranges(start.div_ceil(group), |u| run(u.start * group, (u.end * group).min(start)));
}

/// Marsaglia's xorshift32 from `state` (not 0): the kernels' tests draw their data from it.
#[cfg(test)]
pub(crate) fn xorshift(mut state: u32) -> impl Iterator<Item = u32> {
    std::iter::repeat_with(move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    })
}

/// `n` values in [-1, 1) from a xorshift stream: the matrix kernels' test data.
#[cfg(test)]
pub(crate) fn test_data(n: usize, seed: u32) -> Vec<f32> {
    xorshift(seed.wrapping_mul(2_654_435_761).wrapping_add(1))
        .take(n)
        .map(|s| (s % 20_000) as f32 / 10_000.0 - 1.0)
        .collect()
}

/// The values of an output the tests pre-filled (with NaN) before a kernel wrote into it.
#[cfg(test)]
pub(crate) fn written(y: &[MaybeUninit<f32>]) -> Vec<f32> {
    // SAFETY: the tests initialise every element before the kernel runs, so each is initialised
    // whatever the kernel wrote.
    y.iter().map(|v| unsafe { v.assume_init() }).collect()
}
