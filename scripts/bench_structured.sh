#!/usr/bin/env bash
# Constrained vs unconstrained decoding, alternated: `flint bench throughput` at 1 and 16
# parallel sequences, plain and with every request held to a JSON schema that cannot finish
# within --output-len (an array of at least 100 objects), so both make the same token count.
# Usage: scripts/bench_structured.sh MODEL.gguf [REPS]   (docs/benchmarks.md, "Structured outputs")
set -euo pipefail
model=${1:?usage: scripts/bench_structured.sh MODEL [REPS]}
reps=${2:-5}
flint=${FLINT:-target/release/flint}
schema='{"json":{"type":"array","minItems":100,"items":{"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer","minimum":0,"maximum":120},"email":{"type":"string","format":"email"},"role":{"enum":["admin","user","guest"]},"tags":{"type":"array","items":{"type":"string","maxLength":8},"maxItems":3}},"required":["name","age","email","role","tags"]}}}'
for c in 1 16; do
  for rep in $(seq "$reps"); do
    for mode in plain json; do
      extra=()
      [ "$mode" = json ] && extra=(--structured-output "$schema")
      echo "== c=$c rep=$rep mode=$mode"
      "$flint" bench throughput --model "$model" --num-prompts "$c" --max-num-seqs "$c" \
        --input-len 32 --output-len 128 "${extra[@]}" 2>/dev/null
    done
  done
done
