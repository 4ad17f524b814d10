#!/usr/bin/env bash
# Build `flint --features cuda` on a machine with no GPU and no system CUDA toolkit.
#
# The CUDA toolkit comes from NVIDIA's PyPI wheels, installed once into a cache under target/.
# Only the CUDA 13 wheels ship a full compiler (nvcc + cicc + cudafe++ + crt headers, all under
# one nvidia/cu13/ prefix); the nvidia-cuda-nvcc-cu12 wheels hold ptxas alone. The set below is
# CUDA 13.0 Update 2, exactly as the `cuda-toolkit==13.0.2` meta-package pins it; cudarc 0.19.10
# (what candle-core 0.11.1 pulls) knows CUDA 13.0 and reads that version from `nvcc --version`.
#
# candle-core turns on cudarc's `dynamic-linking`, so the final link needs libcuda, libnvrtc,
# libcurand, libcublas, libcublasLt (and libcudart, for candle-kernels' static MoE/MMQ library).
# No wheel ships the driver library, so a link-only stub libcuda.so (soname libcuda.so.1; one empty
# function per driver symbol cudarc declares) is generated here. The real driver replaces it at
# run time.
#
# Usage (from anywhere; paths are relative to the repository root):
#   scripts/check_cuda_build.sh               # set up the toolkit (if needed) and build
#   scripts/check_cuda_build.sh --release     # extra args go to `cargo build`
#   scripts/check_cuda_build.sh --setup-only  # set up the toolkit and smoke-test nvcc; no cargo
#   eval "$(scripts/check_cuda_build.sh --print-env)"   # set up, then export the env in your shell
# Environment knobs:
#   CUDA_COMPUTE_CAP   GPU arch for the kernels (default 90: H100/H200, built as sm_90a)
#   FLINT_CUDA_CACHE   toolkit cache dir      (default target/cuda-toolkit/13.0.2)
#   FLINT_CUDA_TARGET  cargo target dir       (default target/cuda, so the CPU build is untouched)
#   CUDAFORGE_THREADS  parallel nvcc jobs in candle-kernels' build script (default: CPU count)
#   PYTHON             python with pip        (default python3)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

CUDA_SET="13.0.2"
WHEELS=(
  nvidia-cuda-nvcc==13.0.88     # nvcc, ptxas, fatbinary, nvlink, cudafe++
  nvidia-nvvm==13.0.88          # nvvm/bin/cicc, libdevice
  nvidia-cuda-crt==13.0.88      # include/crt (host_config.h ...)
  nvidia-cuda-runtime==13.0.96  # cuda_runtime.h, cuda.h, cuda_fp16/bf16/fp8.h, libcudart
  nvidia-cuda-cccl==13.0.85     # include/cccl: cub, thrust, libcu++
  nvidia-cuda-nvrtc==13.0.88    # libnvrtc
  nvidia-curand==10.4.0.35      # libcurand
  nvidia-cublas==13.1.0.3       # libcublas, libcublasLt
)
CUDARC_VERSION_NUM="13000"      # what cudarc derives from `nvcc --version` for this set

PYTHON="${PYTHON:-python3}"
CACHE="${FLINT_CUDA_CACHE:-$REPO_ROOT/target/cuda-toolkit/$CUDA_SET}"
case "$CACHE" in /*) ;; *) CACHE="$REPO_ROOT/$CACHE" ;; esac
ROOT="$CACHE/nvidia/cu13"
TARGET_DIR="${FLINT_CUDA_TARGET:-$REPO_ROOT/target/cuda}"
case "$TARGET_DIR" in /*) ;; *) TARGET_DIR="$REPO_ROOT/$TARGET_DIR" ;; esac

MODE=build
case "${1:-}" in
  --setup-only) MODE=setup; shift ;;
  --print-env) MODE=env; shift ;;
esac

log() { echo "[check_cuda_build] $*" >&2; }

# --- 1. toolkit wheels -----------------------------------------------------------------------
STAMP="$CACHE/.wheels"
WANT="$(printf '%s\n' "${WHEELS[@]}")"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$ROOT/bin/nvcc" ]]; then
  log "CUDA $CUDA_SET wheels already in $CACHE"
else
  log "installing CUDA $CUDA_SET wheels into $CACHE (~1.2 GiB unpacked)"
  rm -rf "$CACHE" "$CACHE.partial"
  mkdir -p "$(dirname "$CACHE")"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --target "$CACHE.partial" "${WHEELS[@]}"
  mv "$CACHE.partial" "$CACHE"
  printf '%s\n' "$WANT" > "$STAMP"
fi

# --- 2. link-time layout: unversioned .so names, lib64 alias, stub libcuda ------------------
link() { [[ -e "$ROOT/lib/$2" ]] || { log "missing $ROOT/lib/$2"; exit 1; }; ln -sfn "$2" "$ROOT/lib/$1"; }
link libcudart.so   libcudart.so.13
link libnvrtc.so    libnvrtc.so.13
link libcurand.so   libcurand.so.10
link libcublas.so   libcublas.so.13
link libcublasLt.so libcublasLt.so.13
[[ -e "$ROOT/lib64" ]] || ln -sfn lib "$ROOT/lib64"

STUB="$ROOT/lib/stubs/libcuda.so"
cudarc_ver="$(awk '/^name = "cudarc"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)"
[[ -n "$cudarc_ver" ]] || { log "cudarc not found in Cargo.lock"; exit 1; }
if [[ ! -f "$STUB" || "$(cat "$STUB.cudarc" 2>/dev/null)" != "$cudarc_ver" ]]; then
  cargo_home="${CARGO_HOME:-$HOME/.cargo}"
  find_sys() { ls -d "$cargo_home"/registry/src/*/"cudarc-$cudarc_ver"/src/driver/sys/mod.rs 2>/dev/null | head -n1; }
  sys_rs="$(find_sys || true)"
  if [[ -z "$sys_rs" ]]; then
    log "fetching crate sources (cargo fetch) to read cudarc $cudarc_ver's driver symbols"
    cargo fetch --locked >&2
    sys_rs="$(find_sys || true)"
  fi
  [[ -n "$sys_rs" ]] || { log "cudarc-$cudarc_ver sources not found under $cargo_home/registry/src"; exit 1; }
  mkdir -p "$ROOT/lib/stubs"
  tmp_c="$(mktemp --suffix=.c)"
  grep -oE '^[[:space:]]+fn cu[A-Za-z0-9_]+\(' "$sys_rs" | grep -oE 'cu[A-Za-z0-9_]+' | sort -u \
    | awk '{ print "void " $1 "(void) {}" }' > "$tmp_c"
  log "generating link-only stub $STUB ($(wc -l < "$tmp_c") driver symbols from cudarc $cudarc_ver)"
  "${CC:-cc}" -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$STUB" "$tmp_c"
  rm -f "$tmp_c"
  echo "$cudarc_ver" > "$STUB.cudarc"
fi

# --- 3. environment ----------------------------------------------------------------------------
export CUDA_HOME="$ROOT" CUDA_PATH="$ROOT" CUDA_ROOT="$ROOT" CUDA_TOOLKIT_ROOT_DIR="$ROOT"
export PATH="$ROOT/bin:$PATH"             # cudarc runs plain `nvcc --version` from PATH
export NVCC="$ROOT/bin/nvcc"              # cudaforge (candle-kernels' build helper) looks here first
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"   # no nvidia-smi here: cudaforge needs it set
export LD_LIBRARY_PATH="$ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CARGO_TARGET_DIR="$TARGET_DIR"

# --- 4. smoke test: nvcc finds cicc, ptxas, crt + runtime + cccl headers, and the host gcc --------
nvcc_release="$(nvcc --version | sed -n 4p)"
case "$nvcc_release" in
  *"release 13.0,"*) ;;
  *) log "unexpected nvcc: $nvcc_release"; exit 1 ;;
esac
smoke="$(mktemp -d)"
trap 'rm -rf "$smoke"' EXIT
cat > "$smoke/k.cu" <<'EOF'
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/limits>
extern "C" __global__ void axpy(float a, const __half *x, __nv_bfloat16 *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(a * __half2float(x[i]) + __bfloat162float(y[i]));
}
EOF
nvcc -std=c++17 --ptx -o "$smoke/k.ptx" "$smoke/k.cu"
nvcc -std=c++17 -c -Xcompiler -fPIC -o "$smoke/k.o" "$smoke/k.cu"

if [[ "$MODE" == env ]]; then
  for v in CUDA_HOME CUDA_PATH CUDA_ROOT CUDA_TOOLKIT_ROOT_DIR PATH NVCC CUDA_COMPUTE_CAP LD_LIBRARY_PATH CARGO_TARGET_DIR; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
  exit 0
fi

log "toolkit:          $ROOT ($nvcc_release)"
log "CUDA_COMPUTE_CAP: $CUDA_COMPUTE_CAP   cudarc CUDA version: $CUDARC_VERSION_NUM"
log "CUDA_HOME=CUDA_PATH=CUDA_ROOT=CUDA_TOOLKIT_ROOT_DIR=$ROOT"
log "NVCC=$NVCC   CARGO_TARGET_DIR=$CARGO_TARGET_DIR"
log "nvcc smoke test (ptx + object) passed"
[[ "$MODE" == setup ]] && exit 0

# --- 5. the build ------------------------------------------------------------------------------
log "cargo build -p flint --features cuda $*"
cargo build -p flint --features cuda "$@"
bin_dir="$CARGO_TARGET_DIR/debug"
for a in "$@"; do [[ "$a" == --release ]] && bin_dir="$CARGO_TARGET_DIR/release"; done
log "built $bin_dir/flint"
log "to run it on a GPU host: LD_LIBRARY_PATH=$ROOT/lib $bin_dir/flint ... (needs an NVIDIA driver >= 580, CUDA 13.0)"
