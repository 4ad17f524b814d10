//! flint's own CPU kernels for the hot path, each bit-for-bit independent of batch composition
//! (see each module for how) and tested against a plain reference.

pub mod attention;
pub mod matmul_f32;
pub mod matmul_q8;
pub mod rowwise;

use rayon::prelude::*;

/// A task's private output: `[m rows][panels · width]` for a range of column panels.
pub(crate) struct Stripe {
    out: Vec<f32>,
    panels: usize,
    width: usize,
}

impl Stripe {
    /// Write the `width` outputs of `row` for panel `panel` (counted from the stripe's first).
    pub(crate) fn put(&mut self, row: usize, panel: usize, vals: &[f32]) {
        let at = (row * self.panels + panel) * self.width;
        self.out[at..at + self.width].copy_from_slice(&vals[..self.width]);
    }
}

/// The split both matrix kernels use: ranges of `width`-column panels (a multiple of `group`
/// panels each, a few per thread) run in parallel, `fill(p0, p1, stripe)` computes panels
/// `p0..p1` for all `m` rows, then the stripes are copied into `y` (`[m][cols]`). A row's values
/// do not depend on the split: each output is computed whole by one `fill`.
pub(crate) fn by_panel_stripes(
    m: usize,
    cols: usize,
    width: usize,
    group: usize,
    y: &mut [f32],
    fill: impl Fn(usize, usize, &mut Stripe) + Sync,
) {
    let panels = cols.div_ceil(width);
    let per_task = panels.div_ceil(rayon::current_num_threads().max(1) * 4).max(1).next_multiple_of(group);
    let stripes: Vec<(usize, Stripe)> = (0..panels)
        .step_by(per_task)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|p0| {
            let p1 = (p0 + per_task).min(panels);
            let mut stripe = Stripe { out: vec![0f32; m * (p1 - p0) * width], panels: p1 - p0, width };
            fill(p0, p1, &mut stripe);
            (p0, stripe)
        })
        .collect();
    for (p0, stripe) in stripes {
        let span = stripe.panels * width;
        let col0 = p0 * width;
        let n = span.min(cols.saturating_sub(col0));
        for i in 0..m {
            y[i * cols + col0..i * cols + col0 + n].copy_from_slice(&stripe.out[i * span..i * span + n]);
        }
    }
}
