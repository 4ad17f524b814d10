//! The storage types an export may ask for, and the type each tensor is then stored as.
//!
//! Type rules (what llama.cpp does, simplified where candle lacks llama.cpp's type ladder):
//! - 1-D tensors (norms, biases) stay F32 whatever was asked: they are tiny and precision-critical.
//! - 2-D tensors take the requested type when their row length (last dim) is a multiple of its
//!   block size; otherwise Q8_0 when the row is a multiple of 32, else F16. llama.cpp falls back
//!   to a nearer type (Q5_0 for Q4_K, …); Q8_0 is the one fallback every reader handles and it
//!   never loses more precision than the type that was asked for.

use std::fmt;
use std::str::FromStr;

use candle_core::quantized::GgmlDType;

use crate::error::{ModelError, Result};

/// The storage type asked for a GGUF export (`--gguf q8_0` and friends).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_K,
    Q6_K,
}

impl GgufType {
    pub const ALL: [GgufType; 7] =
        [GgufType::F32, GgufType::F16, GgufType::BF16, GgufType::Q8_0, GgufType::Q4_0, GgufType::Q4_K, GgufType::Q6_K];

    /// The name used on the command line and in file names (`model-q4_k.gguf`).
    pub fn as_str(self) -> &'static str {
        match self {
            GgufType::F32 => "f32",
            GgufType::F16 => "f16",
            GgufType::BF16 => "bf16",
            GgufType::Q8_0 => "q8_0",
            GgufType::Q4_0 => "q4_0",
            GgufType::Q4_K => "q4_k",
            GgufType::Q6_K => "q6_k",
        }
    }

    pub fn ggml(self) -> GgmlDType {
        match self {
            GgufType::F32 => GgmlDType::F32,
            GgufType::F16 => GgmlDType::F16,
            GgufType::BF16 => GgmlDType::BF16,
            GgufType::Q8_0 => GgmlDType::Q8_0,
            GgufType::Q4_0 => GgmlDType::Q4_0,
            GgufType::Q4_K => GgmlDType::Q4K,
            GgufType::Q6_K => GgmlDType::Q6K,
        }
    }

    /// llama.cpp's `LLAMA_FTYPE_*` for `general.file_type`. Uniform Q4_K is reported as
    /// Q4_K_M (15), the Q4_K variant llama.cpp users know; the file says per tensor what it holds.
    pub fn file_type(self) -> u32 {
        match self {
            GgufType::F32 => 0,
            GgufType::F16 => 1,
            GgufType::Q4_0 => 2,
            GgufType::Q8_0 => 7,
            GgufType::Q4_K => 15,
            GgufType::Q6_K => 18,
            GgufType::BF16 => 32,
        }
    }
}

impl fmt::Display for GgufType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for GgufType {
    type Err = ModelError;

    /// Case-insensitive; `q4_k_m` is accepted as an alias of `q4_k` since that is the name
    /// llama.cpp users type.
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        let lower = if lower == "q4_k_m" { "q4_k".to_string() } else { lower };
        GgufType::ALL.into_iter().find(|t| t.as_str() == lower).ok_or_else(|| {
            let known: Vec<&str> = GgufType::ALL.iter().map(|t| t.as_str()).collect();
            ModelError::Config(format!("unknown GGUF type {s:?} (known: {})", known.join(", ")))
        })
    }
}

/// The GGML type a tensor of `shape` is stored as when `ty` is requested (see the module docs).
/// Merged experts (3-D) are matrices stacked: each row is quantized as a matrix's would be.
pub fn storage_type(ty: GgufType, shape: &[usize]) -> GgmlDType {
    if !(2..=3).contains(&shape.len()) {
        return GgmlDType::F32;
    }
    let cols = shape[shape.len() - 1];
    let wanted = ty.ggml();
    if cols.is_multiple_of(wanted.block_size()) {
        wanted
    } else if cols.is_multiple_of(GgmlDType::Q8_0.block_size()) {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F16
    }
}

/// [`storage_type`] for the tensor `hf_name`: a mixture's routers (`mlp.gate`,
/// `mlp.shared_expert_gate`) stay F32 whatever was asked, as llama.cpp's converter and quantizer
/// keep them: they are small, and rounding them would move tokens between experts.
pub fn tensor_storage_type(ty: GgufType, hf_name: &str, shape: &[usize]) -> GgmlDType {
    if hf_name.ends_with(".mlp.gate.weight") || hf_name.ends_with(".mlp.shared_expert_gate.weight") {
        GgmlDType::F32
    } else {
        storage_type(ty, shape)
    }
}

/// GGML's on-disk type id (candle keeps its own mapping crate-private).
pub(super) fn ggml_type_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// Bytes a tensor of `shape` occupies as `t` (unpadded).
pub(super) fn tensor_nbytes(t: GgmlDType, shape: &[usize]) -> u64 {
    let elems: usize = shape.iter().product();
    (elems / t.block_size() * t.type_size()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names_round_trip() {
        for t in GgufType::ALL {
            assert_eq!(t.to_string().parse::<GgufType>().unwrap(), t);
        }
        assert_eq!("Q4_K_M".parse::<GgufType>().unwrap(), GgufType::Q4_K);
        let e = "q3_k".parse::<GgufType>().unwrap_err().to_string();
        assert!(e.contains("q3_k") && e.contains("q8_0"), "{e}");
    }

    #[test]
    fn fallback_rules() {
        // 1-D stays F32 whatever was asked.
        assert_eq!(storage_type(GgufType::Q4_K, &[896]), GgmlDType::F32);
        assert_eq!(storage_type(GgufType::F16, &[896]), GgmlDType::F32);
        // Qwen2.5-0.5B's hidden 896 is not a multiple of 256: Q4_K rows fall back to Q8_0.
        assert_eq!(storage_type(GgufType::Q4_K, &[4864, 896]), GgmlDType::Q8_0);
        assert_eq!(storage_type(GgufType::Q6_K, &[896, 4864]), GgmlDType::Q6K);
        assert_eq!(storage_type(GgufType::Q4_0, &[64, 48]), GgmlDType::F16);
        assert_eq!(storage_type(GgufType::BF16, &[64, 48]), GgmlDType::BF16);
        // Merged experts quantize as matrices; routers stay F32.
        assert_eq!(storage_type(GgufType::Q4_K, &[128, 768, 2048]), GgmlDType::Q4K);
        assert_eq!(tensor_storage_type(GgufType::Q4_K, "model.layers.0.mlp.gate.weight", &[128, 2048]), GgmlDType::F32);
        let shared_gate = "model.layers.3.mlp.shared_expert_gate.weight";
        assert_eq!(tensor_storage_type(GgufType::Q8_0, shared_gate, &[1, 2048]), GgmlDType::F32);
        assert_eq!(storage_type(GgufType::Q8_0, &[2, 3, 4, 64]), GgmlDType::F32);
    }
}
