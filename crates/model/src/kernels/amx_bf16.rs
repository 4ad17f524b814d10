//! AMX-BF16: the one tile operation the bf16 matmul needs, `tdpbf16ps` (C[16×16 f32] += A[16 ×
//! 16 bf16 pairs] · B[16 pairs × 16 columns]), on up to 2 × 2 tiles at once, in two
//! implementations with the same bits: the hardware's and an emulation of the SDM's definition.
//! The matmul drives both through [`Bf16Tiles`], so everything but the instruction is tested on
//! every CPU (permission and the tile configuration are [`super::amx`]'s).
//!
//! **The order of the sums**, per the SDM (Intel's pseudo-code for `TDPBF16PS`): for each C
//! element and each instruction, the even products of its 16 k-pairs are summed in one f32
//! chain from zero and the odd products in another, both in k order, each product exact and each
//! addition rounded to nearest even; then `C += even + odd` (two more roundings). Inputs that are
//! subnormal are read as zero, results tiny after rounding are flushed to zero, MXCSR plays no
//! part. This is not `vdpbf16ps`'s order (one chain per lane, odd product first), so a weight is
//! computed on tiles for every row count or for none, and tiles give other bits than AVX-512 BF16.

use super::matmul_bf16::{flush, fma_ftz, widen_daz};

/// Rows of A (and C) one block covers: two tiles of 16.
pub const BLOCK_ROWS: usize = 32;
/// k-pairs per tile product: a tile row is 64 bytes of pairs.
pub const CHUNK_PAIRS: usize = 16;
/// bf16 values of a B chunk: 16 k-pairs × 16 columns × 2.
pub const B_CHUNK: usize = CHUNK_PAIRS * 32;

/// A block's accumulators as [`Bf16Tiles::finish`] hands them out: `c[j][r]` is the 16 columns
/// of B operand `j` for row `r`.
pub type Block = [[[f32; 16]; BLOCK_ROWS]; 2];

/// Up to 32 rows against one or two B operands (two panels of one matrix, or a gate panel and
/// its up panel), accumulated over any number of 16-pair chunks.
pub trait Bf16Tiles {
    /// Start a block of `m` rows (1..=32) and `panels` (1 or 2) B operands, accumulators zero.
    fn start(&mut self, m: usize, panels: usize);
    /// `C[j][..m] += A · B_j` over one chunk: [`tdpbf16ps`](self) once per 16 rows and operand.
    ///
    /// # Safety
    /// `a` points at `m` rows of 16 readable pairs, `stride` bytes apart; `b[j]` for each of
    /// the block's operands at [`B_CHUNK`] readable values (16 lines of 64 bytes).
    unsafe fn chunk(&mut self, a: *const u32, stride: usize, b: [*const u16; 2]);
    /// The block's accumulators (rows past `m` and an absent second operand: unspecified).
    fn finish(&mut self, c: &mut Block);
}

/// One C element of one `tdpbf16ps`: `c` plus the dot product of row pairs `a` (even k in the
/// low half) with column `n` of the chunk `b` (`[16 pairs][16 columns][2]`), in the SDM's order.
#[inline(always)]
pub fn tdp_lane(c: f32, a: &[u32], b: &[u16], n: usize) -> f32 {
    let (mut even, mut odd) = (0f32, 0f32);
    for (k, &x) in a.iter().enumerate().take(CHUNK_PAIRS) {
        let (w0, w1) = (b[k * 32 + 2 * n], b[k * 32 + 2 * n + 1]);
        even = fma_ftz(widen_daz(x as u16), widen_daz(w0), even);
        odd = fma_ftz(widen_daz((x >> 16) as u16), widen_daz(w1), odd);
    }
    // `x · 1.0 + y` is `x + y` with one rounding (the product is exact).
    let sum = fma_ftz(even, 1.0, odd);
    // A subnormal accumulator is read as zero (DAZ), as `flush` leaves it.
    fma_ftz(flush(c), 1.0, sum)
}

/// The reference: [`tdp_lane`] for every row, operand and column.
#[derive(Default)]
pub struct EmulatedBf16Tiles {
    m: usize,
    panels: usize,
    c: Box<Block>,
}

impl Bf16Tiles for EmulatedBf16Tiles {
    fn start(&mut self, m: usize, panels: usize) {
        assert!((1..=BLOCK_ROWS).contains(&m) && (1..=2).contains(&panels), "bf16 tile block shape");
        (self.m, self.panels) = (m, panels);
        *self.c = [[[0.0; 16]; BLOCK_ROWS]; 2];
    }

    unsafe fn chunk(&mut self, a: *const u32, stride: usize, b: [*const u16; 2]) {
        for (j, &bj) in b.iter().enumerate().take(self.panels) {
            // SAFETY: the caller's contract: 16 lines of 32 values.
            let bj = unsafe { std::slice::from_raw_parts(bj, B_CHUNK) };
            for r in 0..self.m {
                // SAFETY: the caller's contract: row `r` holds 16 pairs, `stride` bytes on.
                let ar =
                    unsafe { std::slice::from_raw_parts(a.cast::<u8>().add(r * stride).cast::<u32>(), CHUNK_PAIRS) };
                for (n, c) in self.c[j][r].iter_mut().enumerate() {
                    *c = tdp_lane(*c, ar, bj, n);
                }
            }
        }
    }

    fn finish(&mut self, c: &mut Block) {
        *c = *self.c;
    }
}

/// The hardware: C in `tmm0` (rows 0–15 × operand 0), `tmm1` (rows 0–15 × operand 1), `tmm2`,
/// `tmm3` (rows 16–31); A in `tmm4`, `tmm5`; B in `tmm6`, `tmm7`.
#[cfg(target_arch = "x86_64")]
pub struct HardwareBf16Tiles {
    cfg: super::amx::TileConfig,
    shape: (usize, usize),
    _not_send: std::marker::PhantomData<*const ()>,
}

#[cfg(target_arch = "x86_64")]
impl HardwareBf16Tiles {
    /// `None` unless the tiles are usable and the CPU has AMX-BF16. Tile state belongs to the
    /// thread: create one per task (it is not `Send`), and drop it to release the tiles.
    pub fn new() -> Option<Self> {
        matches!(super::amx::status(), super::amx::AmxStatus::Usable { bf16: true }).then(|| Self {
            cfg: super::amx::TileConfig::new(),
            shape: (0, 0),
            _not_send: std::marker::PhantomData,
        })
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for HardwareBf16Tiles {
    fn drop(&mut self) {
        // SAFETY: `new` checked AMX is usable.
        unsafe { super::amx::release_tiles() }
    }
}

#[cfg(target_arch = "x86_64")]
impl Bf16Tiles for HardwareBf16Tiles {
    fn start(&mut self, m: usize, panels: usize) {
        assert!((1..=BLOCK_ROWS).contains(&m) && (1..=2).contains(&panels), "bf16 tile block shape");
        if self.shape != (m, panels) {
            let (r0, r1) = (m.min(16) as u8, m.saturating_sub(16) as u8);
            let two = panels == 2;
            let c = &mut self.cfg;
            // Unused tiles keep 0 rows and 0 bytes (unconfigured); no instruction names them.
            let shapes = [
                (r0, 64),
                if two { (r0, 64) } else { (0, 0) },
                if r1 > 0 { (r1, 64) } else { (0, 0) },
                if r1 > 0 && two { (r1, 64) } else { (0, 0) },
                (r0, 64),
                if r1 > 0 { (r1, 64) } else { (0, 0) },
                (16, 64),
                if two { (16, 64) } else { (0, 0) },
            ];
            for (t, (rows, colsb)) in shapes.into_iter().enumerate() {
                (c.rows[t], c.colsb[t]) = (rows, colsb);
            }
            self.shape = (m, panels);
            // SAFETY: `new` checked AMX-BF16 is usable; shapes within palette 1's. ldtilecfg
            // zeroes every tile, which is the start of the block.
            unsafe { self.cfg.load() };
            return;
        }
        let (m, two) = (m, panels == 2);
        // SAFETY: as above; only configured tiles are named.
        unsafe {
            std::arch::asm!("tilezero tmm0", out("tmm0") _, options(nostack, nomem));
            if two {
                std::arch::asm!("tilezero tmm1", out("tmm1") _, options(nostack, nomem));
            }
            if m > 16 {
                std::arch::asm!("tilezero tmm2", out("tmm2") _, options(nostack, nomem));
                if two {
                    std::arch::asm!("tilezero tmm3", out("tmm3") _, options(nostack, nomem));
                }
            }
        }
    }

    unsafe fn chunk(&mut self, a: *const u32, stride: usize, b: [*const u16; 2]) {
        let (m, panels) = self.shape;
        // SAFETY: the caller's contract gives readable A rows and B lines; the tiles were
        // configured by `start` for exactly these shapes.
        unsafe {
            match (m > 16, panels == 2) {
                (false, false) => std::arch::asm!(
                    "tileloadd tmm4, [{a} + {sa} * 1]",
                    "tileloadd tmm6, [{b0} + {sb} * 1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    a = in(reg) a, sa = in(reg) stride, b0 = in(reg) b[0], sb = in(reg) 64usize,
                    out("tmm0") _, out("tmm4") _, out("tmm6") _, options(nostack, readonly),
                ),
                (false, true) => std::arch::asm!(
                    "tileloadd tmm4, [{a} + {sa} * 1]",
                    "tileloadd tmm6, [{b0} + {sb} * 1]",
                    "tileloadd tmm7, [{b1} + {sb} * 1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    a = in(reg) a, sa = in(reg) stride, b0 = in(reg) b[0], b1 = in(reg) b[1], sb = in(reg) 64usize,
                    out("tmm0") _, out("tmm1") _, out("tmm4") _, out("tmm6") _, out("tmm7") _,
                    options(nostack, readonly),
                ),
                (true, false) => std::arch::asm!(
                    "tileloadd tmm4, [{a} + {sa} * 1]",
                    "tileloadd tmm5, [{a16} + {sa} * 1]",
                    "tileloadd tmm6, [{b0} + {sb} * 1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    a = in(reg) a, a16 = in(reg) a.cast::<u8>().add(16 * stride), sa = in(reg) stride,
                    b0 = in(reg) b[0], sb = in(reg) 64usize,
                    out("tmm0") _, out("tmm2") _, out("tmm4") _, out("tmm5") _, out("tmm6") _,
                    options(nostack, readonly),
                ),
                (true, true) => std::arch::asm!(
                    "tileloadd tmm4, [{a} + {sa} * 1]",
                    "tileloadd tmm6, [{b0} + {sb} * 1]",
                    "tileloadd tmm7, [{b1} + {sb} * 1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm5, [{a16} + {sa} * 1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a = in(reg) a, a16 = in(reg) a.cast::<u8>().add(16 * stride), sa = in(reg) stride,
                    b0 = in(reg) b[0], b1 = in(reg) b[1], sb = in(reg) 64usize,
                    out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                    out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                    options(nostack, readonly),
                ),
            }
        }
    }

    fn finish(&mut self, c: &mut Block) {
        let (m, two) = (self.shape.0, self.shape.1 == 2);
        let [c0, c1] = c;
        let (c0, c1) = (c0.as_mut_ptr().cast::<f32>(), c1.as_mut_ptr().cast::<f32>());
        // SAFETY: each operand's block has room for 32 rows of 64 bytes; only configured tiles
        // are stored, rows 16.. at 16 rows on.
        unsafe {
            std::arch::asm!("tilestored [{c} + {s} * 1], tmm0", c = in(reg) c0, s = in(reg) 64usize, out("tmm0") _, options(nostack));
            if two {
                std::arch::asm!("tilestored [{c} + {s} * 1], tmm1", c = in(reg) c1, s = in(reg) 64usize, out("tmm1") _, options(nostack));
            }
            if m > 16 {
                std::arch::asm!("tilestored [{c} + {s} * 1], tmm2", c = in(reg) c0.add(256), s = in(reg) 64usize, out("tmm2") _, options(nostack));
                if two {
                    std::arch::asm!("tilestored [{c} + {s} * 1], tmm3", c = in(reg) c1.add(256), s = in(reg) 64usize, out("tmm3") _, options(nostack));
                }
            }
        }
    }
}

/// A task's tiles: the hardware's where `hardware` is asked for and usable, else the emulation
/// (the same bits, slowly).
pub enum Bf16TileUnit {
    #[cfg(target_arch = "x86_64")]
    Hardware(HardwareBf16Tiles),
    Emulated(EmulatedBf16Tiles),
}

impl Bf16TileUnit {
    pub fn new(hardware: bool) -> Self {
        #[cfg(target_arch = "x86_64")]
        if let Some(t) = hardware.then(HardwareBf16Tiles::new).flatten() {
            return Bf16TileUnit::Hardware(t);
        }
        let _ = hardware;
        Bf16TileUnit::Emulated(EmulatedBf16Tiles::default())
    }
}

impl Bf16Tiles for Bf16TileUnit {
    fn start(&mut self, m: usize, panels: usize) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Bf16TileUnit::Hardware(t) => t.start(m, panels),
            Bf16TileUnit::Emulated(t) => t.start(m, panels),
        }
    }

    unsafe fn chunk(&mut self, a: *const u32, stride: usize, b: [*const u16; 2]) {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                #[cfg(target_arch = "x86_64")]
                Bf16TileUnit::Hardware(t) => t.chunk(a, stride, b),
                Bf16TileUnit::Emulated(t) => t.chunk(a, stride, b),
            }
        }
    }

    fn finish(&mut self, c: &mut Block) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Bf16TileUnit::Hardware(t) => t.finish(c),
            Bf16TileUnit::Emulated(t) => t.finish(c),
        }
    }
}

/// Whether this process has AMX-BF16 tiles to use.
pub fn hardware_available() -> bool {
    matches!(super::amx::status(), super::amx::AmxStatus::Usable { bf16: true })
}

#[cfg(test)]
mod tests;
