//! Intel AMX (Advanced Matrix Extensions): whether this process may use the tiles, and the one
//! tile operation the int8 matmul needs, `C[m][16] = A[m][K] · B` (`tdpbssd`: signed int8
//! activations times signed int8 weights in the VNNI layout, exact int32 sums), in two
//! implementations with the same results: the hardware's, and an emulation that runs anywhere.
//! The kernels drive both through [`Int8Tiles`], so everything but the instructions themselves
//! (layouts, unpacking, block order, the f32 fold) is tested on every CPU. The bf16 tiles are
//! [`super::amx_bf16`]'s.
//!
//! **Permission.** Linux (≥ 5.16) hands out the 8 KiB of tile state per process on request:
//! `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` before the first tile instruction,
//! which would otherwise kill the process. [`status`] asks once; refused, AMX is off.
//!
//! **Stable Rust.** The AMX intrinsics are nightly-only, so the instructions are written with
//! `asm!`, the tile registers named as clobbers (stable supports `tmm0`–`tmm7` only so); the
//! 64-byte tile configuration is a plain aligned struct loaded by `ldtilecfg`.

use std::sync::OnceLock;

/// What this process found out about AMX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxStatus {
    /// The CPU (or the hypervisor in front of it) reports no AMX-TILE / AMX-INT8 / AMX-BF16, or
    /// the OS does not save tile state (XCR0 bits 17–18).
    Absent,
    /// The CPU has it and the OS saves it, but the kernel refused this process the tile state.
    Refused,
    /// Tiles may be used: AMX-INT8, and AMX-BF16 where `bf16` says so.
    Usable { bf16: bool },
}

impl AmxStatus {
    /// One line for the start-up banner.
    pub fn describe(self) -> &'static str {
        match self {
            AmxStatus::Absent => "no AMX on this CPU",
            AmxStatus::Refused => "AMX present but the kernel refused tile permission (arch_prctl): AMX off",
            // Which tiles run is the ISA level's choice (`kernels::describe` says it).
            AmxStatus::Usable { bf16: true } => "AMX-INT8 and AMX-BF16 usable",
            AmxStatus::Usable { bf16: false } => "AMX-INT8 usable",
        }
    }
}

/// AMX as this process may use it, found out (and permission asked) on the first call.
pub fn status() -> AmxStatus {
    static STATUS: OnceLock<AmxStatus> = OnceLock::new();
    *STATUS.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> AmxStatus {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    // Leaf 7 is read only when leaf 0 reports it.
    if __cpuid_count(0, 0).eax < 7 {
        return AmxStatus::Absent;
    }
    let (edx7, ecx1) = (__cpuid_count(7, 0).edx, __cpuid_count(1, 0).ecx);
    let (bf16, tile, int8) = (edx7 >> 22 & 1 == 1, edx7 >> 24 & 1 == 1, edx7 >> 25 & 1 == 1);
    // OSXSAVE (CPUID.1:ECX bit 27) makes XGETBV legal.
    if !(tile && int8) || ecx1 >> 27 & 1 == 0 {
        return AmxStatus::Absent;
    }
    // SAFETY: OSXSAVE is set, so XGETBV with ECX = 0 (XCR0) is allowed.
    let xcr0 = unsafe { _xgetbv(0) };
    if xcr0 >> 17 & 3 != 3 {
        return AmxStatus::Absent;
    }
    if !request_permission() {
        return AmxStatus::Refused;
    }
    AmxStatus::Usable { bf16 }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> AmxStatus {
    AmxStatus::Absent
}

/// Ask Linux for the tile data state (once per process; threads inherit it).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM only changes this process's permitted xsave
    // features; it reads and writes no memory of ours.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

/// Elsewhere the OS either enables tiles for every process or not at all; XCR0 said it does.
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_permission() -> bool {
    true
}

/// Bytes of a B tile row: 16 columns × 4 inputs.
pub const B_ROW: usize = 64;
/// Rows of A (and of C) one tile holds at most.
pub const TILE_ROWS: usize = 16;
/// Rows one [`Int8Tiles::dot`] covers at most: two A tiles sharing one B tile, so each B load
/// serves two tile products.
pub const MAX_ROWS: usize = 2 * TILE_ROWS;

/// Exact int32 sums of up to [`MAX_ROWS`] rows × 16 columns.
pub type Sums = [[i32; 16]; MAX_ROWS];

/// `C = A · B` over one K-slice, `K` = 16 or 32 inputs (`tdpbssd`: signed bytes times signed
/// bytes): `A` is `m` rows of `k` bytes, `stride` bytes apart; `B` is `k / 4` rows of [`B_ROW`]
/// bytes (input group `g`, column `c`, input `i` of the group at `g·64 + c·4 + i`);
/// `C[r][c] = Σ A[r][j] · B(j, c)` exactly.
pub trait Int8Tiles {
    /// Prepare for `m` rows (1..=[`MAX_ROWS`]) of K-slices of `k` (32 or 16) inputs. Cheap when
    /// nothing changed.
    fn configure(&mut self, m: usize, k: usize);
    /// `c[..m] = A · B` over the configured `k` inputs, in C tile set `set` (0 or 1): a product
    /// in the other set does not wait for this one's sums to be stored, so alternating sets lets
    /// the tile unit run ahead.
    ///
    /// # Safety
    /// `a` points at `m` rows of `k` readable bytes, `stride` apart; `b` at `k / 4 · 64`
    /// readable bytes; `m` and `k` are the configured ones.
    unsafe fn dot(&mut self, a: *const i8, stride: usize, b: *const i8, c: &mut Sums, set: usize);
}

/// The reference: the SDM's definition of `tdpbssd`, one integer product at a time.
#[derive(Default)]
pub struct EmulatedTiles {
    m: usize,
    k: usize,
}

impl Int8Tiles for EmulatedTiles {
    fn configure(&mut self, m: usize, k: usize) {
        (self.m, self.k) = (m, k);
    }

    unsafe fn dot(&mut self, a: *const i8, stride: usize, b: *const i8, c: &mut Sums, _set: usize) {
        let k = self.k;
        for (r, row) in c.iter_mut().enumerate().take(self.m) {
            // SAFETY: the caller's contract: `m` rows of `k` bytes, `stride` apart.
            let a = unsafe { std::slice::from_raw_parts(a.add(r * stride), k) };
            // SAFETY: the caller's contract: `k / 4` rows of 64 bytes.
            let b = unsafe { std::slice::from_raw_parts(b, k / 4 * B_ROW) };
            for (col, out) in row.iter_mut().enumerate() {
                *out = (0..k).map(|j| a[j] as i32 * b[(j / 4) * B_ROW + col * 4 + j % 4] as i32).sum();
            }
        }
    }
}

/// The hardware: `tdpbssd`, A in tiles 0–1 (rows 0–15, 16–31), B in tile 2, C in tiles 3–4
/// (set 0) or 5–6 (set 1).
#[cfg(target_arch = "x86_64")]
pub struct HardwareTiles {
    cfg: TileConfig,
    /// The row count and K `cfg` was last loaded for (0: never).
    configured: (usize, usize),
    _not_send: std::marker::PhantomData<*const ()>,
}

/// `ldtilecfg`'s operand: palette 1, per tile its bytes per row and its rows; everything else 0.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    pub(crate) colsb: [u16; 16],
    pub(crate) rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
impl TileConfig {
    /// Palette 1 with every tile unconfigured.
    pub(crate) fn new() -> Self {
        TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] }
    }

    /// `ldtilecfg` (which also zeroes every tile).
    ///
    /// # Safety
    /// [`status`] said the tiles are usable; the shapes are within palette 1's (16 rows, 64 bytes).
    pub(crate) unsafe fn load(&self) {
        // SAFETY: the caller's contract; the configuration is 64-byte aligned, reserved bytes 0.
        unsafe { std::arch::asm!("ldtilecfg [{0}]", in(reg) self as *const TileConfig, options(nostack, readonly)) }
    }
}

#[cfg(target_arch = "x86_64")]
impl HardwareTiles {
    /// `None` unless [`status`] says the tiles are usable. Tile state belongs to the thread:
    /// create one per task (it is not `Send`), and drop it to release the tiles.
    pub fn new() -> Option<Self> {
        matches!(status(), AmxStatus::Usable { .. }).then(|| Self {
            cfg: TileConfig::new(),
            configured: (0, 0),
            _not_send: std::marker::PhantomData,
        })
    }
}

/// `tilerelease`: every tile back to its initial state (what a task's tiles do when dropped).
///
/// # Safety
/// [`status`] said the tiles are usable.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn release_tiles() {
    // SAFETY: the caller's contract; every tile register is named as clobbered.
    unsafe {
        std::arch::asm!(
            "tilerelease",
            out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
            out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
            options(nostack)
        )
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for HardwareTiles {
    fn drop(&mut self) {
        // SAFETY: `new` checked AMX is usable.
        unsafe { release_tiles() }
    }
}

/// One K-slice on the tiles: B into tmm2, then per A tile (tmm0: rows 0–15; tmm1: rows 16–31,
/// only where `$a1` is given) zero its C tile, load A, multiply, and store C. The C tiles of
/// the two sets are named by the caller.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_dot {
    ($a:expr, $stride:expr, $b:expr, $c:expr, $c0:literal) => {
        std::arch::asm!(
            "tileloadd tmm2, [{b} + {sb} * 1]",
            concat!("tilezero ", $c0),
            "tileloadd tmm0, [{a} + {sa} * 1]",
            concat!("tdpbssd ", $c0, ", tmm0, tmm2"),
            concat!("tilestored [{c} + {sc} * 1], ", $c0),
            a = in(reg) $a, sa = in(reg) $stride, b = in(reg) $b, sb = in(reg) B_ROW,
            c = in(reg) $c, sc = in(reg) 64usize,
            out("tmm0") _, out("tmm2") _, out("tmm3") _, out("tmm5") _, options(nostack),
        )
    };
    ($a:expr, $a1:expr, $stride:expr, $b:expr, $c:expr, $c1:expr, $c0:literal, $c0b:literal) => {
        std::arch::asm!(
            "tileloadd tmm2, [{b} + {sb} * 1]",
            concat!("tilezero ", $c0),
            concat!("tilezero ", $c0b),
            "tileloadd tmm0, [{a} + {sa} * 1]",
            concat!("tdpbssd ", $c0, ", tmm0, tmm2"),
            "tileloadd tmm1, [{a1} + {sa} * 1]",
            concat!("tdpbssd ", $c0b, ", tmm1, tmm2"),
            concat!("tilestored [{c} + {sc} * 1], ", $c0),
            concat!("tilestored [{c1} + {sc} * 1], ", $c0b),
            a = in(reg) $a, a1 = in(reg) $a1, sa = in(reg) $stride, b = in(reg) $b, sb = in(reg) B_ROW,
            c = in(reg) $c, c1 = in(reg) $c1, sc = in(reg) 64usize,
            out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _, out("tmm4") _, out("tmm5") _,
            out("tmm6") _, options(nostack),
        )
    };
}

#[cfg(target_arch = "x86_64")]
impl Int8Tiles for HardwareTiles {
    fn configure(&mut self, m: usize, k: usize) {
        let m = m.clamp(1, MAX_ROWS);
        // `ldtilecfg` costs far more than a tile product; `dot` zeroes its C tiles itself.
        if self.configured == (m, k) {
            return;
        }
        self.configured = (m, k);
        let (m0, m1) = (m.min(TILE_ROWS) as u8, m.saturating_sub(TILE_ROWS) as u8);
        let (ka, kb) = (k.clamp(4, 64) as u16, (k / 4).clamp(1, 16) as u8);
        let c = &mut self.cfg;
        // tmm0/tmm1: A of rows 0–15 / 16–31 (k bytes a row); tmm2: B (k / 4 rows of 64 bytes);
        // tmm3/tmm4 and tmm5/tmm6: the two sets of C. A tile of 0 rows is left unconfigured,
        // and `dot` does not touch it.
        let second = |bytes: u16| if m1 == 0 { 0 } else { bytes };
        (c.rows[0], c.colsb[0], c.rows[1], c.colsb[1], c.rows[2], c.colsb[2]) = (m0, ka, m1, second(ka), kb, 64);
        (c.rows[3], c.colsb[3], c.rows[4], c.colsb[4]) = (m0, 64, m1, second(64));
        (c.rows[5], c.colsb[5], c.rows[6], c.colsb[6]) = (m0, 64, m1, second(64));
        // SAFETY: `new` checked AMX is usable and permitted; the shapes are within palette 1's.
        unsafe { self.cfg.load() }
    }

    unsafe fn dot(&mut self, a: *const i8, stride: usize, b: *const i8, c: &mut Sums, set: usize) {
        let out = c.as_mut_ptr().cast::<i32>();
        // SAFETY: the caller's contract gives readable A and B (`a` + 16 rows is inside A
        // whenever a second tile is configured, for more than 16 rows); C has room for 32 rows
        // of 64 bytes; the tiles were configured for these shapes by `configure`. The tile
        // registers are not preserved across calls: each block zeroes and loads what it uses.
        unsafe {
            let (a1, out1) = (a.wrapping_add(TILE_ROWS * stride), out.wrapping_add(TILE_ROWS * 16));
            match (self.configured.0 > TILE_ROWS, set == 0) {
                (true, true) => tile_dot!(a, a1, stride, b, out, out1, "tmm3", "tmm4"),
                (true, false) => tile_dot!(a, a1, stride, b, out, out1, "tmm5", "tmm6"),
                (false, true) => tile_dot!(a, stride, b, out, "tmm3"),
                (false, false) => tile_dot!(a, stride, b, out, "tmm5"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulation against a plain matrix product over the layout it documents.
    #[test]
    fn emulated_dot_is_the_matrix_product() {
        let mut stream = crate::kernels::xorshift(0x9e37_79b9u32);
        let mut next = || stream.next().unwrap_or(0);
        for (m, k) in [(1, 32), (16, 32), (5, 16), (16, 16), (17, 32), (32, 16)] {
            let stride = k + 7;
            let a: Vec<i8> = (0..m * stride).map(|_| next() as i8).collect();
            let b: Vec<i8> = (0..k / 4 * B_ROW).map(|_| next() as i8).collect();
            let mut t = EmulatedTiles::default();
            t.configure(m, k);
            let mut c = [[7i32; 16]; MAX_ROWS];
            // SAFETY: `a` holds m rows of `stride` ≥ k bytes, `b` k/4 rows of 64.
            unsafe { t.dot(a.as_ptr(), stride, b.as_ptr(), &mut c, 0) };
            for r in 0..m {
                for col in 0..16 {
                    let want: i32 =
                        (0..k).map(|j| a[r * stride + j] as i32 * b[j / 4 * 64 + col * 4 + j % 4] as i32).sum();
                    assert_eq!(c[r][col], want, "m {m} k {k} row {r} col {col}");
                }
            }
            assert!(c[m..].iter().all(|row| row == &[7; 16]), "rows past m are not written");
        }
    }

    /// The tiles against the emulation, where this CPU has them (skipped, and saying so,
    /// elsewhere): every row count of one and two A tiles, both K-slices, any strides, and the
    /// extremes of signed bytes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hardware_int8_tiles_give_the_emulated_sums() {
        let Some(mut hw) = HardwareTiles::new() else {
            eprintln!("skipped: no usable AMX tiles here ({})", status().describe());
            return;
        };
        let mut stream = crate::kernels::xorshift(0x2545_f491u32);
        let mut next = || stream.next().unwrap_or(0);
        for m in 1..=MAX_ROWS {
            for (k, set) in [(32, 0), (16, 1), (32, 1), (16, 0)] {
                let stride = 32 + 64 * (m % 3);
                let extreme = |v: u32| if v.is_multiple_of(5) { [-128i8, 127][v as usize % 2] } else { v as i8 };
                let a: Vec<i8> = (0..m * stride).map(|_| extreme(next())).collect();
                let b: Vec<i8> = (0..k / 4 * B_ROW).map(|_| extreme(next())).collect();
                let mut emu = EmulatedTiles::default();
                emu.configure(m, k);
                hw.configure(m, k);
                let (mut want, mut got) = ([[0i32; 16]; MAX_ROWS], [[0i32; 16]; MAX_ROWS]);
                // SAFETY: `a` holds m rows of `stride` ≥ k bytes, `b` k/4 rows of 64.
                unsafe {
                    emu.dot(a.as_ptr(), stride, b.as_ptr(), &mut want, set);
                    hw.dot(a.as_ptr(), stride, b.as_ptr(), &mut got, set);
                }
                assert_eq!(got[..m], want[..m], "m {m} k {k} set {set}");
            }
        }
    }

    #[test]
    fn status_is_consistent_with_the_cpu() {
        let s = status();
        assert!(!s.describe().is_empty());
        #[cfg(target_arch = "x86_64")]
        if s == AmxStatus::Absent {
            assert!(HardwareTiles::new().is_none());
        }
    }
}
