//! The time each grammar mask took, as a fixed-bucket histogram the engine's stats carry
//! (plain data, `Copy`, so a stats snapshot stays cheap); `/metrics` and the benches read it.

/// Upper bounds of the buckets, seconds: masks take tens of microseconds to a few milliseconds.
pub const MASK_BUCKETS: [f64; 10] = [2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2];

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MaskHistogram {
    /// Masks at most `MASK_BUCKETS[i]` (not cumulative); the last entry counts the rest.
    pub counts: [u64; MASK_BUCKETS.len() + 1],
    pub sum_secs: f64,
    pub count: u64,
}

impl MaskHistogram {
    pub fn observe(&mut self, secs: f64) {
        let i = MASK_BUCKETS.iter().position(|&b| secs <= b).unwrap_or(MASK_BUCKETS.len());
        self.counts[i] += 1;
        self.sum_secs += secs;
        self.count += 1;
    }

    pub fn merge(&mut self, other: &MaskHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        self.sum_secs += other.sum_secs;
        self.count += other.count;
    }

    pub fn mean_secs(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_secs / self.count as f64
        }
    }

    /// The bucket bound below which fraction `q` of the masks fall (an upper estimate).
    pub fn quantile_bound(&self, q: f64) -> f64 {
        let want = (q * self.count as f64).ceil() as u64;
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want.max(1) {
                return MASK_BUCKETS.get(i).copied().unwrap_or(f64::INFINITY);
            }
        }
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_count_and_bound() {
        let mut h = MaskHistogram::default();
        for s in [1e-5, 3e-5, 3e-5, 2e-3, 1.0] {
            h.observe(s);
        }
        assert_eq!(h.count, 5);
        assert_eq!(h.counts[0], 1);
        assert_eq!(h.counts[1], 2);
        assert_eq!(h.counts[MASK_BUCKETS.len()], 1);
        assert_eq!(h.quantile_bound(0.5), 5e-5);
        assert!(h.quantile_bound(1.0).is_infinite());
        let mut m = MaskHistogram::default();
        m.merge(&h);
        m.merge(&h);
        assert_eq!(m.count, 10);
        assert!((m.mean_secs() - h.mean_secs()).abs() < 1e-12);
    }
}
