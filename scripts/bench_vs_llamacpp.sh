#!/usr/bin/env bash
# flint against llama.cpp on the same CPU and the same weights, back to back in one run, written
# to docs/benchmarks.md as a side-by-side table with ratios, the exact commands and raw outputs.
#
#   scripts/bench_vs_llamacpp.sh            # REPS=3 THREADS=2 SHAPE=qwen2.5-0.5b TYPES="f32 bf16 q8_0 q4_0"
#
# llama.cpp is built once from the llama-cpp-python 0.3.36 sdist (which vendors it), cached under
# $WORK (default target/llamacpp): cmake and ninja come from a venv there, nothing system-wide.
# The GGUF files are synthesized with `flint synth` (random weights, exact Qwen2.5 shapes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${WORK:-$ROOT/target/llamacpp}
REPS=${REPS:-3}
THREADS=${THREADS:-2}
SHAPE=${SHAPE:-qwen2.5-0.5b}
TYPES=${TYPES:-"f32 bf16 q8_0 q4_0"}
PARALLEL=${PARALLEL:-16}
OUT=${OUT:-$ROOT/docs/benchmarks.md}
mkdir -p "$WORK/models" "$WORK/raw"
B=$WORK/build/bin

if [ ! -x "$B/llama-bench" ] || [ ! -x "$B/llama-batched-bench" ]; then
  echo "== building llama.cpp (llama-cpp-python 0.3.36 sdist) into $WORK" >&2
  python3 -m venv "$WORK/tools"
  "$WORK/tools/bin/pip" install --quiet --disable-pip-version-check cmake ninja
  # Restrict --no-binary to the one package: building cmake/ninja from source takes forever.
  "$WORK/tools/bin/pip" download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$WORK/dl"
  rm -rf "$WORK/src" && mkdir -p "$WORK/src"
  tar xzf "$WORK/dl/llama_cpp_python-0.3.36.tar.gz" -C "$WORK/src" --strip-components=1
  rm -f "$WORK/src/vendor/llama.cpp/.git"   # a gitlink file that breaks the build's git probing
  PATH=$WORK/tools/bin:$PATH cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON >"$WORK/raw/cmake-configure.log"
  PATH=$WORK/tools/bin:$PATH cmake --build "$WORK/build" -j"$THREADS" --target llama-bench llama-batched-bench \
    >"$WORK/raw/cmake-build.log"
fi

echo "== building flint (release)" >&2
cargo build --release --locked -p flint >&2
F=$ROOT/target/release/flint

for t in $TYPES; do
  m=$WORK/models/$SHAPE-$t
  if [ ! -f "$m/model-$t.gguf" ]; then
    rm -rf "$m"
    "$F" synth --shape "$SHAPE" --gguf "$t" --out "$m" >&2
  fi
done

# Runs one command, keeps its output under raw/, and records the exact command line.
CMDS=()
run() {
  local name=$1; shift
  CMDS+=("$*")
  echo "== $name: $*" >&2
  "$@" >"$WORK/raw/$name.txt" 2>"$WORK/raw/$name.err"
}

for t in $TYPES; do
  g=$WORK/models/$SHAPE-$t/model-$t.gguf
  run "llama-bench-$t" "$B/llama-bench" -m "$g" -t "$THREADS" -p 512 -n 128 -r "$REPS" -o json
  run "flint-latency-$t" "$F" bench latency --model "$g" --prompt-len 512 --gen-len 128 --reps "$REPS" \
    --json "$WORK/raw/flint-latency-$t.json"
done
# The ceiling for decode: this machine's memory bandwidth, measured in the same run, with 4 KiB
# pages and with the huge pages flint's weights use (scripts/membw.c; skipped without a C
# compiler with OpenMP). The weights' bytes per token come from `flint inspect`.
rm -f "$WORK/raw/membw.txt"
if cc -O3 -march=native -fopenmp -o "$WORK/membw" scripts/membw.c 2>"$WORK/raw/membw-build.log"; then
  run "membw" env OMP_NUM_THREADS="$THREADS" "$WORK/membw"
fi
for t in $TYPES; do
  run "flint-inspect-$t" "$F" inspect --model "$WORK/models/$SHAPE-$t/model-$t.gguf"
done
for t in q8_0 q4_0 q4_k q6_k; do
  case " $TYPES " in *" $t "*) ;; *) continue ;; esac
  g=$WORK/models/$SHAPE-$t/model-$t.gguf
  run "llama-batched-$t" "$B/llama-batched-bench" -m "$g" -t "$THREADS" -c 8192 -b 2048 -ub 512 \
    -npp 128 -ntg 128 -npl "$PARALLEL" --output-format jsonl
  run "flint-parallel-$t" "$F" bench throughput --model "$g" --num-prompts "$PARALLEL" --input-len 128 \
    --output-len 128 --max-num-seqs "$PARALLEL"
done

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
python3 - "$WORK" "$OUT" "$SHAPE" "$THREADS" "$REPS" "$PARALLEL" "$TYPES" "$COMMIT" "${CMDS[@]}" <<'PY'
import json, re, sys, datetime, platform, os
work, out, shape, threads, reps, par, types, commit = sys.argv[1:9]
cmds = sys.argv[9:]
raw = os.path.join(work, "raw")
def read(name):
    p = os.path.join(raw, name)
    return open(p).read() if os.path.exists(p) else ""
def llama_tps(t, kind):
    for r in json.loads(read(f"llama-bench-{t}.txt") or "[]"):
        if kind == "pp" and r.get("n_prompt") == 512 and r.get("n_gen") == 0:
            return r["avg_ts"], r["stddev_ts"]
        if kind == "tg" and r.get("n_gen") == 128 and r.get("n_prompt") == 0:
            return r["avg_ts"], r["stddev_ts"]
    return None
def flint_tps(t, kind):
    p = os.path.join(raw, f"flint-latency-{t}.json")
    if not os.path.exists(p):
        return None
    v = json.load(open(p))[kind]
    return v["mean"], v["sd"]
def fmt(x):
    return "–" if x is None else f"{x[0]:.2f} ± {x[1]:.2f}"
def ratio(a, b):
    return "–" if a is None or b is None or b[0] == 0 else f"{a[0] / b[0]:.2f}"
cpu = ""
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except Exception:
    pass
lines = [
    "# flint vs llama.cpp, side by side",
    "",
    f"Generated by `scripts/bench_vs_llamacpp.sh` on {datetime.date.today()} ({cpu or platform.machine()}, "
    f"{threads} threads). Model: random weights with the exact shapes of {shape}, synthesized by "
    "`flint synth --gguf TYPE`; the same GGUF file is given to both. llama.cpp: the copy vendored in the "
    "llama-cpp-python 0.3.36 sdist, built with `GGML_NATIVE=ON`. flint: commit " + commit + ", release build. "
    "Ratio = flint / llama.cpp (≥ 1.00: flint ahead). The machine is shared and noisy; both ran back to "
    "back in this one run.",
    "",
    f"## Single stream (tokens/s, mean ± sd over {reps} repetitions)",
    "",
    "| type | llama.cpp pp512 | flint pp512 | ratio | llama.cpp tg128 | flint tg128 | ratio |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
for t in types.split():
    lp, fp, lt, ft = llama_tps(t, "pp"), flint_tps(t, "pp"), llama_tps(t, "tg"), flint_tps(t, "tg")
    lines.append(f"| {t} | {fmt(lp)} | {fmt(fp)} | {ratio(fp, lp)} | {fmt(lt)} | {fmt(ft)} | {ratio(ft, lt)} |")
lines += ["", f"## {par} parallel sequences (aggregate decode tokens/s; 128-token prompts, 128 tokens each)", "",
          "| type | llama-batched-bench S_TG | flint decode phase | ratio |", "|---|---:|---:|---:|"]
for t in ["q8_0", "q4_0", "q4_k", "q6_k"]:
    if t not in types.split():
        continue
    l = None
    for line in read(f"llama-batched-{t}.txt").splitlines():
        try:
            r = json.loads(line)
        except Exception:
            continue
        if r.get("pl") == int(par):
            l = (r.get("speed_tg"), 0.0)
    m = re.search(r"decode phase ([0-9.]+) tok/s", read(f"flint-parallel-{t}.txt"))
    f = (float(m.group(1)), 0.0) if m else None
    lines.append(f"| {t} | {'–' if l is None else f'{l[0]:.2f}'} | {'–' if f is None else f'{f[0]:.2f}'} | {ratio(f, l)} |")
bw = {m.group(1): {k: float(v) for k, v in re.findall(r"(\w+_\w+)=([0-9.]+)", m.group(0))}
      for m in re.finditer(r"membw pages=(\w+) .*", read("membw.txt"))}
if bw:
    lines += ["", f"## Decode against memory bandwidth ({threads} threads)", "",
              "`scripts/membw.c`, run in this same session: a read-only sum and a STREAM-style triad over 1 GiB "
              "arrays, best and median of 7 (GB/s).", "",
              "| pages | read best | read median | triad best | triad median |", "|---|---:|---:|---:|---:|"]
    for pages, v in bw.items():
        lines.append(f"| {pages} | {v['read_best']:.1f} | {v['read_median']:.1f} | {v['triad_best']:.1f} | {v['triad_median']:.1f} |")
    lim = bw.get("huge") or next(iter(bw.values()))
    small = bw.get("4k") or lim
    lines += ["", "Decode streams every weight once per token, so flint's tg128 × the weights' bytes "
              "(from `flint inspect`) is the bandwidth it sustains, as a share of the huge-page figures "
              "(flint's weights sit in huge pages), and of the conventional STREAM figure (4 KiB pages). "
              "A pure read stream can beat the triad, so the read best is the strictest ceiling.", "",
              "| type | weight bytes | flint tg128 | GB/s | of 4k triad median | of huge triad median "
              "| of huge triad best | of huge read best |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in types.split():
        nbytes = sum(int(b.replace(",", "")) for b in re.findall(r"parameters, ([0-9,]+) bytes", read(f"flint-inspect-{t}.txt")))
        ft = flint_tps(t, "tg")
        if nbytes and ft:
            gbs = ft[0] * nbytes / 1e9
            lines.append(f"| {t} | {nbytes / 1e6:.1f} MB | {ft[0]:.2f} | {gbs:.1f} | "
                         f"{100 * gbs / small['triad_median']:.0f}% | {100 * gbs / lim['triad_median']:.0f}% | {100 * gbs / lim['triad_best']:.0f}% | "
                         f"{100 * gbs / lim['read_best']:.0f}% |")
lines += ["", "## Commands", "", "```sh"] + cmds + ["```", "", "## Raw outputs", ""]
# Only this run's files: the raw directory also holds other types' earlier runs.
for name in sorted(os.listdir(raw)):
    if name == "membw.txt" or name.endswith(".txt") and any(name.endswith(f"-{t}.txt") for t in types.split()):
        lines += [f"### {name}", "", "```", read(name).strip(), "```", ""]
open(out, "w").write("\n".join(lines) + "\n")
print(f"wrote {out}")
PY
