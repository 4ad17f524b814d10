//! Grouped matmuls for a mixture of experts. A layer's experts are packed as one merged weight
//! (each projection's `[out, in]` matrices stacked into `[experts · out, in]`, GGUF's own
//! layout), so expert `e` is the panel range of its columns; one call runs every chosen expert
//! over the rows routed to it in a single parallel region, instead of a kernel call (and a
//! start and a finish of the threads) per expert and projection.
//!
//! Each output is computed by the same tile code, from the same quantized row, as
//! [`matmul_uninit`](super::matmul_uninit) and [`matmul_gated_uninit`](super::matmul_gated_uninit)
//! give it for the expert's own matrix: the bits do not depend on which other rows or experts
//! share the call.

use std::mem::MaybeUninit;

use super::{
    gated_order, gated_panels, panel_run, path, quantize_each, quantize_rows, Acc, Isa, PackedQ8, QuantRow, COLS, QK,
    ROWS,
};
use crate::kernels::{by_panel_stripes_grouped, streamed, Stripe};

/// One expert's share of a grouped matmul: the rows routed to it and its columns
/// `col0..col0 + cols` of the merged weight (`col0` and `cols` multiples of 16: whole panels).
pub struct ExpertJob<'a> {
    pub rows: &'a [u32],
    pub col0: usize,
    pub cols: usize,
}

/// For each job `j`, `silu(x_r·gateᵀ) · (x_r·upᵀ)` over its columns for each of its rows `r`,
/// into uninitialised `ys[j]` (`[rows][cols]`, every value written). `x` is `[n][in]`; each of its
/// rows is quantized once, however many experts it goes to.
pub fn grouped_gated_uninit(
    x: &[f32],
    n: usize,
    gate: &PackedQ8,
    up: &PackedQ8,
    jobs: &[ExpertJob],
    ys: &mut [&mut [MaybeUninit<f32>]],
) {
    gated_with(Isa::detected(), x, n, gate, up, jobs, ys)
}

/// For each job `j`, `xs[j]·wᵀ` over its columns (`xs[j]` is `[rows][in]`: the rows routed to
/// the expert, each quantized on its own), into uninitialised `ys[j]` (`[rows][cols]`).
pub fn grouped_uninit(xs: &[&[f32]], w: &PackedQ8, jobs: &[ExpertJob], ys: &mut [&mut [MaybeUninit<f32>]]) {
    plain_with(Isa::detected(), xs, w, jobs, ys)
}

/// The tile path for `isa`: the grouped kernels run the VNNI/AVX2/scalar tiles (AMX's tiles
/// are left to the ungrouped calls; the bits are the same).
fn tile_path(isa: Isa) -> Isa {
    match path(isa) {
        Isa::Amx => Isa::Avx512Vnni,
        other => other,
    }
}

fn check_jobs(w: &PackedQ8, jobs: &[ExpertJob], ys: &[&mut [MaybeUninit<f32>]]) {
    assert_eq!(jobs.len(), ys.len(), "grouped matmul: one output per job");
    for (job, y) in jobs.iter().zip(ys) {
        assert!(job.col0.is_multiple_of(COLS) && job.cols.is_multiple_of(COLS), "grouped matmul: whole panels");
        assert!(job.col0 + job.cols <= w.out, "grouped matmul: columns inside the weight");
        assert_eq!(y.len(), job.rows.len() * job.cols, "grouped matmul output length");
    }
}

pub(super) fn gated_with(
    isa: Isa,
    x: &[f32],
    n: usize,
    gate: &PackedQ8,
    up: &PackedQ8,
    jobs: &[ExpertJob],
    ys: &mut [&mut [MaybeUninit<f32>]],
) {
    let isa = tile_path(isa);
    let inp = gate.inp;
    assert!(up.inp == inp && up.out == gate.out, "grouped gated matmul: gate and up of one shape");
    assert_eq!(x.len(), n * inp, "grouped gated matmul input length");
    check_jobs(gate, jobs, ys);
    let all = quantize_rows(isa, x, n, inp);
    let rows: Vec<Vec<&QuantRow>> = jobs.iter().map(|j| j.rows.iter().map(|&r| &all[r as usize]).collect()).collect();
    let nb = inp / QK;
    let (gb, ub) = (gate.format.panel_bytes(nb), up.format.panel_bytes(nb));
    streamed::add(jobs.iter().map(|j| j.cols / COLS * (gb + ub)).sum());
    run(jobs, &rows, ys, |rows, range, accs, put| {
        gated_panels(isa, gated_order(isa, [gate, up], rows.len()), [gate, up], rows, range, accs, put)
    });
}

pub(super) fn plain_with(
    isa: Isa,
    xs: &[&[f32]],
    w: &PackedQ8,
    jobs: &[ExpertJob],
    ys: &mut [&mut [MaybeUninit<f32>]],
) {
    let isa = tile_path(isa);
    let inp = w.inp;
    assert_eq!(xs.len(), jobs.len(), "grouped matmul: one input per job");
    check_jobs(w, jobs, ys);
    // Every job's rows quantized in one list (a decode batch's experts have a row or two each:
    // quantized job by job they were a serial stretch of about 2% of a 16-sequence step), then
    // regrouped. (`inp` is never 0: a packed weight has inputs.)
    let flat: Vec<&[f32]> = xs
        .iter()
        .zip(jobs)
        .flat_map(|(x, j)| {
            assert_eq!(x.len(), j.rows.len() * inp, "grouped matmul input length");
            x.chunks_exact(inp)
        })
        .collect();
    let pb = w.format.panel_bytes(inp / QK);
    streamed::add(jobs.iter().map(|j| j.cols / COLS * pb).sum());
    let quantized = quantize_each(isa, &flat);
    let mut each = quantized.iter();
    let rows: Vec<Vec<&QuantRow>> = jobs.iter().map(|j| each.by_ref().take(j.rows.len()).collect()).collect();
    // Decode's few rows take two panels a pass (see `panel_run`).
    run(jobs, &rows, ys, |rows, range, accs, put| panel_run(isa, w, rows, range, accs, put));
}

/// Every job's panels in one parallel region: `panels(rows, range, accs, put)` computes the
/// merged weight's panels `range` (within one job) for the job's quantized `rows` in the task's
/// two tile accumulators `accs`, handing row `r`'s 16 outputs of panel `range.start + k` to
/// `put(r, k, ..)`.
fn run(
    jobs: &[ExpertJob],
    rows: &[Vec<&QuantRow>],
    ys: &mut [&mut [MaybeUninit<f32>]],
    panels: impl Fn(&[&QuantRow], std::ops::Range<usize>, &mut [Acc; 2], &mut dyn FnMut(usize, usize, &[f32])) + Sync,
) {
    let ms: Vec<usize> = jobs.iter().map(|j| j.rows.len()).collect();
    let cols: Vec<usize> = jobs.iter().map(|j| j.cols).collect();
    by_panel_stripes_grouped(&ms, &cols, COLS, 1, ys, |j, p0, p1, stripe: &mut Stripe| {
        let base = jobs[j].col0 / COLS;
        let mut accs = [[[0f32; COLS]; ROWS]; 2];
        panels(&rows[j], base + p0..base + p1, &mut accs, &mut |r, k, vals| stripe.put(r, k, vals));
    });
}

#[cfg(test)]
mod tests {
    use super::super::tests::{random_blocks, random_x};
    use super::super::{gated_with as ungrouped_gated, matmul_with, Format};
    use super::*;
    use crate::kernels::written;

    /// Each expert of a merged weight, over the rows routed to it, gives exactly the bits of the
    /// ungrouped kernels on that expert's own matrix and rows: every format, every path, row
    /// counts 0 to 11 per expert, experts chosen by several rows or none.
    #[test]
    fn grouped_experts_give_each_experts_own_bits() {
        let (experts, out, inp, n) = (5, 48, 512, 11);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q6_K] {
            let merged_raw = |seed| random_blocks(format, experts * out, inp, seed);
            let (graw, uraw) = (merged_raw(11), merged_raw(12));
            let gate = PackedQ8::from_ggml(format, &graw, experts * out, inp).unwrap();
            let up = PackedQ8::from_ggml(format, &uraw, experts * out, inp).unwrap();
            let own = |raw: &[u8], e: usize| {
                let per = raw.len() / experts;
                PackedQ8::from_ggml(format, &raw[e * per..(e + 1) * per], out, inp).unwrap()
            };
            let x = random_x(n * inp, 7);
            // Expert e takes rows r with (r·(e+1)) % 3 != 1; expert 2 takes none.
            let routed: Vec<Vec<u32>> = (0..experts)
                .map(|e| (0..n as u32).filter(|r| e != 2 && (r * (e as u32 + 1)) % 3 != 1).collect())
                .collect();
            let jobs: Vec<ExpertJob> =
                routed.iter().enumerate().map(|(e, rows)| ExpertJob { rows, col0: e * out, cols: out }).collect();
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx] {
                let mut bufs: Vec<Vec<MaybeUninit<f32>>> =
                    jobs.iter().map(|j| vec![MaybeUninit::new(f32::NAN); j.rows.len() * out]).collect();
                let mut ys: Vec<&mut [MaybeUninit<f32>]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                gated_with(isa, &x, n, &gate, &up, &jobs, &mut ys);
                let inputs: Vec<Vec<f32>> = routed
                    .iter()
                    .map(|rows| rows.iter().flat_map(|&r| x[r as usize * inp..][..inp].to_vec()).collect())
                    .collect();
                let xs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
                let mut pbufs: Vec<Vec<MaybeUninit<f32>>> =
                    jobs.iter().map(|j| vec![MaybeUninit::new(f32::NAN); j.rows.len() * out]).collect();
                let mut pys: Vec<&mut [MaybeUninit<f32>]> = pbufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                plain_with(isa, &xs, &gate, &jobs, &mut pys);
                for (e, rows) in routed.iter().enumerate() {
                    let m = rows.len();
                    let mut want = vec![MaybeUninit::new(f32::NAN); m * out];
                    ungrouped_gated(Isa::Scalar, &inputs[e], m, &own(&graw, e), &own(&uraw, e), &mut want);
                    assert_eq!(written(&bufs[e]), written(&want), "{format:?} {isa:?} expert {e}: gated");
                    let mut plain = vec![0f32; m * out];
                    matmul_with(Isa::Scalar, &inputs[e], m, &own(&graw, e), &mut plain);
                    assert_eq!(written(&pbufs[e]), plain, "{format:?} {isa:?} expert {e}: plain");
                }
            }
        }
    }
}
