#!/usr/bin/env bash
# AMX on real tiles, for a machine that has them but no Rust (such as the host CPU of a lent GPU
# machine): the CPU test binaries whose AMX paths then run on hardware, and prefill with the tiles
# against AVX-512 in the same run.
#
#   scripts/amx_check.sh build       # here: release flint, the test binaries and the matmul_cost
#                                    # example, stripped and xz-packed into target/amx-check/
#                                    # (~21 MB; carry that folder)
#   scripts/amx_check.sh run [DIR]   # there, from the repository root: writes DIR (default $OUT,
#                                    # else target/amx-check/out) with tests.log and perf.txt
#
# The run: flint-model's unit tests, golden, golden_families and the engine's batch_invariance
# with FLINT_CPU_ISA=amx (both kinds of tiles), the bf16 tile tests again with their output (which
# path ran), and the line `serve` logs about AMX with FLINT_CPU_ISA unset and =amx. Then, pinned to
# two CPUs (FLINT_AMX_CPUS; default 2,3, or 0,1 on fewer than 4), alternated in ROUNDS rounds
# (default 2): `matmul_cost --rows 512 --dtype bf16` (qwen2.5-0.5b's projections alone) with the
# default (AMX-BF16 tiles) against FLINT_CPU_ISA=avx512bf16 (what bf16 weights ran on before);
# `flint bench latency --threads 2` (pp512, tg16) on synthesized qwen2.5-0.5b q8_0 and q4_0 GGUFs
# with FLINT_CPU_ISA=amx (AMX-INT8, opt-in) against avx512bf16, and on bf16 qwen2.5-0.5b and
# qwen2.5-1.5b with the default against avx512bf16. On a Sapphire Rapids-class Xeon (2026-12-04)
# the tests took about 15 s and the 0.5b rows of the benchmark about 60 s.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
DIR="target/amx-check"
TESTS=(flint_model golden golden_families batch_invariance)
EXAMPLES=(matmul_cost)
log() { echo "[amx_check] $*" >&2; }

build() {
  set -e
  cargo build --release -p flint
  local out
  cargo build --release -p flint-model --example matmul_cost
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
  for t in "${EXAMPLES[@]}"; do strip -o "$DIR/$t" "target/release/examples/$t"; done
  for t in flint "${TESTS[@]}" "${EXAMPLES[@]}"; do xz -T0 -9 -f "$DIR/$t"; done
  git rev-parse HEAD >"$DIR/commit" 2>/dev/null || true
  du -sh "$DIR" >&2
  set +e
}

run() {
  # Unpacked outside the carried folder, which stays packed.
  local out="${1:-${OUT:-$DIR/out}}" work=/tmp/flint-amx-check bin=/tmp/flint-amx-check/bin cpus t
  cpus="${FLINT_AMX_CPUS:-$( (($(nproc) >= 4)) && echo 2,3 || echo 0,1)}"  # clear of CPU 0 where there is room
  mkdir -p "$out" "$work" "$bin"
  for t in flint "${TESTS[@]}" "${EXAMPLES[@]}"; do  # Python's lzma: the machine may have no xz
    [[ -x "$bin/$t" ]] || python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$DIR/$t.xz" "$bin/$t" && chmod +x "$bin/$t"
  done
  # The test binaries name their fixtures by this checkout's path at build time.
  local built_at
  built_at="$(strings "$bin/golden" 2>/dev/null | grep -m1 -o '/[^ ]*/crates/model' | sed 's#/crates/model##')"
  if [[ -n "$built_at" && ! -e "$built_at" ]]; then mkdir -p "$(dirname "$built_at")" && ln -s "$REPO_ROOT" "$built_at"; fi
  {
    grep -m1 "model name" /proc/cpuinfo
    grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E "amx|avx512_bf16|avx512_vnni" | tr '\n' ' '; echo
    echo "binaries built at commit $(cat "$DIR/commit" 2>/dev/null || echo unknown)"
  } >"$out/tests.log"
  # What became of AMX (permission asked, which tiles run): the line `serve` logs at start.
  local isa
  for isa in "" amx; do
    FLINT_CPU_ISA=$isa timeout 20 "$bin/flint" serve --model fixtures/golden/small-gguf/model-q8_0.gguf --port 18557 \
      >"$work/serve.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 40); do grep -q "CPU kernels" "$work/serve.log" && break; sleep 0.5; done
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    echo "FLINT_CPU_ISA=${isa:-(unset)}: $(grep -m1 -o "CPU kernels.*" "$work/serve.log")" >>"$out/tests.log"
  done
  for t in "${TESTS[@]}"; do
    local t0=$SECONDS
    FLINT_CPU_ISA=amx timeout 300 "$bin/$t" --test-threads=8 >>"$out/tests.log" 2>&1
    echo "== $t: exit $? in $((SECONDS - t0)) s" | tee -a "$out/tests.log" >&2
  done
  # Which path the bf16 tile tests took (they print it; the hardware comparisons skip without it).
  { timeout 120 "$bin/flint_model" amx_bf16 hardware --nocapture 2>&1
    timeout 120 "$bin/golden" tile --nocapture 2>&1
    timeout 120 "$bin/batch_invariance" tile --nocapture 2>&1; } | grep -E "via|did not run|test result|panicked" >>"$out/tests.log"
  local f="$bin/flint" m round
  [[ -e $work/bf16/config.json ]] || "$f" synth --shape qwen2.5-0.5b --out "$work/bf16" --dtype bf16 >>"$out/perf.log" 2>&1
  [[ -e $work/bf16-1.5b/config.json ]] || "$f" synth --shape qwen2.5-1.5b --out "$work/bf16-1.5b" --dtype bf16 >>"$out/perf.log" 2>&1
  [[ -e $work/q8/model-q8_0.gguf ]] || "$f" synth --shape qwen2.5-0.5b --out "$work/q8" --gguf q8_0 >>"$out/perf.log" 2>&1
  [[ -e $work/q4/model-q4_0.gguf ]] || "$f" synth --shape qwen2.5-0.5b --out "$work/q4" --gguf q4_0 >>"$out/perf.log" 2>&1
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for isa in default avx512bf16; do
      local cap=${isa/default/}
      echo "== r$round matmul_cost bf16 $isa" >>"$out/matmul.log"
      FLINT_CPU_ISA=$cap FLINT_THREADS=2 timeout 120 taskset -c "$cpus" "$bin/matmul_cost" --rows 512 --dtype bf16 --iters 10 \
        >>"$out/matmul.log" 2>&1
    done
    for m in "$work/q8/model-q8_0.gguf" "$work/q4/model-q4_0.gguf" "$work/bf16" "$work/bf16-1.5b"; do
      local isas=(default avx512bf16)
      [[ $m == *.gguf ]] && isas=(amx avx512bf16)
      for isa in "${isas[@]}"; do
        local cap=${isa/default/}
        FLINT_CPU_ISA=$cap timeout 180 taskset -c "$cpus" "$f" bench latency --model "$m" --threads 2 \
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
  grep -E "test result|^== |^FLINT_CPU_ISA|via|did not run" "$out/tests.log"
  grep -vE "^ *$" "$out/matmul.log"
  cat "$out/perf.txt"
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [OUT_DIR]" >&2; exit 2 ;;
esac
