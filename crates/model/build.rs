//! With the `cuda` feature, compiles the device KV pool's kernels
//! (`src/device_cache/paged_attention.cu`) to PTX with `nvcc`, for `include_str!`; the driver
//! compiles the PTX for the GPU it runs on. Without the feature, nothing runs.
//!
//! `NVCC` (else `nvcc` on the PATH) is the compiler; `CUDA_COMPUTE_CAP` (as candle's kernels use
//! it, e.g. `90`) the oldest architecture the PTX targets, default 75 (Turing: a T4).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let src = "src/device_cache/paged_attention.cu";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("paged_attention.ptx");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "75".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let status = Command::new(&nvcc)
        .args(["-std=c++17", "--ptx", "-O3", &format!("-arch=compute_{cap}"), "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .unwrap_or_else(|e| {
            panic!("flint-model (cuda feature): cannot run {nvcc}: {e}; set NVCC or put nvcc on the PATH")
        });
    assert!(status.success(), "flint-model (cuda feature): {nvcc} failed on {src}");
}
