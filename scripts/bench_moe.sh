#!/usr/bin/env bash
# flint against llama.cpp on a mixture of experts: the same GGUF file (random weights with the exact
# shape of Qwen3-30B-A3B by default, written by `flint synth`), the same CPU, back to back in one
# run, written to docs/benchmarks-moe.md with the commands. Not part of CI (about an hour on a
# 2-core machine, most of it writing and loading the 17 GB file).
#
#   scripts/bench_moe.sh            # SHAPE=qwen3-30b-a3b TYPE=q4_k REPS=2 ROUNDS=3 THREADS=2 PARALLEL=16
#   REPORT_ONLY=1 scripts/bench_moe.sh   # rewrite the report from the last run's raw files
#
# Measured: pp512 and tg128 for one sequence (llama-bench against `flint bench latency`), the
# aggregate decode rate of 16 parallel sequences (llama-batched-bench against `flint bench
# throughput`), each program's peak RSS (GNU time) and the huge pages in use while it ran, this
# machine's memory bandwidth (scripts/membw.c) and the bytes a token reads (`flint inspect`), for
# the decode's share of the bandwidth ceiling. llama.cpp is built as scripts/bench_vs_llamacpp.sh
# builds it (same cache).
# The pairs alternate for ROUNDS rounds (llama.cpp, flint, llama.cpp, flint, ...): this host's
# bandwidth moves with its neighbours' load, so the report gives each round's ratio and their median.
# Three rounds by default: with two, the "median" is the mean of a pair, and one round in a slow
# window moved it by a tenth (tg128 1.08 and 1.29, 16 sequences 2.02 and 1.73 on 2026-12-05).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${WORK:-$ROOT/target/llamacpp}
SHAPE=${SHAPE:-qwen3-30b-a3b}
TYPE=${TYPE:-q4_k}
REPS=${REPS:-2}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
PARALLEL=${PARALLEL:-16}
MODEL=${MODEL:-$WORK/models/$SHAPE-$TYPE/model-$TYPE.gguf}
OUT=${OUT:-$ROOT/docs/benchmarks-moe.md}
RAW=$WORK/raw-moe
mkdir -p "$RAW"
B=$WORK/build/bin

if [ "${REPORT_ONLY:-0}" = 1 ]; then
  [ -f "$RAW/commands.txt" ] || { echo "== REPORT_ONLY: no earlier run under $RAW" >&2; exit 1; }
  mapfile -t CMDS < "$RAW/commands.txt"
  COMMIT=$(cat "$RAW/commit.txt")
else
  if [ ! -x "$B/llama-bench" ] || [ ! -x "$B/llama-batched-bench" ]; then
    # The build recipe lives in one place: run the dense benchmark's build step only.
    echo "== llama.cpp is not built under $WORK: run scripts/bench_vs_llamacpp.sh once (it builds it)" >&2
    exit 1
  fi
  [ -x /usr/bin/time ] || { echo "== GNU time (/usr/bin/time) is needed for peak RSS: apt-get install time" >&2; exit 1; }

  echo "== building flint (release)" >&2
  cargo build --release --locked -p flint >&2
  F=$ROOT/target/release/flint

  if [ ! -f "$MODEL" ]; then
    rm -rf "$(dirname "$MODEL")"
    "$F" synth --shape "$SHAPE" --gguf "$TYPE" --out "$(dirname "$MODEL")" >&2
  fi

  CMDS=()
  # Runs one command under GNU time, keeps its output and peak RSS under raw-moe/, and records the
  # command line (paths relative to the repository).
  run() {
    local name=$1; shift
    # Each command once in the list: round 1's (later rounds repeat it with their own output file)
    # and those outside the rounds (their names do not end in a digit).
    case $name in membw-*-r*) ;; *-r1 | *[!0-9]) CMDS+=("$(echo "$*" | sed "s|$ROOT/||g")") ;; esac
    echo "== $name: $*" >&2
    /usr/bin/time -f "maxrss_kb=%M" -o "$RAW/$name.rss" "$@" >"$RAW/$name.txt" 2>"$RAW/$name.err" &
    # The machine's anonymous huge pages while it runs (/proc/meminfo every 2 s, the largest kept):
    # flint's packed weights stream about a fifth slower from 4 KiB pages, so a run that got fewer
    # huge pages than its weights is not comparable.
    local pid=$! huge_kb=0 h
    while kill -0 "$pid" 2>/dev/null; do
      h=$(awk '/^AnonHugePages:/ {print $2}' /proc/meminfo)
      if [ "${h:-0}" -gt "$huge_kb" ]; then huge_kb=$h; fi
      sleep 2
    done
    local rc=0
    wait "$pid" || rc=$?
    echo "anonhuge_kb=$huge_kb" >"$RAW/$name.huge"
    return "$rc"
  }

  # Nothing from an earlier run (with or without rounds) may join this one's report.
  rm -f "$RAW"/membw*.txt "$RAW"/llama-*.txt "$RAW"/flint-latency*.json "$RAW"/flint-probe*.json "$RAW"/flint-parallel*.txt "$RAW"/*.rss "$RAW"/*.huge
  run flint-inspect "$F" inspect --model "$MODEL"
  MEMBW=0
  if cc -O3 -march=native -fopenmp -o "$WORK/membw" scripts/membw.c 2>"$RAW/membw-build.log"; then
    MEMBW=1
    run membw env OMP_NUM_THREADS="$THREADS" "$WORK/membw"
  fi
  # Each round starts with a bandwidth run, so its pair is set against the memory of its own minutes.
  for i in $(seq 1 "$ROUNDS"); do
    if [ "$MEMBW" = 1 ]; then run "membw-tg-r$i" env OMP_NUM_THREADS="$THREADS" "$WORK/membw"; fi
    run "llama-bench-r$i" "$B/llama-bench" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r "$REPS" -o json
    # flint's KV cache at 16 bits, as llama.cpp's default f16 cache: the same bytes per token (its
    # `auto` is f32, twice that, which 16 sequences' 4,096 tokens would put into the peak RSS).
    run "flint-latency-r$i" "$F" bench latency --model "$MODEL" --prompt-len 512 --gen-len 128 --reps "$REPS" \
      --kv-cache-dtype bf16 --json "$RAW/flint-latency-r$i.json"
  done
  for i in $(seq 1 "$ROUNDS"); do
    if [ "$MEMBW" = 1 ]; then run "membw-par-r$i" env OMP_NUM_THREADS="$THREADS" "$WORK/membw"; fi
    run "llama-batched-r$i" "$B/llama-batched-bench" -m "$MODEL" -t "$THREADS" -c 8192 -b 2048 -ub 512 \
      -npp 128 -ntg 128 -npl "$PARALLEL" --output-format jsonl
    run "flint-parallel-r$i" "$F" bench throughput --model "$MODEL" --num-prompts "$PARALLEL" --input-len 128 \
      --output-len 128 --max-num-seqs "$PARALLEL" --kv-cache-dtype bf16
  done
  # The decode's share of the bandwidth at its own moments: a read of 1 GiB between every two decode
  # steps, in flint's process on its threads (a process of its own: the probe's buffer would join
  # the latency run's peak RSS).
  run flint-probe "$F" bench latency --model "$MODEL" --prompt-len 16 --gen-len 256 --reps 1 \
    --kv-cache-dtype bf16 --bandwidth-probe --json "$RAW/flint-probe.json"
  # The same for the parallel sequences decoding together: each step's weights are the experts the
  # batch chose (counted by the kernels), set against the reads around it. Their prompts are the
  # rounds' 128 tokens, so the steps' attention reads as long a KV cache as there.
  run flint-probe-par "$F" bench latency --model "$MODEL" --prompt-len 16 --gen-len 128 --reps 1 \
    --kv-cache-dtype bf16 --bandwidth-probe --probe-seqs "$PARALLEL" --probe-prompt-len 128 \
    --json "$RAW/flint-probe-par.json"
  # Bandwidth again at the end: on a shared host it moves with the neighbours' load (33 to 62 GB/s
  # huge-page read best within minutes on one Zen 4), so the bounds span every bandwidth run's.
  if [ "$MEMBW" = 1 ]; then
    run membw-end env OMP_NUM_THREADS="$THREADS" "$WORK/membw"
  fi
  printf "%s\n" "${CMDS[@]}" > "$RAW/commands.txt"
  # The CPU the figures came from (the model name alone does not tell AMD's generations apart).
  python3 - > "$RAW/cpu.txt" <<'CPU'
info = {}
for line in open("/proc/cpuinfo"):
    k, _, v = line.partition(":")
    info.setdefault(k.strip(), v.strip())
flags = info.get("flags", "").split()
simd = next((n for f, n in [("amx_int8", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx512f", "AVX-512"),
                            ("avx2", "AVX2")] if f in flags), "no AVX2")
print(f"{info.get('model name', '?')}, family {info.get('cpu family', '?')} model {info.get('model', '?')}, {simd}")
CPU
  git rev-parse --short HEAD > "$RAW/commit.txt" 2>/dev/null || echo unknown > "$RAW/commit.txt"
  COMMIT=$(cat "$RAW/commit.txt")
fi

python3 - "$RAW" "$OUT" "$SHAPE" "$TYPE" "$THREADS" "$REPS" "$PARALLEL" "$COMMIT" "$MODEL" "${CMDS[@]}" <<'PY'
import datetime, json, os, re, statistics, sys
from functools import partial
raw, out, shape, ty, threads, reps, par, commit, model = sys.argv[1:10]
cmds = sys.argv[10:]
def read(name):
    p = os.path.join(raw, name)
    return open(p).read() if os.path.exists(p) else ""
# The rounds that ran (files `<name>-r<i>.*`; a run from before the rounds has one, unnumbered).
rounds = sorted(int(m.group(1)) for f in os.listdir(raw) if (m := re.fullmatch(r"llama-bench-r(\d+)\.txt", f)))
sfx = [f"-r{i}" for i in rounds] or [""]
def largest_gb(name, ext, key):
    # The largest `key=<kB>` over the rounds' `<name>-r<i><ext>` files (None where there are none).
    kb = [int(m.group(1)) for s in sfx if (m := re.search(key + r"=(\d+)", read(name + s + ext)))]
    return max(kb) * 1024 / 1e9 if kb else None
rss_gb = partial(largest_gb, ext=".rss", key="maxrss_kb")
def llama_round(kind, s):
    for r in json.loads(read(f"llama-bench{s}.txt") or "[]"):
        if kind == "pp" and r.get("n_prompt") == 512 and r.get("n_gen") == 0:
            return r["avg_ts"], r["stddev_ts"]
        if kind == "tg" and r.get("n_gen") == 128 and r.get("n_prompt") == 0:
            return r["avg_ts"], r["stddev_ts"]
    return None
def flint_round(kind, s):
    p = os.path.join(raw, f"flint-latency{s}.json")
    if not os.path.exists(p):
        return None
    v = json.load(open(p))[kind]
    return v["mean"], v["sd"]
def pooled(vals):
    # The mean of the rounds' means, and the spread of those means (0 for one round).
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    means = [v[0] for v in vals]
    return statistics.mean(means), (statistics.stdev(means) if len(means) > 1 else vals[0][1])
def llama(kind):
    return pooled(llama_round(kind, s) for s in sfx)
def flint(kind):
    return pooled(flint_round(kind, s) for s in sfx)
def fmt(x):
    return "–" if x is None else f"{x[0]:.2f} ± {x[1]:.2f}"
def ratio_of(get_flint, get_llama):
    # The median over the rounds of flint / llama.cpp within a round (each round one pair, back to back).
    rs = [f[0] / l[0] for s in sfx if (f := get_flint(s)) and (l := get_llama(s)) and l[0]]
    return statistics.median(rs) if rs else None
def rfmt(r):
    return "–" if r is None else f"{r:.2f}"
run_date = datetime.date.fromtimestamp(os.path.getmtime(os.path.join(raw, "flint-inspect.txt")))
cpu = read("cpu.txt").strip() or next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
file_gb = os.path.getsize(model) / 1e9
inspect = read("flint-inspect.txt")
m = re.search(r"per token:\s+([0-9,]+) parameters read \(([0-9.]+)%\), ([0-9,]+) bytes", inspect)
active, share, per_token = (int(m.group(1).replace(",", "")), m.group(2), int(m.group(3).replace(",", ""))) if m else (None, None, None)
m = re.search(r"parameters:\s+([0-9,]+)", inspect)
total = int(m.group(1).replace(",", "")) if m else None
lines = [
    "# Mixture of experts: flint vs llama.cpp",
    "",
    f"Generated by `scripts/bench_moe.sh` on {run_date} ({cpu}, {threads} threads). Model: random "
    f"weights with the exact shape of {shape} ({total:,} parameters, {active:,} read per token, {share}%), "
    f"synthesized by `flint synth --shape {shape} --gguf {ty}`: one {file_gb:.2f} GB file given to both. "
    "llama.cpp: the copy vendored in the llama-cpp-python 0.3.36 sdist, built as `scripts/bench_vs_llamacpp.sh` "
    f"builds it. flint: commit {commit}, release build. KV cache: llama.cpp's default f16, flint's bf16 "
    "(`--kv-cache-dtype bf16`), 2 bytes a value each. Ratio = flint / llama.cpp (≥ 1.00: flint ahead). "
    "The machine is shared and noisy; both ran back to back in this one run.",
    "",
    f"## Single stream (tokens/s)",
    "",
    f"{len(sfx)} round(s), llama.cpp then flint in each, {reps} repetitions a program and round. Figures: the "
    "mean of the rounds' means ± the spread of those means (one round: ± the sd of its repetitions); ratio: the "
    "median of the rounds' own ratios.",
    "",
    "| | llama.cpp | flint | ratio |",
    "|---|---:|---:|---:|",
    f"| pp512 | {fmt(llama('pp'))} | {fmt(flint('pp'))} | {rfmt(ratio_of(partial(flint_round, 'pp'), partial(llama_round, 'pp')))} |",
    f"| tg128 | {fmt(llama('tg'))} | {fmt(flint('tg'))} | {rfmt(ratio_of(partial(flint_round, 'tg'), partial(llama_round, 'tg')))} |",
    "",
]
if len(sfx) > 1:
    lines += ["| round | llama.cpp pp512 | flint pp512 | ratio | llama.cpp tg128 | flint tg128 | ratio |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for n, s in enumerate(sfx, 1):
        cells = []
        for kind in ("pp", "tg"):
            lr, fr = llama_round(kind, s), flint_round(kind, s)
            cells += [fmt(lr), fmt(fr), rfmt(fr[0] / lr[0] if lr and fr and lr[0] else None)]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
def batched_round(s):
    v = None
    for line in read(f"llama-batched{s}.txt").splitlines():
        try:
            r = json.loads(line)
        except Exception:
            continue
        if r.get("pl") == int(par):
            v = r.get("speed_tg")
    return (v, 0.0) if v else None
def parallel_round(s):
    m = re.search(r"decode phase ([0-9.]+) tok/s", read(f"flint-parallel{s}.txt"))
    return (float(m.group(1)), 0.0) if m else None
lp, fp = pooled(batched_round(s) for s in sfx), pooled(parallel_round(s) for s in sfx)
l, f = (lp[0] if lp else None), (fp[0] if fp else None)
lines += [f"## {par} parallel sequences (aggregate decode tokens/s; 128-token prompts, 128 tokens each)", "",
          "| round | llama-batched-bench S_TG | flint decode phase | ratio |", "|---|---:|---:|---:|"]
for n, s in enumerate(sfx, 1):
    lr, fr = batched_round(s), parallel_round(s)
    lines.append(f"| {n} | {'–' if lr is None else f'{lr[0]:.2f}'} | {'–' if fr is None else f'{fr[0]:.2f}'} | "
                 f"{rfmt(fr[0] / lr[0] if lr and fr else None)} |")
if len(sfx) > 1:
    lines.append(f"| mean / median ratio | {'–' if l is None else f'{l:.2f}'} | {'–' if f is None else f'{f:.2f}'} | "
                 f"{rfmt(ratio_of(parallel_round, batched_round))} |")
lines.append("")
# The parallel decode against the bandwidth of its own moments (`--bandwidth-probe --probe-seqs`).
probe_par_json = read("flint-probe-par.json")
pp = (json.loads(probe_par_json).get("depths") or [{}])[0].get("bandwidth_probe") if probe_par_json else None
if pp:
    lo_s, med_s, hi_s = pp["share"]
    lines += [f"In flint's own process (`--bandwidth-probe --probe-seqs {par}`, a run of its own after the rounds, "
              f"{pp.get('prompt_tokens', 1)}-token prompts): {pp['steps']} decode steps of all {pp['seqs']} sequences, median "
              f"{pp['step_ms_median']:.1f} ms and {pp['step_gb_median']:.2f} GB of weights a step (the experts the "
              f"batch chose, as the kernels counted them; {pp['weights_gb_s']:.1f} GB/s); reads of 1 GiB between "
              f"the steps {pp['read_gb_s_median']:.1f} GB/s median ({pp['read_gb_s_min']:.1f} to "
              f"{pp['read_gb_s_max']:.1f}). Each step's weight stream against the reads around it: "
              f"**{100 * med_s:.0f}%** median (quartiles {100 * lo_s:.0f}% to {100 * hi_s:.0f}%)."]
    if l:
        need = 2 * l / int(par) * pp["step_gb_median"]
        lines[-1] += (f" Twice llama-batched-bench's mean S_TG ({2 * l:.1f} tok/s) takes {need:.1f} GB/s of "
                      f"weights: reads of {need / med_s:.1f} GB/s at that median share.")
    lines.append("")
lines += ["## Peak memory (GNU time, maximum resident set; the largest of the rounds)", "",
          "Huge pages: the machine's `AnonHugePages` (/proc/meminfo, every 2 s) at its largest while the program "
          "ran. flint's packed weights should all be on them; llama.cpp maps the file instead.", "",
          "| program | peak RSS | of the file | huge pages (peak) |", "|---|---:|---:|---:|"]
for name, label in [("llama-bench", "llama-bench (memory-mapped file)"), ("flint-latency", "flint bench latency"),
                    ("llama-batched", "llama-batched-bench"), ("flint-parallel", "flint bench throughput")]:
    g = rss_gb(name)
    h = largest_gb(name, ".huge", "anonhuge_kb")  # older runs kept none
    lines.append(f"| {label} | {'–' if g is None else f'{g:.2f} GB'} | {'–' if g is None else f'{g / file_gb:.2f}×'} | "
                 f"{'–' if h is None else f'{h:.2f} GB'} |")
# Both bandwidth runs (start and end of the run), per page size; the shares use the better one.
def membw_fields(line):
    # `membw pages=huge read_best=… read_median=…` as {read_best: …, …}.
    return {k: float(v) for k, v in re.findall(r"(\w+_\w+)=([0-9.]+)", line)}
def huge_bw(name):
    # The huge-page line of one membw output file, as fields (None where the file has none).
    m = re.search(r"membw pages=huge .*", read(name))
    return membw_fields(m.group(0)) if m else None
runs = [(when, m.group(1), membw_fields(m.group(0)))
        for when, name in [("start", "membw.txt"), ("end", "membw-end.txt")]
        for m in re.finditer(r"membw pages=(\w+) .*", read(name))]
bw = {}
for _, pages, v in runs:
    if pages not in bw or v["read_best"] > bw[pages]["read_best"]:
        bw[pages] = v
ft, lt = flint("tg"), llama("tg")
if bw and per_token and ft:
    lim = bw.get("huge") or next(iter(bw.values()))
    best = lim["read_best"]
    gbs = ft[0] * per_token / 1e9
    lines += ["", "## Decode against memory bandwidth", "",
              f"A token reads {per_token / 1e9:.2f} GB of weights (`flint inspect`: the attention, the router, "
              "its 8 chosen experts, the head, one embedding row). `scripts/membw.c` at the start and at the "
              "end of this same run, best and median of 7 over 1 GiB arrays (GB/s); the shares just below use "
              "the better huge-page read best:", "",
              "| when | pages | read best | read median | triad best | triad median |", "|---|---|---:|---:|---:|---:|"]
    for when, pages, v in runs:
        lines.append(f"| {when} | {pages} | {v['read_best']:.1f} | {v['read_median']:.1f} | {v['triad_best']:.1f} | {v['triad_median']:.1f} |")
    lines += ["", f"flint's tg128 × bytes per token = {gbs:.1f} GB/s: {100 * gbs / lim['triad_median']:.0f}% of the "
              f"huge-page triad median, {100 * gbs / best:.0f}% of the huge-page read best."]
    # The same share with the bandwidth measured at the decode's own moments (`--bandwidth-probe`).
    probe_json = read("flint-probe.json")
    probe = (json.loads(probe_json).get("depths") or [{}])[0].get("bandwidth_probe") if probe_json else None
    if probe:
        lo_s, med_s, hi_s = probe["share"]
        lines += ["", f"In flint's own process (`--bandwidth-probe`, a run of its own after the rounds): a read of "
                  f"1 GiB before the first decode step and after each, as `membw.c` reads, on the decode's threads. "
                  f"{probe['steps']} decode steps, median {probe['step_ms_median']:.1f} ms "
                  f"({probe['weights_gb_s']:.1f} GB/s of weights); the reads {probe['read_gb_s_median']:.1f} GB/s "
                  f"median ({probe['read_gb_s_min']:.1f} to {probe['read_gb_s_max']:.1f}). Each step's weight stream "
                  f"against the mean of the two reads around it: **{100 * med_s:.0f}%** median (quartiles "
                  f"{100 * lo_s:.0f}% to {100 * hi_s:.0f}%)."]
    # How far ahead of llama.cpp any program that reads these bytes could be: both read the same
    # weights per token, so a decode is bounded by the bandwidth of its minutes. That moved between
    # windows about 2x apart within this run, so the bound is given for the slowest and the fastest
    # window: the lowest and the highest read best of every huge-page run (start, each round's, end;
    # a run's best, as a run's median can fall on a switch between windows), not for the best alone:
    # a round in a slow window cannot reach a ratio the fast window allows.
    bests = [v["read_best"] for name in ["membw.txt", *(f"membw-{k}{s}.txt" for k in ("tg", "par") for s in sfx), "membw-end.txt"]
             if (v := huge_bw(name))]
    lo, hi = (min(bests), max(bests)) if bests else (best, best)
    if lt:
        lt_gbs = lt[0] * per_token / 1e9
        lines += ["", "## What bounds the ratios here", "",
                  f"llama.cpp's tg128 × the same bytes = {lt_gbs:.1f} GB/s. The huge-page read best of this run's "
                  f"{len(bests)} bandwidth runs went from {lo:.1f} to {hi:.1f} GB/s. A decode that reads "
                  f"{per_token / 1e9:.2f} GB a token at those rates makes {lo * 1e9 / per_token:.1f} to "
                  f"{hi * 1e9 / per_token:.1f} tokens/s, {lo * 1e9 / per_token / lt[0]:.2f}× to "
                  f"{hi * 1e9 / per_token / lt[0]:.2f}× llama.cpp's mean tg128: in the slow window no program can be "
                  "far ahead of one that streams near the bandwidth. The per-round table below sets each pair "
                  "against the bandwidth of its own minutes."]
    g = lambda pat: (lambda m: int(m.group(1).replace(",", "")) if m else None)(re.search(pat, inspect))
    hidden, experts, size, k, sparse = (g(r"hidden size:\s+(\d+)"), g(r"experts:\s+(\d+) of"),
                                        g(r"of size (\d+)"), g(r"(\d+) per token"), g(r"(\d+) of \d+ layers sparse"))
    per_value = {"q4_k": 144 / 256, "q4_0": 18 / 32, "q8_0": 34 / 32, "q6_k": 210 / 256, "bf16": 2, "f16": 2, "f32": 4}
    step = None  # the weight bytes of a step of `par` sequences, where the inspection gives them
    if lt and l and f and None not in (hidden, experts, size, k, sparse) and ty in per_value:
        p = int(par)
        all_experts = sparse * experts * 3 * hidden * size * per_value[ty]
        # Routing over random weights is close to uniform: the expected number of experts at least
        # one of p rows chose, each row choosing k of them.
        distinct = experts * (1 - (1 - k / experts) ** p)
        step = per_token - k / experts * all_experts + distinct / experts * all_experts
        cap_lo, cap_hi = p * lo * 1e9 / step, p * hi * 1e9 / step
        lines += ["", f"A step of {p} sequences reads every expert that one of them chose: about {distinct:.1f} of "
                  f"{experts} per layer under uniform routing, {step / 1e9:.2f} GB in all. At {lo:.1f} to {hi:.1f} GB/s "
                  f"that is {cap_lo:.1f} to {cap_hi:.1f} tokens/s ({cap_lo / l:.2f}× to {cap_hi / l:.2f}× "
                  f"llama-batched-bench's mean S_TG) before any arithmetic; flint's decode phase moves "
                  f"{f * step / p / 1e9:.1f} GB/s, llama.cpp's {l * step / p / 1e9:.1f} GB/s. Here the arithmetic "
                  "counts: most chosen experts get one to three rows, and the int8 tiles at those row counts "
                  "compute about as fast as the memory streams."]
    # Each pair against the bandwidth measured just before its round (runs from before these
    # per-round measurements have none: the table is left out).
    rows = []
    for n, s in enumerate(sfx, 1):
        pairs = [("tg", "tg128", llama_round("tg", s), flint_round("tg", s), per_token)]
        if step:
            pairs.append(("par", f"{par} sequences", batched_round(s), parallel_round(s), step / int(par)))
        for kind, label, lr, fr, bytes_per_token in pairs:
            b = huge_bw(f"membw-{kind}{s}.txt")
            if b is None or lr is None or fr is None:
                continue
            med = b["read_median"]
            cell = lambda r: f"{r[0] * bytes_per_token / 1e9:.1f} ({100 * r[0] * bytes_per_token / 1e9 / med:.0f}%)"
            rows.append(f"| {n} | {label} | {b['read_best']:.1f} / {med:.1f} | {cell(lr)} | {cell(fr)} |")
    if rows:
        lines += ["", "Each round's pairs against `membw` run just before them (huge pages, GB/s); each program's "
                  "weight bytes a second, and their share of that read median:", "",
                  "| round | pair | read best / median | llama.cpp | flint |", "|---|---|---:|---:|---:|"] + rows
lines += ["", "## Commands", "", "```"] + cmds + ["```", ""]
open(out, "w").write("\n".join(lines))
print("\n".join(lines))
PY
