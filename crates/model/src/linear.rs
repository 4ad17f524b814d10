//! A projection `y = x·Wᵀ (+ b)` whose weight is dense or GGUF-quantized. The seam where flint's
//! own CPU kernels will plug in; candle does the work for now.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::error::Result;
use crate::weights::Weight;

pub enum Linear {
    /// `w` is `[out, in]` in the compute dtype.
    Dense {
        w: Tensor,
        b: Option<Tensor>,
    },
    Quantized {
        w: QMatMul,
        b: Option<Tensor>,
    },
}

impl Linear {
    pub fn new(w: Weight, b: Option<Tensor>) -> Result<Self> {
        Ok(match w {
            Weight::Dense(w) => Linear::Dense { w, b },
            Weight::Quantized(q) => Linear::Quantized { w: QMatMul::from_qtensor(q)?, b },
        })
    }

    pub fn from_qtensor(q: QTensor) -> Result<Self> {
        Ok(Linear::Quantized { w: QMatMul::from_qtensor(q)?, b: None })
    }

    /// `x`: `[n, in]` → `[n, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, b) = match self {
            Linear::Dense { w, b } => (x.matmul(&w.t()?)?, b),
            Linear::Quantized { w, b } => {
                // candle's quantized kernels take f32 activations.
                let x32 = if x.dtype() == DType::F32 { x.clone() } else { x.to_dtype(DType::F32)? };
                let y = w.forward(&x32.contiguous()?)?;
                (if x.dtype() == DType::F32 { y } else { y.to_dtype(x.dtype())? }, b)
            }
        };
        Ok(match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
