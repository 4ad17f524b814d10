//! The device a model runs on, as the command line names it (`cpu`, `cuda`, `cuda:N`, `metal`),
//! and what flint has validated on each. CPU runs flint's own kernels; a CUDA GPU runs candle's
//! CUDA ops (cuBLAS for dense weights, candle's quantized CUDA matmul for GGUF) with the KV pool
//! and paged attention in device memory ([`crate::device_cache`]). Metal has no kernels in flint.

use std::fmt;
use std::str::FromStr;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

use crate::error::{ModelError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
    Metal,
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            "metal" => Ok(Self::Metal),
            d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => Ok(Self::Cuda(i)),
                _ => Err(format!("unknown device {s:?} (cpu, cuda, cuda:N or metal)")),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
            Self::Metal => f.write_str("metal"),
        }
    }
}

/// Whether this binary was built with the `cuda` feature.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

impl DeviceSpec {
    /// Open the device, or say in one line why it cannot be and what to do.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(i) if !CUDA_BUILT => Err(ModelError::Device(format!(
                "--device cuda:{i}: this flint was built without CUDA; rebuild with `cargo build --release -p flint \
                 --features cuda` (scripts/check_cuda_build.sh sets up a CUDA toolkit without a GPU)"
            ))),
            Self::Cuda(i) => Device::new_cuda(i).map_err(|e| {
                ModelError::Device(format!(
                    "--device cuda:{i}: cannot open the GPU ({}); check `nvidia-smi` and the ordinal",
                    first_line(&e.to_string())
                ))
            }),
            Self::Metal => Err(ModelError::Device(
                "--device metal: flint has no Metal kernels (the metal feature builds candle's backend only); use \
                 --device cpu or cuda:N"
                    .into(),
            )),
        }
    }

    /// The spec of an open device.
    pub fn of(device: &Device) -> Self {
        match device.location() {
            candle_core::DeviceLocation::Cpu => Self::Cpu,
            candle_core::DeviceLocation::Cuda { gpu_id } => Self::Cuda(gpu_id),
            candle_core::DeviceLocation::Metal { .. } => Self::Metal,
        }
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// GGUF block types whose matmul runs on a GPU through candle's quantized CUDA kernels, as the
/// device check validates them; others are refused there rather than risked.
pub const GPU_QUANT_TYPES: [GgmlDType; 4] = [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K, GgmlDType::Q6K];

/// Refuse a compute dtype flint does not run on `device`: CPU takes f32, bf16 and f16; a GPU
/// bf16, f16 and f32 (the device golden tests state each one's tolerance).
pub fn check_dtype(device: &Device, dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Ok(());
    }
    Err(ModelError::Device(format!(
        "compute dtype {dtype:?} is not supported on {}: use f32, bf16 or f16",
        DeviceSpec::of(device)
    )))
}

/// `(free, total)` bytes of a GPU's memory; `None` on the CPU.
pub fn memory_info(device: &Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return d.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_device_names() {
        for (s, d) in [("cpu", DeviceSpec::Cpu), ("cuda", DeviceSpec::Cuda(0)), ("cuda:3", DeviceSpec::Cuda(3))] {
            assert_eq!(s.parse::<DeviceSpec>(), Ok(d));
        }
        assert_eq!(DeviceSpec::Cuda(1).to_string(), "cuda:1");
        assert!("tpu".parse::<DeviceSpec>().unwrap_err().contains("unknown device \"tpu\""));
        assert!("cuda:x".parse::<DeviceSpec>().is_err());
    }

    #[test]
    fn unavailable_devices_fail_with_what_to_do() {
        assert!(DeviceSpec::Cpu.open().is_ok());
        let metal = DeviceSpec::Metal.open().unwrap_err().to_string();
        assert!(metal.contains("no Metal kernels"), "{metal}");
        match DeviceSpec::Cuda(0).open() {
            Ok(d) => assert!(CUDA_BUILT && d.is_cuda()),
            Err(e) if CUDA_BUILT => assert!(e.to_string().contains("cannot open the GPU"), "{e}"),
            Err(e) => {
                assert!(e.to_string().contains("built without CUDA") && e.to_string().contains("--features cuda"))
            }
        }
    }
}
