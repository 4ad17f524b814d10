#!/usr/bin/env python3
"""Embeddings against prefill on the same server: `flint serve --runner pooling --model DIR`, then
for each NxL (N inputs of L random token ids) the median of 3 times of one /v1/embeddings request
and of one /v1/completions request with the same shape and max_tokens 1 (its prefill and one
token). A ratio near 1 means pooling costs what prefill costs. Standard library only.

    python3 scripts/bench_embeddings.py target/release/flint MODEL_DIR 1x512 16x64
"""

import json, random, re, statistics, subprocess, sys, threading, time, urllib.request

flint, model = sys.argv[1], sys.argv[2]
p = subprocess.Popen([flint, "serve", "--port", "0", "--model", model, "--runner", "pooling"], stderr=subprocess.PIPE, text=True)
base = None
for line in p.stderr:
    m = re.search(r"listening on (http://\S+)", line)
    if m: base = m.group(1); break
threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r: return json.load(r)
while True:
    try:
        with urllib.request.urlopen(base + "/health") as r:
            if r.status == 200: break
    except Exception: time.sleep(0.5)
rng = random.Random(0)
def batch(n, L): return [[rng.randrange(1000, 100000) for _ in range(L)] for _ in range(n)]
post("/v1/embeddings", {"input": batch(1, 64)})
for n, L in [(int(a), int(b)) for a, b in (x.split("x") for x in sys.argv[3:])]:
    emb, pre = [], []
    for rep in range(3):
        ids = batch(n, L)
        t = time.time(); post("/v1/embeddings", {"input": ids}); emb.append(time.time() - t)
        ids = batch(n, L)
        t = time.time(); post("/v1/completions", {"prompt": ids, "max_tokens": 1}); pre.append(time.time() - t)
    e, c = statistics.median(emb), statistics.median(pre)
    print(f"{n} x {L} tokens: embeddings {e:.2f} s ({n*L/e:.0f} tok/s), completions max_tokens 1 {c:.2f} s ({n*L/c:.0f} tok/s), ratio {c/e:.2f}")
p.terminate()
