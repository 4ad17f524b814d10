#!/usr/bin/env bash
# flint on an NVIDIA GPU, in one go: the golden tests on the device, a batch-invariance check,
# `flint bench latency` (pp512 / tg128) and a `flint bench serve` sweep on synthesized
# qwen2.5-1.5b and qwen2.5-7b (bf16 safetensors and Q4_K GGUF), figures written to one folder.
#
# Two halves, because a GPU machine often has no Rust toolchain and no network:
#   scripts/device_check.sh build        # on any x86-64 Linux, no GPU needed: builds, with
#                                        # --features cuda (toolkit from scripts/check_cuda_build.sh),
#                                        # the release `flint` and the device golden-test binary
#                                        # into target/device-check/ (copy or carry that folder)
#   scripts/device_check.sh run [DIR]    # on the GPU machine, from the repository root: runs every
#                                        # check and writes DIR (default target/device-check/out,
#                                        # or $OUT when set) with device-check.log and figures.json
# On a GPU machine with cargo, `scripts/device_check.sh all` does both.
#
# The run needs the NVIDIA driver (>= 580, CUDA 13.0) and the CUDA 13 libraries the binary links
# (libcublas, libcublasLt, libcurand, libnvrtc, libcudart): found in a CUDA 13 toolkit, or in the
# nvidia-* Python wheels (PyTorch cu130 installs them). Each stage has a time limit, the whole
# run took 111 s for qwen2.5-1.5b and 173 s for qwen2.5-7b on an H200 (one call each, with
# FLINT_CHECK_SHAPES; synthesizing the 7B Q4_K was 62 s of it); a stage that fails is logged and
# the next one runs.
# Environment knobs: FLINT_DEVICE (default cuda:0), FLINT_CHECK_SHAPES (default
# "qwen2.5-1.5b qwen2.5-7b"), FLINT_CHECK_WORK (scratch for synthesized models, default
# /tmp/flint-device-check: the 7B needs ~20 GB).
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
BIN_DIR="target/device-check"
log() { echo "[device_check] $*" >&2; }

build() {
  set -e
  eval "$(scripts/check_cuda_build.sh --print-env)"
  log "building release flint and the device golden tests with --features cuda (target: $CARGO_TARGET_DIR)"
  cargo build --release -p flint --features cuda
  local test_bin
  test_bin="$(cargo test --release -p flint-model --features cuda --test golden_device --no-run 2>&1 \
    | sed -n 's/.*Executable tests\/golden_device.rs (\(.*\))$/\1/p' | tail -n1)"
  [[ -x "$test_bin" ]] || { log "could not find the golden_device test binary"; exit 1; }
  # Stripped and xz-compressed (candle's PTX makes flint ~66 MB; ~20 MB for both compressed), so
  # the folder travels to a GPU machine whole.
  rm -rf "$BIN_DIR" && mkdir -p "$BIN_DIR"
  local b
  for b in flint golden_device; do
    local src="$CARGO_TARGET_DIR/release/flint"
    [[ $b == golden_device ]] && src="$test_bin"
    strip -o "$BIN_DIR/$b" "$src"
    xz -T0 -6 "$BIN_DIR/$b"
  done
  git rev-parse HEAD >"$BIN_DIR/commit" 2>/dev/null || true
  du -sh "$BIN_DIR"/*.xz >&2
  log "built: $BIN_DIR/{flint,golden_device}.xz (run: scripts/device_check.sh run)"
  set +e
}

# The binaries, unpacked (Python's lzma: the GPU machine may have no xz).
unpack() {
  local b
  for b in flint golden_device; do
    if [[ ! -x "$BIN_DIR/$b" && -f "$BIN_DIR/$b.xz" ]]; then
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$BIN_DIR/$b.xz" "$BIN_DIR/$b" && chmod +x "$BIN_DIR/$b"
    fi
  done
}

# The directory holding libcublas.so.13: a toolkit's, or the nvidia wheels' of a Python install.
cuda_lib_dir() {
  local d
  for d in "${CUDA_HOME:-/nonexistent}/lib64" /usr/local/cuda/lib64; do
    [[ -e "$d/libcublas.so.13" ]] && { echo "$d"; return; }
  done
  d="$(python3 - <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for r in roots:
    for hit in glob.glob(os.path.join(r, "nvidia", "*", "lib", "libcublas.so.13")):
        print(os.path.dirname(hit)); raise SystemExit
EOF
)"
  [[ -n "$d" ]] && { echo "$d"; return; }
  find / -name 'libcublas.so.13' -not -path '*/proc/*' 2>/dev/null | head -n1 | xargs -r dirname
}

# stage NAME SECONDS CMD...: run with a time limit, log its output and how it ended.
stage() {
  local name="$1" limit="$2"
  shift 2
  log "stage $name (limit ${limit}s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "== stage $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOG" >&2
  STAGES+=("{\"stage\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0))}")
  return $rc
}

serve_sweep() {  # MODEL TAG
  local model="$1" tag="$2" port=18431 pid ok=0
  timeout 300 "$BIN_DIR/flint" serve --device "$DEVICE" --model "$model" --port "$port" --max-num-seqs 64 \
    --max-num-batched-tokens 2048 >>"$LOG" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null \
      && { ok=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if [[ $ok == 1 ]]; then
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/version').read().decode())" >>"$LOG"
    for c in 1 8 32; do
      timeout 120 "$BIN_DIR/flint" bench serve --base-url "http://127.0.0.1:$port" --num-prompts $((c * 4)) \
        --random-input-len 512 --random-output-len 128 --max-concurrency "$c" \
        --save-result "$WORK/serve-$tag-c$c.json" >>"$LOG" 2>&1 || echo "bench serve c=$c failed" >>"$LOG"
    done
  else
    echo "server for $tag did not become healthy" >>"$LOG"
  fi
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  [[ $ok == 1 ]]
}

run() {
  OUT_DIR="${1:-${OUT:-$BIN_DIR/out}}"
  DEVICE="${FLINT_DEVICE:-cuda:0}"
  WORK="${FLINT_CHECK_WORK:-/tmp/flint-device-check}"
  SHAPES="${FLINT_CHECK_SHAPES:-qwen2.5-1.5b qwen2.5-7b}"
  mkdir -p "$OUT_DIR" "$WORK"
  LOG="$OUT_DIR/device-check.log"
  : >"$LOG"
  STAGES=()
  unpack
  [[ -x "$BIN_DIR/flint" && -x "$BIN_DIR/golden_device" ]] || { log "no binaries in $BIN_DIR: run '$0 build' first"; exit 1; }
  local libs
  libs="$(cuda_lib_dir)"
  [[ -n "$libs" ]] || { log "no libcublas.so.13 on this machine (a CUDA 13 toolkit or the nvidia-cublas wheel)"; exit 1; }
  export LD_LIBRARY_PATH="$libs:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  {
    date -u
    echo "binaries built at commit $(cat "$BIN_DIR/commit" 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    echo "CUDA libraries: $libs"
    ldd "$BIN_DIR/flint" | grep -E 'cuda|cublas|curand|nvrtc|not found'
  } >>"$LOG" 2>&1

  # 1. Golden tests on the device (f32, bf16, f16; GGUF q8_0/q4_0; chunked batches; batch invariance).
  FLINT_TEST_DEVICE="$DEVICE" FLINT_FIXTURES="$REPO_ROOT/fixtures/golden" stage golden 180 "$BIN_DIR/golden_device" --test-threads=1 --nocapture

  # 2. Per shape: bf16 safetensors and Q4_K GGUF, synthesized here (no hub); latency, then a sweep.
  for shape in $SHAPES; do
    # `synth --gguf q4_k --out DIR` writes DIR/model-q4_k.gguf.
    local st="$WORK/$shape-bf16" gg="$WORK/$shape-q4_k/model-q4_k.gguf"
    [[ -e "$st/config.json" ]] || stage "synth-$shape-bf16" 300 "$BIN_DIR/flint" synth --shape "$shape" --out "$st" --dtype bf16
    [[ -e "$gg" ]] || stage "synth-$shape-q4_k" 300 "$BIN_DIR/flint" synth --shape "$shape" --out "${gg%/*}" --gguf q4_k
    for m in "$st:bf16" "$gg:q4_k"; do
      local path="${m%:*}" tag="$shape-${m##*:}"
      [[ -e "$path" ]] || continue
      stage "latency-$tag" 240 "$BIN_DIR/flint" bench latency --device "$DEVICE" --model "$path" \
        --prompt-len 512 --gen-len 128 --reps 3 --json "$WORK/latency-$tag.json"
    done
    if [[ -e "$st/config.json" ]]; then
      local t0=$SECONDS rc=0
      log "stage serve-$shape-bf16: flint serve + bench serve at concurrency 1, 8, 32"
      serve_sweep "$st" "$shape-bf16" || rc=1
      echo "== stage serve-$shape-bf16: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOG" >&2
      STAGES+=("{\"stage\": \"serve-$shape-bf16\", \"exit\": $rc, \"seconds\": $((SECONDS - t0))}")
    fi
  done

  # 3. Everything measured, in one file.
  python3 - "$WORK" "$OUT_DIR/figures.json" "${STAGES[@]}" <<'EOF'
import glob, json, os, sys
work, out, stages = sys.argv[1], sys.argv[2], [json.loads(s) for s in sys.argv[3:]]
figs = {"stages": stages}
for f in sorted(glob.glob(os.path.join(work, "*.json"))):
    try:
        figs[os.path.basename(f)[:-5]] = json.load(open(f))
    except Exception as e:  # a half-written file: say so
        figs[os.path.basename(f)[:-5]] = {"error": str(e)}
json.dump(figs, open(out, "w"), indent=1)
print(f"wrote {out}")
EOF
  log "log: $LOG; figures: $OUT_DIR/figures.json"
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  all) shift; build && run "$@" ;;
  # docs/benchmarks-cuda.md from the folders of one or more `run` calls (fetched back here).
  report) shift; python3 scripts/cuda_report.py "$@" >docs/benchmarks-cuda.md && log "wrote docs/benchmarks-cuda.md" ;;
  *) echo "usage: $0 build | run [OUT_DIR] | all [OUT_DIR] | report OUT_DIR..." >&2; exit 2 ;;
esac
