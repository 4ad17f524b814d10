#!/usr/bin/env bash
# flint against llama.cpp on the same CPU and the same weights, back to back in one run, written
# to docs/benchmarks.md as a side-by-side table with ratios, the exact commands and raw outputs.
#
#   scripts/bench_vs_llamacpp.sh            # REPS=3 THREADS=2 SHAPE=qwen2.5-0.5b TYPES="f32 bf16 q8_0 q4_0"
#
# Long context (LONG_DEPTHS="0 4096 16384 32000" on LONG_TYPE=q4_0; LONG_DEPTHS= skips it): pp512
# and tg32 after a context of each depth (32000, not 32768: context and test must fit the model's
# 32,768 positions), flint's int8 KV against llama.cpp's q8_0 KV (flash attention on) and flint's
# bf16 KV against llama.cpp's default f16, plus a 16k-token prompt's prefill time for each, and
# every flint row's share of the bandwidth ceiling.
#
# llama.cpp is built once from the llama-cpp-python 0.3.36 sdist (which vendors it), cached under
# $WORK (default target/llamacpp): cmake and ninja come from a venv there, nothing system-wide.
# AMX is left out of the build: its matmul (used for prefill where the CPU reports AMX) dies with
# SIGILL in this llama.cpp version on Linux machines that expose AMX, and flint uses none either.
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
LONG_DEPTHS=${LONG_DEPTHS-"0 4096 16384 32000"}
# llama.cpp's CPU prefill slows down so much at depth (about 15 minutes for 16k tokens on a 2-core
# Xeon) that 32k would add hours: its depths are a separate list.
LLAMA_LONG_DEPTHS=${LLAMA_LONG_DEPTHS-"0 4096 16384"}
# llama.cpp's KV settings at depth, kv:flash-attention; f16 with flash attention on (its default)
# was 5-18x slower than with it off at depth on a 2-core Xeon and adds about 35 minutes.
LLAMA_LONG_KV=${LLAMA_LONG_KV-"q8_0:1 f16:1 f16:0"}
LONG_TYPE=${LONG_TYPE:-q4_0}
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
  # An explicit -mno-amx-* wins over -march=native whatever their order (GCC keeps explicit ISA
  # choices), so the build stays native otherwise.
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  PATH=$WORK/tools/bin:$PATH cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" \
    >"$WORK/raw/cmake-configure.log"
  PATH=$WORK/tools/bin:$PATH cmake --build "$WORK/build" -j"$THREADS" --target llama-bench llama-batched-bench \
    >"$WORK/raw/cmake-build.log"
fi

echo "== building flint (release)" >&2
cargo build --release --locked -p flint >&2
F=$ROOT/target/release/flint

ALL_TYPES=$TYPES
[ -n "$LONG_DEPTHS" ] && case " $TYPES " in *" $LONG_TYPE "*) ;; *) ALL_TYPES="$TYPES $LONG_TYPE" ;; esac
for t in $ALL_TYPES; do
  m=$WORK/models/$SHAPE-$t
  if [ ! -f "$m/model-$t.gguf" ]; then
    rm -rf "$m"
    "$F" synth --shape "$SHAPE" --gguf "$t" --out "$m" >&2
  fi
done

# Runs one command, keeps its output under raw/, and records the exact command line (paths
# relative to the repository).
CMDS=()
run() {
  local name=$1; shift
  CMDS+=("$(echo "$*" | sed "s|$ROOT/||g")")
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

# Long context: decode and prefill after a context already in the cache, each KV type against
# its llama.cpp counterpart, and a 16k-token prompt's prefill time.
if [ -n "$LONG_DEPTHS" ]; then
  g=$WORK/models/$SHAPE-$LONG_TYPE/model-$LONG_TYPE.gguf
  depths=$(echo $LONG_DEPTHS | tr ' ' ',')
  ldepths=$(echo $LLAMA_LONG_DEPTHS | tr ' ' ',')
  lprompts=$(echo $LLAMA_LONG_DEPTHS | tr ' ' '\n' | grep -v '^0$' | tr '\n' ',' | sed 's/,$//')
  lctx=$(( $(echo $LLAMA_LONG_DEPTHS | tr ' ' '\n' | sort -n | tail -1) + 600 ))
  # q8_0 needs flash attention (a quantized V cache does); f16 runs with it (the default, auto =
  # on) and without it, which is llama.cpp's faster f16 setting on the CPUs measured so far.
  rm -f "$WORK"/raw/llama-long-* "$WORK"/raw/flint-long-* "$WORK"/raw/flint-inspect-long-*
  for cfg in $LLAMA_LONG_KV; do
    kv=${cfg%:*} fa=${cfg#*:}
    name=$kv; [ "$fa" = 0 ] && name=$kv-nofa
    # pp512 after each depth (llama-bench prefills the context again for every test), tg32 at
    # depth 0, and per depth one prompt of that length: its prefill time and tg32 after it.
    run "llama-long-pp-$name" "$B/llama-bench" -m "$g" -t "$THREADS" -p 512 -n 0 -d "$ldepths" -r 1 -fa "$fa" \
      -ctk "$kv" -ctv "$kv" -o json
    run "llama-long-tg0-$name" "$B/llama-bench" -m "$g" -t "$THREADS" -p 0 -n 32 -r 1 -fa "$fa" \
      -ctk "$kv" -ctv "$kv" -o json
    fa_word=on; [ "$fa" = 0 ] && fa_word=off
    run "llama-long-depth-$name" "$B/llama-batched-bench" -m "$g" -t "$THREADS" -c "$lctx" -b 2048 -ub 512 \
      -fa "$fa_word" -ctk "$kv" -ctv "$kv" -npp "$lprompts" -ntg 32 -npl 1 --output-format jsonl
  done
  for kv in int8 bf16; do
    run "flint-long-$kv" "$F" bench latency --model "$g" --kv-cache-dtype "$kv" --depth "$depths" \
      --prompt-len 512 --gen-len 32 --reps 1 --json "$WORK/raw/flint-long-$kv.json"
    run "flint-inspect-long-$kv" "$F" inspect --model "$g" --kv-cache-dtype "$kv"
  done
fi

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
python3 - "$WORK" "$OUT" "$SHAPE" "$THREADS" "$REPS" "$PARALLEL" "$TYPES" "$COMMIT" "$LONG_DEPTHS" "$LONG_TYPE" "${CMDS[@]}" <<'PY'
import json, re, sys, datetime, platform, os
work, out, shape, threads, reps, par, types, commit, long_depths, long_type = sys.argv[1:11]
cmds = sys.argv[11:]
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
def llama_long(kv):
    """(depth, "pp"/"tg") -> tokens/s, and depth -> seconds to prefill a prompt that long."""
    res, prefill = {}, {}
    for name in [f"llama-long-pp-{kv}.txt", f"llama-long-tg0-{kv}.txt"]:
        for r in json.loads(read(name) or "[]"):
            test = "pp" if r.get("n_gen") == 0 else "tg"
            res[(r.get("n_depth", 0), test)] = r["avg_ts"]
    for line in read(f"llama-long-depth-{kv}.txt").splitlines():
        try:
            r = json.loads(line)
        except Exception:
            continue
        if r.get("pl") == 1 and "pp" in r:
            res[(r["pp"], "tg")] = r.get("speed_tg")
            prefill[r["pp"]] = r.get("t_pp")
    return res, prefill
def flint_long(kv):
    p = os.path.join(raw, f"flint-long-{kv}.json")
    if not os.path.exists(p):
        return {}, None
    v = json.load(open(p))
    res, prefill = {}, None
    for d in v.get("depths", []):
        res[(d["depth"], "pp")] = d["pp"]["mean"]
        res[(d["depth"], "tg")] = d["tg"]["mean"]
        if d["depth"] == 16384 and d.get("context_prefill_s"):
            prefill = d["context_prefill_s"]
    return res, prefill
def kv_bytes(kv):
    m = re.search(r"\*" + kv + r"\s+block\s+\d+:\s+([0-9.]+) bytes per token", read(f"flint-inspect-long-{kv}.txt"))
    return float(m.group(1)) if m else None
if long_depths:
    depths = [int(x) for x in long_depths.split()]
    wbytes = sum(int(b.replace(",", "")) for b in re.findall(r"parameters, ([0-9,]+) bytes", read(f"flint-inspect-long-int8.txt")))
    triad = (bw.get("huge") or bw.get("4k") or {}).get("triad_median") if bw else None
    lines += ["", f"## Long context ({long_type}, {threads} threads, one repetition per cell)", "",
              "pp512 and tg32 in tokens/s after a context of d tokens already in the cache (llama-bench `-d`, "
              "`flint bench latency --depth`; llama.cpp's tg32 after a context comes from llama-batched-bench "
              "with a prompt that long, which also times its prefill). Ceiling share = tg × (weight bytes + "
              "d × KV bytes per token) ÷ the huge-page triad median above: the part of this machine's memory "
              "bandwidth the decode uses. – : not measured (llama.cpp's 32k context would take hours here).", ""]
    pairs = [("int8", "q8_0", "q8_0 KV, flash attention on"), ("int8", "f16-nofa", "f16 KV, flash attention off"),
             ("bf16", "f16", "f16 KV, flash attention on (its default)"),
             ("bf16", "f16-nofa", "f16 KV, flash attention off")]
    for fkv, lkv, label in pairs:
        (l, _), (f, _) = llama_long(lkv), flint_long(fkv)
        if not l:
            continue  # that llama.cpp setting was not run (LLAMA_LONG_KV)
        kvb = kv_bytes(fkv)
        lines += [f"### flint {fkv} KV vs llama.cpp {label}", "",
                  "| depth | llama.cpp pp512 | flint pp512 | ratio | llama.cpp tg32 | flint tg32 | ratio | flint of ceiling |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for d in depths:
            lp, fp, lt, ft = l.get((d, "pp")), f.get((d, "pp")), l.get((d, "tg")), f.get((d, "tg"))
            r = lambda a, b: "–" if a is None or b is None or b == 0 else f"{a / b:.2f}"
            n = lambda x: "–" if x is None else f"{x:.2f}"
            share = "–"
            if ft and kvb and wbytes and triad:
                share = f"{100 * ft * (wbytes + d * kvb) / 1e9 / triad:.0f}%"
            lines.append(f"| {d} | {n(lp)} | {n(fp)} | {r(fp, lp)} | {n(lt)} | {n(ft)} | {r(ft, lt)} | {share} |")
        lines.append("")
    if not llama_long("f16")[0]:
        lines += ["llama.cpp's f16 KV with flash attention on was not run in this run (`LLAMA_LONG_KV`): on "
                  "this kind of machine it is the slower f16 setting at depth.", ""]
    lines += ["### A 16,384-token prompt's prefill (512-token chunks)", "", "| engine | KV | seconds | tokens/s |", "|---|---|---:|---:|"]
    for lkv in ["q8_0", "f16", "f16-nofa"]:
        pre = llama_long(lkv)[1].get(16384)
        if pre:
            lines.append(f"| llama.cpp | {lkv.replace('-nofa', ' (flash attention off)')} | {pre:.1f} | {16384 / pre:.1f} |")
    for fkv in ["int8", "bf16"]:
        _, pre = flint_long(fkv)
        if pre:
            lines.append(f"| flint | {fkv} | {pre:.1f} | {16384 / pre:.1f} |")
lines += ["", "## Commands", "", "```sh"] + cmds + ["```", "", "## Raw outputs", ""]
# Only this run's files: the raw directory also holds other types' earlier runs.
for name in sorted(os.listdir(raw)):
    long_file = long_depths and re.match(r"(llama-long-(pp|tg0|depth)|flint-inspect-long)-.*\.txt$|flint-long-.*\.json$", name)
    if name == "membw.txt" or long_file or name.endswith(".txt") and any(name.endswith(f"-{t}.txt") for t in types.split()):
        lines += [f"### {name}", "", "```", read(name).strip(), "```", ""]
open(out, "w").write("\n".join(lines) + "\n")
print(f"wrote {out}")
PY
# The raw outputs name files by absolute path: keep them relative to the repository.
sed -i "s|$ROOT/||g" "$OUT"
