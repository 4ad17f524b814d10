#!/usr/bin/env python3
"""The second hardening round's findings as figures, measured as the probe measured them: a
neighbour streaming while the hostile requests run (no assertions; compare two builds side by side
in one run). Starts BINARY's `serve` (built-in demo model) on a free port for each build, then:

- the crash: a ~12 KB Lark chain of 800 rules and a `$ref` chain of 1,000 `$defs` (status, alive);
- 16 concurrent distinct ~175 KB schemas while a neighbour streams: its tok/s before, during, and in
  the 10 s after the last answer, and the 16 statuses (two shapes: 5,000 optional properties, which
  used to compile for seconds and fail at generation, and 3,500 required ones, which compile);
- two 13.6 MB bodies of 420,000 messages: status, seconds, /health latency meanwhile, RSS peak;
- choice of 3,000, regex a{1000}{1000}, a Lark rule of 20,000 alternatives: status codes;
- a forced tool_choice with response_format; 320 prompts in one request, then 20 small requests
  from others; the number of `vllm:num_requests_running` series; the small refusals.

    python3 scripts/hostile_figures_round2.py target/release/flint new [OLD_BINARY old ...]
"""

import json, os, re, socket, subprocess, sys, threading, time, urllib.error, urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, *args):
        self.port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([binary, "serve", "--port", str(self.port), *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env)
        self.base = f"http://127.0.0.1:{self.port}"
        for _ in range(1200):
            if self.alive():
                return
            time.sleep(0.1)

    def alive(self):
        try:
            return urllib.request.urlopen(self.base + "/health", timeout=30).status == 200
        except Exception:
            return False

    def mem_mb(self):
        status = open(f"/proc/{self.proc.pid}/status").read()
        return {k: int(re.search(k + r":\s+(\d+)", status).group(1)) // 1024 for k in ("VmRSS", "VmHWM")}

    def post(self, path, body, timeout=300):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        t0 = time.time()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                code, text = r.status, r.read()
        except urllib.error.HTTPError as e:
            code, text = e.code, e.read()
        except Exception as e:  # a timeout or a dropped connection is a figure too
            code, text = type(e).__name__, b""
        return code, round(time.time() - t0, 3), text

    def neighbour(self, stop, stamps):
        """Stream completions back to back until `stop` is set, appending each token's arrival."""
        body = json.dumps({"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
        while not stop.is_set():
            req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    for line in r:
                        if line.startswith(b"data: {"):
                            stamps.append(time.time())
                        if stop.is_set():
                            break
            except Exception:
                time.sleep(0.1)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def chain_grammar(n):
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(n)) + f'r{n}: "end"\n'


def ref_chain(n):
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def schema(k, required):
    """~175 KB of distinct properties: 5,000 optional ones, or 3,500 required ones."""
    names = [f"f{k}_{i}" for i in range(3500 if required else 5000)]
    s = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}
    if required:
        s["required"] = names
    return s


def rate(stamps, t0, t1):
    n = sum(1 for t in stamps if t0 <= t < t1)
    return round(n / (t1 - t0), 1) if t1 > t0 else None


def compiles_vs_neighbour(srv, required):
    """A neighbour streams; 16 distinct ~175 KB schemas arrive at once. Its tok/s before, while
    they are answered, and in the 10 s after the last answer (compiles left running show there)."""
    stop, stamps = threading.Event(), []
    neighbour = threading.Thread(target=srv.neighbour, args=(stop, stamps))
    neighbour.start()
    time.sleep(5)
    statuses, done = [], []
    size = len(json.dumps(schema(0, required)))

    def one(k):
        statuses.append(srv.post("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                     "guided_json": schema(k + (100 if required else 0), required)})[0])
        done.append(time.time())

    start = time.time()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last = max(done)
    time.sleep(10)
    stop.set()
    neighbour.join()
    return {"schema_kb": size // 1024, "statuses": {str(c): statuses.count(c) for c in set(statuses)},
            "seconds_to_last_answer": round(last - start, 1), "neighbour_tok_s_before": rate(stamps, start - 4, start),
            "neighbour_tok_s_during": rate(stamps, start, last),
            "neighbour_tok_s_10s_after": rate(stamps, last, last + 10)}


def measure(binary, label):
    out = {"label": label}
    srv = Server(binary)
    c = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                          "structured_outputs": {"grammar": chain_grammar(800)}})
    out["lark_chain_800"] = [c[0], "alive" if srv.alive() else "process gone"]
    if not srv.alive():
        srv.stop()
        srv = Server(binary)
    c = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                          "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": ref_chain(1000)}}})
    out["ref_chain_1000"] = [c[0], "alive" if srv.alive() else "process gone"]
    if not srv.alive():
        srv.stop()
        srv = Server(binary)
    out["16_schemas_6000_optional"] = compiles_vs_neighbour(srv, False)
    srv.stop()
    srv = Server(binary)
    out["16_schemas_6000_required"] = compiles_vs_neighbour(srv, True)
    srv.stop()

    srv = Server(binary)
    body = b'{"temperature": 9, "messages": [' + b",".join([b'{"role":"user","content":"x"}'] * 420_000) + b"]}"
    rss0 = srv.mem_mb()
    res = []
    threads = [threading.Thread(target=lambda: res.append(srv.post("/v1/chat/completions", body)[:2]))
               for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.time()
    srv.alive()
    health = round(time.time() - t0, 3)
    for t in threads:
        t.join()
    out["420k_messages_x2"] = {"status_seconds": res, "health_s_meanwhile": health, "rss_mb_before": rss0,
                               "rss_mb_after": srv.mem_mb(), "body_mb": round(len(body) / 2**20, 1)}
    words = " | ".join(f'"w{i}"' for i in range(20_000))
    out["status_choice_3000"] = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 16, "structured_outputs": {
        "choice": [f"answer {i}" for i in range(3000)]}})[0]
    out["status_regex_a1000x1000"] = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 8,
                                                                  "structured_outputs": {"regex": "a{1000}{1000}"}})[0]
    out["status_lark_20000_alternatives"] = srv.post("/v1/completions", {
        "prompt": "x", "max_tokens": 8, "structured_outputs": {"grammar": "start: " + words}})[0]
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    out["status_forced_tool_with_response_format"] = srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required", "max_tokens": 40,
        "response_format": {"type": "json_object"}})[0]
    metrics = urllib.request.urlopen(srv.base + "/metrics").read().decode()
    out["series_named_vllm_num_requests_running"] = sum(
        1 for l in metrics.splitlines() if l.startswith("vllm:num_requests_running"))
    out["status_detokenize_empty"] = srv.post("/detokenize", {})[0]
    out["status_logit_bias_plus5"] = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                                                  "logit_bias": {"+5": 1}})[0]
    out["status_continue_after_user"] = srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
        "add_generation_prompt": False, "max_tokens": 1})[0]
    try:
        out["status_tokenizer_info"] = urllib.request.urlopen(srv.base + "/tokenizer_info").status
    except urllib.error.HTTPError as e:
        out["status_tokenizer_info"] = e.code
    big = []
    # Distinct prompts (identical ones would come from the prefix cache at once).
    prompts = [[(97 * p + 13 * i) % 150_000 + 100 for i in range(2000)] for p in range(320)]
    t = threading.Thread(target=lambda: big.append(srv.post("/v1/completions", {
        "prompt": prompts, "max_tokens": 16})[:2]))
    t.start()
    time.sleep(1.0)
    t0 = time.time()
    small = [srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, timeout=600)[0] for _ in range(20)]
    out_small_seconds = round(time.time() - t0, 1)
    t.join()
    out["320_prompts_then_20_small"] = {"big": big, "small_statuses": {str(c): small.count(c) for c in set(small)},
                                        "seconds_for_the_20": out_small_seconds}
    srv.stop()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or len(args) % 2:
        sys.exit(__doc__)
    for i in range(0, len(args), 2):
        measure(args[i], args[i + 1])
