//! A read of a large huge-page buffer on the kernels' own threads: the machine's memory bandwidth
//! at this moment, the ceiling a decode that streams its weights is measured against.
//!
//! Why in-process: on a shared host the bandwidth moves. On the project's Zen 4 machine
//! `scripts/membw.c` read 35 GB/s in one minute and 60 in the next, so a decode's share of "the
//! bandwidth" measured in other minutes said more about the host than about the decode. Read
//! between a decode's steps, in the same process and on the same threads, this probe and the steps
//! see the same moments. It reads as `membw.c`'s read does: every byte once, 64 bytes at a time
//! into independent sums, each thread a contiguous share, on transparent huge pages.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use super::huge_buf::HugeBuf;
use super::pool;

/// f32s per unit a pool task takes (256 KiB): small enough for the threads to balance their
/// shares, large enough that a unit is a long stream for the hardware prefetcher.
const UNIT: usize = 1 << 16;

/// A buffer of its own (written once, so every page is backed by memory, not the shared zero
/// page) and the sum of its last read (kept so the reads cannot be left out).
pub struct ReadProbe {
    buf: HugeBuf<f32>,
    sink: AtomicU32,
}

impl ReadProbe {
    /// A probe over `bytes` (rounded down to whole units; at least one).
    pub fn new(bytes: usize) -> Self {
        let len = (bytes / 4 / UNIT).max(1) * UNIT;
        let mut buf = HugeBuf::<f32>::zeroed(len);
        pool::run_chunks(&mut buf, UNIT, |_, part| part.fill(1.0));
        ReadProbe { buf, sink: AtomicU32::new(0) }
    }

    pub fn bytes(&self) -> usize {
        self.buf.len() * 4
    }

    /// Read the whole buffer once over the pool's threads; returns the seconds it took.
    pub fn read(&self) -> f64 {
        let units = self.buf.len() / UNIT;
        let t0 = Instant::now();
        pool::run_ranges(units, |r| {
            let s = sum(&self.buf[r.start * UNIT..r.end * UNIT]);
            self.sink.fetch_add(s.to_bits(), Ordering::Relaxed);
        });
        t0.elapsed().as_secs_f64()
    }

    /// The bytes a second of one [`Self::read`].
    pub fn gb_per_s(&self) -> f64 {
        self.bytes() as f64 / self.read() / 1e9
    }
}

/// The sum of `x` in four sets of 16 lanes (four independent vector additions per 256 bytes, so
/// the adds never hold the loads back).
fn sum(x: &[f32]) -> f32 {
    let mut acc = [[0f32; 16]; 4];
    for block in x.chunks_exact(64) {
        for (a, lanes) in acc.iter_mut().zip(block.chunks_exact(16)) {
            for (s, v) in a.iter_mut().zip(lanes) {
                *s += v;
            }
        }
    }
    acc.iter().flatten().sum::<f32>() + x.chunks_exact(64).remainder().iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_element_once() {
        // 3 units: each element is 1.0, so each unit's sum is exact (65536 < 2^24).
        let probe = ReadProbe::new(3 * UNIT * 4 + 100);
        assert_eq!(probe.bytes(), 3 * UNIT * 4, "whole units");
        let secs = probe.read();
        assert!(secs > 0.0);
        assert!(probe.gb_per_s().is_finite());
        assert_eq!(sum(&probe.buf[..UNIT]), UNIT as f32);
        assert_eq!(sum(&[1.0; 70]), 70.0, "the tail past whole 64-element blocks counts");
        assert!(probe.sink.load(Ordering::Relaxed) != 0, "the reads' sums were kept");
    }
}
