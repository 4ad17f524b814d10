//! What the cost examples share: their argument reading, their random numbers and their Q4_K
//! weights. (A folder module, so cargo does not take it for an example of its own.) Each example
//! uses only some of it.
#![allow(dead_code)]

use flint_model::kernels::matmul_q8::{Format, PackedQ8};

/// Q4_K: 144 bytes per 256 values.
pub const Q4K_BYTES: usize = 144;

/// The value after `name` on the command line, else `default`.
pub fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_string())
}

/// xorshift32: deterministic inputs without a dependency.
pub struct Rng(pub u32);

impl Rng {
    pub fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        self.0
    }
}

/// Random Q4_K blocks for an `[out, inp]` weight with small finite `d` and `dmin`.
pub fn q4k(out: usize, inp: usize, rng: &mut Rng) -> PackedQ8 {
    let mut raw: Vec<u8> = (0..out * inp / 256 * Q4K_BYTES).map(|_| rng.next() as u8).collect();
    for block in raw.chunks_exact_mut(Q4K_BYTES) {
        block[..4].copy_from_slice(&[0x1f, 0x20, 0x1f, 0x1c]); // f16 d ≈ 0.0088, dmin ≈ 0.0039
    }
    PackedQ8::from_ggml(Format::Q4_K, &raw, out, inp).expect("Q4_K sizes")
}
