//! What the cost examples share: their argument reading, their random numbers, their Q4_K
//! weights and their medians. (A folder module, so cargo does not take it for an example of its
//! own.) Each example uses only some of it.
#![allow(dead_code)]

use flint_model::kernels::matmul_q8::{Format, PackedQ8};

/// Q4_K: 144 bytes per 256 values.
pub const Q4K_BYTES: usize = 144;

/// The value after `name` on the command line, else `default`.
pub fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_string())
}

/// The median of `v` (the upper one of an even count), as every example reports its timings.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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

    /// `n` activations in [-1, 1), in steps of 0.001.
    pub fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (self.next() % 2000) as f32 / 1000.0 - 1.0).collect()
    }
}

/// Random Q4_K blocks for an `[out, inp]` weight with small finite `d` and `dmin`.
pub fn q4k(out: usize, inp: usize, rng: &mut Rng) -> PackedQ8 {
    weights(Format::Q4_K, out, inp, rng)
}

/// A GGUF block of `format`: (its bytes, its values, where its f16 scales are).
fn block(format: Format) -> (usize, usize, &'static [usize]) {
    match format {
        Format::Q8_0 => (34, 32, &[0]),
        Format::Q4_0 => (18, 32, &[0]),
        Format::Q4_K => (Q4K_BYTES, 256, &[0, 2]),
        Format::Q6_K => (210, 256, &[208]),
    }
}

/// The bytes of an `[out, inp]` weight in `format`, as the GGUF file holds it.
pub fn ggml_bytes(format: Format, out: usize, inp: usize) -> usize {
    let (bytes, values, _) = block(format);
    out * inp / values * bytes
}

/// Random blocks of `format` for an `[out, inp]` weight, their f16 scales small and finite.
pub fn weights(format: Format, out: usize, inp: usize, rng: &mut Rng) -> PackedQ8 {
    let (bytes, values, scales) = block(format);
    let mut raw: Vec<u8> = (0..out * inp / values * bytes).map(|_| rng.next() as u8).collect();
    for block in raw.chunks_exact_mut(bytes) {
        for &at in scales {
            block[at..at + 2].copy_from_slice(&[0x1f, 0x20]); // f16 ≈ 0.0088
        }
    }
    PackedQ8::from_ggml(format, &raw, out, inp).expect("block sizes")
}

/// A format by its GGUF name (`q8_0`, `q4_0`, `q4_k`, `q6_k`).
pub fn format(name: &str) -> Format {
    match name.to_ascii_lowercase().as_str() {
        "q8_0" => Format::Q8_0,
        "q4_0" => Format::Q4_0,
        "q4_k" => Format::Q4_K,
        "q6_k" => Format::Q6_K,
        other => panic!("--format: q8_0, q4_0, q4_k or q6_k, not {other}"),
    }
}
