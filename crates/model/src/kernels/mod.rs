//! flint's own CPU kernels for the hot path, each bit-for-bit independent of batch composition
//! (see each module for how) and tested against a plain reference.

pub mod attention;
pub mod matmul_f32;
pub mod matmul_q8;
