#!/usr/bin/env bash
# AMX on real tiles, for a machine that has them but no Rust (such as the host CPU of a lent GPU
# machine): the CPU test binaries whose AMX paths then run on hardware, and pp512 with the tiles
# against AVX-512 VNNI in the same run.
#
#   scripts/amx_check.sh build       # here: release flint and the test binaries, stripped and
#                                    # xz-packed into target/amx-check/ (~20 MB; carry that folder)
#   scripts/amx_check.sh run [DIR]   # there, from the repository root: writes DIR (default $OUT,
#                                    # else target/amx-check/out) with tests.log and perf.txt
#
# The run: flint-model's unit tests, golden, golden_families and the engine's batch_invariance
# with FLINT_CPU_ISA=amx (AMX is opt-in), and the line `serve` logs about AMX; then synthesized
# qwen2.5-0.5b (q8_0 and q4_0 GGUFs, bf16 safetensors) through `flint bench latency --threads 2`
# pinned to two CPUs (FLINT_AMX_CPUS; default 2,3, or 0,1 on fewer than 4), FLINT_CPU_ISA=amx and
# avx512bf16 alternated in ROUNDS rounds (default 2). On a Sapphire Rapids-class Xeon (2026-12-04)
# the tests took about 15 s and the benchmark 272 s.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
DIR="target/amx-check"
TESTS=(flint_model golden golden_families batch_invariance)
log() { echo "[amx_check] $*" >&2; }

build() {
  set -e
  cargo build --release -p flint
  local out
  out="$(cargo test --release -p flint-model --lib --test golden --test golden_families --no-run 2>&1;
         cargo test --release -p flint-engine --test batch_invariance --no-run 2>&1)"
  rm -rf "$DIR" && mkdir -p "$DIR"
  strip -o "$DIR/flint" target/release/flint
  local t bin
  for t in "${TESTS[@]}"; do
    if [[ $t == flint_model ]]; then
      bin="$(sed -n 's/.*Executable unittests src\/lib.rs (\(.*flint_model-[0-9a-f]*\))$/\1/p' <<<"$out" | tail -n1)"
    else
      bin="$(sed -n "s/.*Executable tests\/$t.rs (\(.*\))\$/\1/p" <<<"$out" | tail -n1)"
    fi
    [[ -x "$bin" ]] || { log "no test binary for $t"; exit 1; }
    strip -o "$DIR/$t" "$bin"
  done
  for t in flint "${TESTS[@]}"; do xz -T0 -9 -f "$DIR/$t"; done
  git rev-parse HEAD >"$DIR/commit" 2>/dev/null || true
  du -sh "$DIR" >&2
  set +e
}

run() {
  local out="${1:-${OUT:-$DIR/out}}" work=/tmp/flint-amx-check cpus t
  cpus="${FLINT_AMX_CPUS:-$( (($(nproc) >= 4)) && echo 2,3 || echo 0,1)}"  # clear of CPU 0 where there is room
  mkdir -p "$out" "$work"
  for t in flint "${TESTS[@]}"; do  # Python's lzma: the machine may have no xz
    [[ -x "$DIR/$t" ]] || python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$DIR/$t.xz" "$DIR/$t" && chmod +x "$DIR/$t"
  done
  # The test binaries name their fixtures by this checkout's path at build time.
  local built_at
  built_at="$(strings "$DIR/golden" 2>/dev/null | grep -m1 -o '/[^ ]*/crates/model' | sed 's#/crates/model##')"
  if [[ -n "$built_at" && ! -e "$built_at" ]]; then mkdir -p "$(dirname "$built_at")" && ln -s "$REPO_ROOT" "$built_at"; fi
  {
    grep -m1 "model name" /proc/cpuinfo
    grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E "amx|avx512_bf16|avx512_vnni" | tr '\n' ' '; echo
    echo "binaries built at commit $(cat "$DIR/commit" 2>/dev/null || echo unknown)"
  } >"$out/tests.log"
  # What became of AMX (permission asked, tiles in use): the line `serve` logs at start.
  FLINT_CPU_ISA=amx timeout 20 "$DIR/flint" serve --model fixtures/golden/small-gguf/model-q8_0.gguf --port 18557 \
    >"$work/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 40); do grep -q "CPU kernels" "$work/serve.log" && break; sleep 0.5; done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  grep -m1 -o "CPU kernels.*" "$work/serve.log" >>"$out/tests.log"
  for t in "${TESTS[@]}"; do
    local t0=$SECONDS
    FLINT_CPU_ISA=amx timeout 300 "$DIR/$t" --test-threads=8 >>"$out/tests.log" 2>&1
    echo "== $t: exit $? in $((SECONDS - t0)) s" | tee -a "$out/tests.log" >&2
  done
  local f="$DIR/flint" m isa round
  [[ -e $work/bf16/config.json ]] || "$f" synth --shape qwen2.5-0.5b --out "$work/bf16" --dtype bf16 >>"$out/perf.log" 2>&1
  [[ -e $work/q8/model-q8_0.gguf ]] || "$f" synth --shape qwen2.5-0.5b --out "$work/q8" --gguf q8_0 >>"$out/perf.log" 2>&1
  [[ -e $work/q4/model-q4_0.gguf ]] || "$f" synth --shape qwen2.5-0.5b --out "$work/q4" --gguf q4_0 >>"$out/perf.log" 2>&1
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for m in "$work/q8/model-q8_0.gguf" "$work/q4/model-q4_0.gguf" "$work/bf16"; do
      for isa in amx avx512bf16; do
        FLINT_CPU_ISA=$isa timeout 120 taskset -c "$cpus" "$f" bench latency --model "$m" --threads 2 \
          --prompt-len 512 --gen-len 16 --reps 2 --json "$work/r$round-$(basename "$m")-$isa.json" >>"$out/perf.log" 2>&1
        local rc=$?
        echo "== r$round $(basename "$m") $isa on CPUs $cpus: exit $rc" >>"$out/perf.log"
      done
    done
  done
  python3 - "$work" >"$out/perf.txt" <<'EOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "r*.json"))):
    v = json.load(open(f))
    print(f"{os.path.basename(f)[:-5]:40s} pp512 {v['pp']['mean']:8.1f} ± {v['pp']['sd']:6.1f}   tg16 {v['tg']['mean']:7.1f}")
EOF
  grep -E "test result|^== " "$out/tests.log"
  cat "$out/perf.txt"
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [OUT_DIR]" >&2; exit 2 ;;
esac
