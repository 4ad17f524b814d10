#!/usr/bin/env python3
"""What one hostile request costs everyone else, as figures (no assertions; compare two builds
side by side in one run). Starts BINARY's `serve` (built-in demo model) on a free port, then:
RSS before and after one and seven 15 MB /tokenize requests (VmRSS idle, VmHWM peak), /health and
a small chat while two of them run, a 50,000-prompt completions request while small chats arrive,
and a 15,000-entry stop list. Standard library only.

    python3 scripts/hostile_figures.py target/debug/flint new [OLD_BINARY old ...]
"""

import json, os, re, socket, statistics, subprocess, sys, threading, time, urllib.error, urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(binary, label):
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([binary, "serve", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(base + "/health").status == 200:
                break
        except Exception:
            time.sleep(0.1)

    def mem():
        status = open(f"/proc/{proc.pid}/status").read()
        return {k: int(re.search(k + r":\s+(\d+)", status).group(1)) // 1024 for k in ("VmRSS", "VmHWM")}

    def post(path, body):
        req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
        t0 = time.time()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                code = r.status
                r.read()
        except urllib.error.HTTPError as e:
            code = e.code
            e.read()
        except Exception as e:  # a timeout or a dropped connection is a figure too
            code = type(e).__name__
        return code, round(time.time() - t0, 3)

    small = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    big = json.dumps({"prompt": "lorem ipsum dolor sit amet " * 555_000}).encode()
    out = {"label": label, "small_chat_alone_s": statistics.median(post("/v1/chat/completions", small)[1] for _ in range(5))}
    out["rss_mb_start"] = mem()
    out["tokenize_15MB"] = post("/tokenize", big)
    out["rss_mb_after_1"] = mem()
    for _ in range(6):
        post("/tokenize", big)
    time.sleep(1)
    out["rss_mb_idle_after_7"] = mem()
    running = []
    threads = [threading.Thread(target=lambda: running.append(post("/tokenize", big))) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.time()
    urllib.request.urlopen(base + "/health").read()
    out["health_s_during_2_big_tokenize"] = round(time.time() - t0, 3)
    out["small_chat_during_2_big_tokenize"] = post("/v1/chat/completions", small)
    for t in threads:
        t.join()
    many = json.dumps({"prompt": [[5, 6, 7]] * 50_000, "max_tokens": 1}).encode()
    worst = []
    t = threading.Thread(target=lambda: worst.append(post("/v1/completions", many)))
    t.start()
    time.sleep(0.5)
    out["small_chats_during_50000_prompts"] = [post("/v1/chat/completions", small) for _ in range(3)]
    t.join(timeout=120)
    out["50000_prompts"] = worst or "still running after 120 s"
    stops = json.dumps({"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1024] * 15_000}).encode()
    out["stop_list_15000"] = post("/v1/completions", stops)
    proc.terminate()
    proc.wait()
    print(json.dumps(out))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or len(args) % 2:
        sys.exit(__doc__)
    for i in range(0, len(args), 2):
        measure(args[i], args[i + 1])
