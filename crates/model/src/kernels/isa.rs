//! The one instruction-set level every kernel dispatches on, detected once per process.
//!
//! The levels are ordered, each including everything below it, so a kernel takes its widest path
//! at or below [`Isa::detected`], and a test forces a lower path by passing a lower level.
//! `FLINT_CPU_ISA` (`scalar`, `avx2`, `avx512`, `avx512bf16`, `amx-bf16`, `amx`/`native`) caps
//! the level below what the CPU has, to measure or work around a path. Unset, the cap is
//! [`DEFAULT_CAP`]: AMX-BF16 tiles, not AMX-INT8 (see there why). Every level gives the same bits
//! but two: [`Isa::Avx512Bf16`] allows bf16 weights to be computed in bf16 dot products
//! (activations rounded to bf16), [`Isa::AmxBf16`] in bf16 tile products (the same rounding,
//! the tiles' order of sums); below them they are always computed in exact f32 products.

use std::sync::OnceLock;

/// The level used when `FLINT_CPU_ISA` is unset or empty: everything but the AMX int8 path, which
/// is exact but no faster than VNNI. Measured on real tiles on a Sapphire Rapids-class Xeon (2
/// threads): pp512 of synthesized qwen2.5-0.5b q8_0 / q4_0 GGUFs ran at 322–386 tok/s with
/// AMX-INT8 against 419–599 with VNNI (`scripts/amx_check.sh`); since then the tile loop is
/// pipelined, and a 2048×2048 matmul of 512 rows runs at 0.96–1.18× VNNI, 16–64 rows at
/// 0.6–0.9× (`q8_tile_cost`; why in `matmul_q8::amx`). The bf16 tiles, whose f32 sums stay in
/// the tiles, ran bf16 pp512 at 664–736 tok/s against 271–275 for the f32 products that the
/// default picked there, so they are on.
pub const DEFAULT_CAP: Isa = Isa::AmxBf16;

/// An x86 vector-extension level (see the module docs). A kernel that has no path of its own
/// for a level takes its widest one below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust: the reference every SIMD path is tested against.
    Scalar,
    /// AVX2 with FMA and F16C (every AVX2 CPU has them).
    Avx2,
    /// AVX-512 F and BW.
    Avx512,
    /// AVX-512 VNNI (`vpdpbusd`): the int8 kernels' integer dot products in one instruction.
    Avx512Vnni,
    /// AVX-512 BF16 (`vdpbf16ps`): bf16 dot products. Every CPU that has it has VNNI too, and
    /// it is counted only with VNNI.
    Avx512Bf16,
    /// Intel AMX tiles usable by this process (the kernel granted the tile state; see
    /// [`super::amx`]), on top of AVX-512 BF16 (every AMX CPU has it): AMX-BF16's `tdpbf16ps`
    /// for bf16 weights ([`super::amx_bf16`]), where the CPU has AMX-BF16; int8 stays on VNNI.
    AmxBf16,
    /// AMX-INT8's `tdpbsud` too: the int8 matmul of two or more rows runs on tiles, with the
    /// same bits as every other path (opt-in, see [`DEFAULT_CAP`]).
    Amx,
}

impl Isa {
    /// What the kernels use in this process: the highest level the CPU has, capped by
    /// `FLINT_CPU_ISA`, else by [`DEFAULT_CAP`] (an unreadable value gives the default; the CLI
    /// refuses it before any kernel runs). Detected on the first call.
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let cap = std::env::var("FLINT_CPU_ISA").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CAP);
            Isa::of_cpu().min(cap)
        })
    }

    /// Whether this process may run `self`'s paths: the CPU has them and the cap allows them.
    pub fn available(self) -> bool {
        self <= Isa::detected()
    }

    /// `self` where it is [available](Self::available), else the scalar path (which gives the
    /// same bits): what a kernel asked for a level runs.
    pub(crate) fn or_scalar(self) -> Isa {
        if self.available() {
            self
        } else {
            Isa::Scalar
        }
    }

    /// The highest level this CPU has, uncapped.
    fn of_cpu() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if !(has!("avx2") && has!("fma") && has!("f16c")) {
                Isa::Scalar
            } else if !(has!("avx512f") && has!("avx512bw")) {
                Isa::Avx2
            } else if !has!("avx512vnni") {
                Isa::Avx512
            } else if !has!("avx512bf16") {
                Isa::Avx512Vnni
            } else if !matches!(super::amx::status(), super::amx::AmxStatus::Usable { .. }) {
                Isa::Avx512Bf16
            } else {
                Isa::Amx
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Scalar
    }
}

/// Whether the CPU is Intel's (CPUID's vendor string), for the few tunings that differ between
/// vendors at the same instruction set.
pub(crate) fn cpu_is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        // "GenuineIntel" in EBX, EDX, ECX.
        (id.ebx, id.edx, id.ecx) == (0x756e_6547, 0x4965_6e69, 0x6c65_746e)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The CPU's family as CPUID leaf 1 gives it (the base family, plus the extended family where the
/// base is 15), as `cpu family` in /proc/cpuinfo: AMD's Zen 4 is 25 (0x19), Zen 5 26 (0x1A).
pub(crate) fn cpu_family() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 1 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let eax = unsafe { std::arch::x86_64::__cpuid(1) }.eax;
        let base = (eax >> 8) & 0xF;
        if base == 0xF {
            base + ((eax >> 20) & 0xFF)
        } else {
            base
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// The CPUs whose int8 tiles prefetch their weight streams differently (see `matmul_q8::x86`'s
/// `vnni_ahead`): the hardware prefetchers and out-of-order windows differ enough that each was
/// measured on its own.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Streamer {
    Intel,
    /// AMD from family 26 (0x1A, Zen 5) on.
    Zen5,
    /// Zen 4 and every other CPU.
    Other,
}

/// Which [`Streamer`] this CPU is, asked of CPUID once (the kernels read it on every call).
pub(crate) fn streamer() -> Streamer {
    static CPU: std::sync::OnceLock<Streamer> = std::sync::OnceLock::new();
    *CPU.get_or_init(|| streamer_of(cpu_is_intel(), cpu_family()))
}

fn streamer_of(intel: bool, family: u32) -> Streamer {
    match (intel, family) {
        (true, _) => Streamer::Intel,
        (false, f) if f >= 0x1A => Streamer::Zen5,
        _ => Streamer::Other,
    }
}

/// `FLINT_CPU_ISA`'s values. `avx512` caps below the bf16 dot products only: VNNI, which changes
/// no bits, stays where the CPU has it. Empty is the default, [`DEFAULT_CAP`].
impl std::str::FromStr for Isa {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "scalar" => Ok(Isa::Scalar),
            "avx2" => Ok(Isa::Avx2),
            "avx512" => Ok(Isa::Avx512Vnni),
            "avx512bf16" => Ok(Isa::Avx512Bf16),
            "amx-bf16" | "amx_bf16" | "amxbf16" => Ok(Isa::AmxBf16),
            "amx" | "native" => Ok(Isa::Amx),
            "" => Ok(DEFAULT_CAP),
            other => Err(format!(
                "unknown instruction set {other:?} (expected scalar, avx2, avx512, avx512bf16, amx-bf16 or amx)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Isa;

    #[test]
    fn cap_parses_and_levels_order() {
        assert_eq!("AVX2".parse::<Isa>(), Ok(Isa::Avx2));
        assert_eq!("scalar".parse::<Isa>(), Ok(Isa::Scalar));
        assert_eq!("native".parse::<Isa>(), Ok(Isa::Amx));
        assert_eq!("amx".parse::<Isa>(), Ok(Isa::Amx), "AMX only when asked for");
        assert_eq!("".parse::<Isa>(), Ok(super::DEFAULT_CAP));
        assert_eq!("amx-bf16".parse::<Isa>(), Ok(Isa::AmxBf16));
        assert_eq!(super::DEFAULT_CAP, Isa::AmxBf16, "AMX-BF16 by default, AMX-INT8 opt-in");
        assert_eq!("avx512bf16".parse::<Isa>(), Ok(Isa::Avx512Bf16), "avx512bf16 turns AMX off");
        assert_eq!("avx512".parse::<Isa>(), Ok(Isa::Avx512Vnni), "avx512 keeps VNNI, drops BF16");
        assert!("sse9".parse::<Isa>().unwrap_err().contains("sse9"));
        assert!(Isa::Scalar < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Avx512Vnni);
        assert!(Isa::Avx512Vnni < Isa::Avx512Bf16 && Isa::Avx512Bf16 < Isa::AmxBf16 && Isa::AmxBf16 < Isa::Amx);
    }

    #[test]
    fn unavailable_levels_run_scalar() {
        assert!(Isa::Scalar.available());
        assert_eq!(Isa::Scalar.or_scalar(), Isa::Scalar);
        assert_eq!(Isa::detected().or_scalar(), Isa::detected());
        if Isa::detected() < Isa::Avx512Bf16 {
            assert_eq!(Isa::Avx512Bf16.or_scalar(), Isa::Scalar);
        }
    }

    /// The first value of `field` in /proc/cpuinfo; `None` (and a line saying the test is
    /// skipped) where there is no such file or field.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn cpuinfo(field: &str) -> Option<String> {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            eprintln!("skipped: no /proc/cpuinfo");
            return None;
        };
        let value = info.lines().find_map(|l| l.strip_prefix(field)).map(|v| v.trim_start_matches([' ', '\t', ':']));
        if value.is_none() {
            eprintln!("skipped: /proc/cpuinfo has no {field}");
        }
        value.map(str::to_string)
    }

    /// The vendor CPUID names is the one the kernel reports (`vendor_id` in /proc/cpuinfo).
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn vendor_matches_proc_cpuinfo() {
        let Some(vendor) = cpuinfo("vendor_id") else {
            return;
        };
        assert_eq!(super::cpu_is_intel(), vendor == "GenuineIntel", "vendor_id {vendor}");
    }

    #[test]
    fn streamers_by_vendor_and_family() {
        use super::{streamer_of, Streamer};
        assert_eq!(streamer_of(true, 6), Streamer::Intel);
        assert_eq!(streamer_of(false, 0x19), Streamer::Other, "Zen 4");
        assert_eq!(streamer_of(false, 0x1A), Streamer::Zen5);
        assert_eq!(streamer_of(false, 0x17), Streamer::Other, "Zen 2");
    }

    /// The family CPUID gives is the one the kernel reports (`cpu family` in /proc/cpuinfo).
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn family_matches_proc_cpuinfo() {
        let Some(family) = cpuinfo("cpu family").and_then(|v| v.parse::<u32>().ok()) else {
            eprintln!("skipped: /proc/cpuinfo's cpu family is not a number");
            return;
        };
        assert_eq!(super::cpu_family(), family);
    }
}
