#!/usr/bin/env bash
# Two single-thread CPU workers of different speed behind each --router policy, and one worker
# with both threads, on bursts of 8 and 48 requests (a 496-token shared prefix warmed in the
# caches first + 16 tokens of their own = 512 in, 128 out, all sent at once). Each server is
# fresh; configurations alternate within each repetition. Prints one line per run and a table
# of medians (completion time = the burst's duration; aggregate output tok/s). The one-worker
# baseline serves FAST with both threads (SLOW_BASELINE=1 adds SLOW with both threads).
# Usage: scripts/bench_router.sh FAST SLOW [REPS]   (docs/benchmarks.md, "Several workers and the router")
set -euo pipefail
fast=${1:?usage: scripts/bench_router.sh FAST_MODEL SLOW_MODEL [REPS]}
slow=${2:?usage: scripts/bench_router.sh FAST_MODEL SLOW_MODEL [REPS]}
reps=${3:-3}
flint=${FLINT:-target/release/flint}
port=${PORT:-8390}
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

pair=(--model "$slow" --kv-cache-memory 2G
      --worker "device=cpu,threads=1,model=$slow" --worker "device=cpu,threads=1,model=$fast")
declare -A configs=(
  [cost]="${pair[*]} --router cost"
  [least-load]="${pair[*]} --router least-load"
  [round-robin]="${pair[*]} --router round-robin"
  [one-fast-2t]="--model $fast --kv-cache-memory 2G --threads 2"
  [one-slow-2t]="--model $slow --kv-cache-memory 2G --threads 2"
)
order=(cost least-load round-robin one-fast-2t)
[ "${SLOW_BASELINE:-0}" = 1 ] && order+=(one-slow-2t)

for rep in $(seq "$reps"); do
  for name in "${order[@]}"; do
    # shellcheck disable=SC2086 # the config is a word list
    "$flint" serve --port "$port" --served-model-name m ${configs[$name]} >"$out/server.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
      kill -0 "$pid" 2>/dev/null || { cat "$out/server.log"; exit 1; }
      sleep 0.5
    done
    for burst in 8 48; do
      "$flint" bench serve --base-url "http://127.0.0.1:$port" --num-prompts "$burst" \
        --random-prefix-len 496 --random-input-len 16 --random-output-len 128 --warmup-requests 4 \
        --seed "$((rep * 100 + burst))" --save-result "$out/$name-$burst-$rep.json" >/dev/null
      python3 - "$out/$name-$burst-$rep.json" "$name" "$burst" "$rep" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
routed = ", ".join(f"{w}:{int(n)}" for w, n in r.get("requests_per_worker", {}).items())
print(f"{sys.argv[2]:<12} burst {sys.argv[3]:>2} rep {sys.argv[4]}: {r['duration']:7.2f} s  "
      f"{r['output_throughput']:7.1f} tok/s  failed {r['failed']}  {routed}")
PY
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done

python3 - "$out" "${order[@]}" <<'PY'
import glob, json, statistics, sys
d, order = sys.argv[1], sys.argv[2:]
print(f"\n{'config':<12} {'burst':>5} {'completion s (median)':>22} {'output tok/s (median)':>22}  runs")
for burst in (8, 48):
    for name in order:
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{d}/{name}-{burst}-*.json"))]
        dur = statistics.median(r["duration"] for r in runs)
        tps = statistics.median(r["output_throughput"] for r in runs)
        print(f"{name:<12} {burst:>5} {dur:>22.2f} {tps:>22.1f}  {' '.join('%.2f' % r['duration'] for r in runs)}")
PY
