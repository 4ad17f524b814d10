#!/usr/bin/env bash
# Long runs of the fuzz targets that `cargo test` runs briefly (crates/model/tests/fuzz_files.rs,
# crates/engine/tests/fuzz_chat_template.rs, crates/engine/tests/fuzz_constraints.rs): optimised,
# but with debug assertions and overflow checks on (they are what turn a silent wrap into a finding), in target/fuzz so ordinary builds
# are not invalidated.
#
# Usage: scripts/fuzz.sh [options] [target...]
#   targets:  gguf safetensors config chat tokenizer templates constraints  (default: all)
#   --cases N       cases per target per round (default 20000)
#   --seed S        first seed (default: random); round k uses S+k
#   --case C        rerun only case C (with --seed, as a failure message prints them)
#   --duration SEC  keep starting rounds with new seeds until SEC seconds have passed
#   --no-checks     plain release build (no debug assertions / overflow checks)
#
# A failure names the target, seed and case; rerun it with --seed S --case C.
set -euo pipefail
cd "$(dirname "$0")/.."

cases=20000
seed=""
case_only=""
duration=0
checks=1
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cases) cases="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --case) case_only="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --no-checks) checks=0; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -eq 0 ] && targets=(gguf safetensors config chat tokenizer templates constraints)
[ -z "$seed" ] && seed=$(( (RANDOM << 15 | RANDOM) ))

# target -> "package test-file test-name"
spec() {
  case "$1" in
    gguf) echo "flint-model fuzz_files fuzz_gguf" ;;
    safetensors) echo "flint-model fuzz_files fuzz_safetensors" ;;
    config) echo "flint-model fuzz_files fuzz_config_json" ;;
    chat) echo "flint-engine fuzz_chat_template fuzz_chat_render" ;;
    tokenizer) echo "flint-engine fuzz_chat_template fuzz_gguf_tokenizer_metadata" ;;
    templates) echo "flint-engine fuzz_chat_template hostile_templates_end_in_errors" ;;
    constraints) echo "flint-engine fuzz_constraints generated_constraints_compile_or_are_refused_never_crash" ;;
    *) echo "unknown target $1 (gguf safetensors config chat tokenizer templates constraints)" >&2; exit 2 ;;
  esac
}
for t in "${targets[@]}"; do spec "$t" >/dev/null; done

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/fuzz}"
if [ "$checks" = 1 ]; then
  export CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
fi

run_round() {
  local s="$1"
  for t in "${targets[@]}"; do
    read -r pkg file name <<<"$(spec "$t")"
    if [ -n "$case_only" ]; then echo "== $t: seed $s, case $case_only"; else echo "== $t: seed $s, $cases cases"; fi
    FLINT_FUZZ_SEED="$s" FLINT_FUZZ_CASES="$cases" ${case_only:+FLINT_FUZZ_CASE="$case_only"} \
      cargo test --release --locked -q -p "$pkg" --test "$file" -- --exact "$name" --nocapture
  done
}

start=$SECONDS
round=0
while :; do
  run_round $((seed + round))
  round=$((round + 1))
  [ -n "$case_only" ] && break
  [ $((SECONDS - start)) -ge "$duration" ] && break
done
echo "fuzz: $round round(s) from seed $seed passed in $((SECONDS - start)) s"
