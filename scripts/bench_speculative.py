#!/usr/bin/env python3
"""n-gram speculative decoding against plain decoding, flint alone, alternated run by run on the
same model (the machine is shared and noisy: medians of alternated runs, and their ratio).

    python3 scripts/bench_speculative.py --model MODEL.gguf [--reps 3] [--flint target/release/flint]

Prints a markdown section:
- single stream, a workload whose greedy continuation repeats (a random-weights model falls
  into loops; so do real models on code and lists): decode tok/s without speculation and with
  k = 2, 4, 8, and the acceptance;
- single stream, a workload with no repetition (sampling at temperature 1 from a
  random-weights model: no n-gram ever recurs): the cost of looking up and of any rejected draft;
- 4 and 16 parallel sequences (`flint bench throughput`, random prompts, greedy): the decode
  phase with and without speculation.

- with `--draft D.gguf`: single stream, greedy, the model proposed for by the draft model D
  (e.g. the Q4_0 copy of a Q8_0 target: `flint synth --shape qwen2.5-1.5b --gguf q8_0` and
  `--gguf q4_0` give the same random weights in both), k = 2, 4, 8, and the draft alone.

`--sections single,parallel,draft` picks what runs.
"""

import argparse
import json
import re
import statistics
import subprocess
import tempfile

REPEAT_PROMPT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci(n):\n    if n < 2:"
)
PLAIN_PROMPT = (
    "The history of the city begins with a small settlement on the river, where traders from the north "
    "met farmers from the valley."
)


def ngram(k, lo=None, hi=None, disable=None):
    c = {"method": "ngram", "num_speculative_tokens": k}
    if lo is not None:
        c["prompt_lookup_min"] = lo
    if hi is not None:
        c["prompt_lookup_max"] = hi
    if disable is not None:
        c["disable_by_batch_size"] = disable
    return json.dumps(c)


def generate(flint, model, prompt, spec, max_tokens, extra):
    cmd = [flint, "generate", "--model", model, "--prompt", prompt, "--max-tokens", str(max_tokens), "--ignore-eos"]
    cmd += extra
    if spec:
        cmd += ["--speculative-config", spec]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rate = float(re.search(r"decode: \d+ tokens in [\d.]+s \(([\d.]+) tok/s\)", out.stderr).group(1))
    m = re.search(r"Mean acceptance length: ([\d.]+), Accepted: (\d+) tokens, Drafted: (\d+)", out.stderr)
    acc = (float(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None
    return rate, acc, out.stdout


def throughput(flint, model, spec, n):
    with tempfile.TemporaryDirectory() as d:
        cmd = [flint, "bench", "throughput", "--model", model, "--num-prompts", str(n), "--input-len", "128",
               "--output-len", "128", "--max-num-seqs", str(n), "--out-dir", d]
        if spec:
            cmd += ["--speculative-config", spec]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rate = float(re.search(r"decode phase ([\d.]+) tok/s", out.stdout).group(1))
    m = re.search(r"(\d+) of (\d+) draft tokens accepted", out.stdout)
    return rate, (int(m.group(1)), int(m.group(2))) if m else None


def ordered(cfgs, rep):
    """Every other repetition runs the configurations in reverse, so no configuration always
    runs first (on this machine the first of a pair of runs tends to be the faster)."""
    return cfgs if rep % 2 == 0 else cfgs[::-1]


def section(title, rows_by_cfg, reps):
    base = statistics.median(r[0] for r in rows_by_cfg[0][1])
    print(f"\n### {title}\n")
    print("| configuration | decode tok/s (median) | runs | ratio | accepted / drafted | mean acceptance length |")
    print("|---|---:|---|---:|---:|---:|")
    for name, runs in rows_by_cfg:
        med = statistics.median(r[0] for r in runs)
        acc = runs[-1][1]
        acc_s = f"{acc[1]} / {acc[2]}" if acc else "–"
        mal = f"{acc[0]:.2f}" if acc else "–"
        all_runs = ", ".join(f"{r[0]:.1f}" for r in runs)
        print(f"| {name} | {med:.1f} | {all_runs} | {med / base:.2f} | {acc_s} | {mal} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--flint", default="target/release/flint")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sections", default="single,parallel")
    ap.add_argument("--draft", help="a draft model for --model (the draft section)")
    ap.add_argument("--parallel", type=int, nargs="+", default=[4, 16])
    a = ap.parse_args()
    sections = a.sections.split(",")

    repeat_cfgs = [("plain", None), ("ngram k=2", ngram(2)), ("ngram k=4", ngram(4)), ("ngram k=8", ngram(8))]
    plain_cfgs = [("plain", None), ("ngram k=4", ngram(4)), ("ngram k=4, window 1..3", ngram(4, 1, 3))]
    singles = [
        ("Single stream, greedy continuation that repeats", REPEAT_PROMPT, repeat_cfgs, []),
        ("Single stream, no repetition (temperature 1, seed 7)", PLAIN_PROMPT, plain_cfgs,
         ["--temperature", "1.0", "--seed", "7"]),
    ]
    for title, prompt, cfgs, extra in singles if "single" in sections else []:
        runs = {name: [] for name, _ in cfgs}
        texts = {}
        for r in range(a.reps):
            for name, spec in ordered(cfgs, r):
                rate, acc, text = generate(a.flint, a.model, prompt, spec, a.max_tokens, extra)
                runs[name].append((rate, acc))
                texts.setdefault(name, text)
        same = len(set(texts.values())) == 1
        section(title, [(n, runs[n]) for n, _ in cfgs], a.reps)
        print(f"\nOutput identical in every configuration: {'yes' if same else 'NO'}.")

    if "draft" in sections and a.draft:
        def draft(k):
            return json.dumps({"method": "draft_model", "model": a.draft, "num_speculative_tokens": k})
        cfgs = [("plain", None), ("draft k=2", draft(2)), ("draft k=4", draft(4)), ("draft k=8", draft(8))]
        runs = {name: [] for name, _ in cfgs}
        texts = {}
        for r in range(a.reps):
            for name, spec in ordered(cfgs, r):
                rate, acc, text = generate(a.flint, a.model, PLAIN_PROMPT, spec, a.max_tokens, [])
                runs[name].append((rate, acc))
                texts.setdefault(name, text)
        alone = [generate(a.flint, a.draft, PLAIN_PROMPT, None, a.max_tokens, [])[0] for _ in range(a.reps)]
        section("Single stream, greedy, with a draft model", [(n, runs[n]) for n, _ in cfgs], a.reps)
        print(f"\nOutput identical in every configuration: {'yes' if len(set(texts.values())) == 1 else 'NO'}.")
        print(f"The draft model alone: {statistics.median(alone):.1f} tok/s (median of {', '.join(f'{x:.1f}' for x in alone)}).")
    if "parallel" in sections:
        for n in a.parallel:
            parallel(a, n)


def parallel(a, n):
    cfgs = [("plain", None), ("ngram k=4", ngram(4))]
    runs = {name: [] for name, _ in cfgs}
    for r in range(a.reps):
        for name, spec in ordered(cfgs, r):
            rate, acc = throughput(a.flint, a.model, spec, n)
            runs[name].append((rate, (0.0, acc[0], acc[1]) if acc else None))
    base = statistics.median(r[0] for r in runs["plain"])
    print(f"\n### {n} parallel sequences (128-token random prompts, 128 tokens each, greedy)\n")
    print("| configuration | decode phase tok/s (median) | runs | ratio | accepted / drafted |")
    print("|---|---:|---|---:|---:|")
    for name, _ in cfgs:
        med = statistics.median(r[0] for r in runs[name])
        acc = runs[name][-1][1]
        acc_s = f"{acc[1]} / {acc[2]}" if acc else "–"
        print(f"| {name} | {med:.1f} | {', '.join(f'{r[0]:.1f}' for r in runs[name])} | {med / base:.2f} | {acc_s} |")


if __name__ == "__main__":
    main()
