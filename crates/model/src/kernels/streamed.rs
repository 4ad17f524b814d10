//! How many bytes of weights the matrix kernels called from this thread have streamed: each call
//! adds the bytes of the weight panels it reads (for a mixture's grouped calls, the chosen
//! experts' panels only). A step of the engine runs its kernels from the engine's thread, so the
//! difference across a step is the weights that step read, whatever the batch and routing:
//! `flint bench latency --bandwidth-probe` sets it against the memory bandwidth of the step's own
//! moments. Per thread, so concurrent callers (tests, other engines) never mix into it; counting
//! is one add to a thread-local a call.

use std::cell::Cell;

thread_local! {
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

/// The weight bytes kernels called from this thread have streamed so far.
pub fn weight_bytes() -> u64 {
    BYTES.with(Cell::get)
}

/// Count `bytes` of weights a kernel call streams.
pub(crate) fn add(bytes: usize) {
    BYTES.with(|b| b.set(b.get().wrapping_add(bytes as u64)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul_f32::PackedF32;
    use crate::kernels::matmul_q8::{grouped_uninit, matmul, ExpertJob, Format, PackedQ8};
    use crate::kernels::{as_uninit, matmul_f32, test_data};

    /// Each kernel call adds exactly the panels it reads: a whole Q4_0 weight, a whole f32 one,
    /// and of a merged expert weight only the chosen experts' columns.
    #[test]
    fn calls_count_the_panels_they_read() {
        let (out, inp) = (64, 64);
        let raw: Vec<u8> = (0..out * inp / 32 * 18).map(|i| (i * 7 % 251) as u8).collect();
        let w = PackedQ8::from_ggml(Format::Q4_0, &raw, out, inp).expect("a Q4_0 weight");
        let x = test_data(2 * inp, 3);
        let mut y = vec![0f32; 2 * out];
        let before = weight_bytes();
        matmul(&x, 2, &w, &mut y);
        assert_eq!(weight_bytes() - before, w.packed_bytes() as u64, "q8 matmul");

        let f = PackedF32::pack(&test_data(out * inp, 4), out, inp);
        let before = weight_bytes();
        matmul_f32::matmul(&x, 2, &f, &mut y);
        assert_eq!(weight_bytes() - before, (out * inp * 4) as u64, "f32 matmul");

        // Four experts of 16 columns each; the call runs experts 1 and 3.
        let rows = [0u32];
        let jobs = [ExpertJob { rows: &rows, col0: 16, cols: 16 }, ExpertJob { rows: &rows, col0: 48, cols: 16 }];
        let (mut a, mut b) = (vec![0f32; 16], vec![0f32; 16]);
        let before = weight_bytes();
        grouped_uninit(&[&x[..inp], &x[..inp]], &w, &jobs, &mut [as_uninit(&mut a), as_uninit(&mut b)]);
        assert_eq!(weight_bytes() - before, (w.packed_bytes() / 2) as u64, "two of four experts");
    }
}
