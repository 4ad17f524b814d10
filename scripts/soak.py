#!/usr/bin/env python3
"""Soak test of `flint serve`: minutes of mixed, concurrent, partly abandoned traffic, then checks
that the server is exactly where it started.

Starts the binary on port 0 (the built-in demo model unless --server-args names one) and runs
--clients threads for --duration seconds over a weighted mix: streamed chat/completions that we
cut off after a few chunks (FIN or RST), non-streamed requests with n in 1..4 and prompt lists,
embeddings (the server runs `--runner pooling` unless --server-args names a runner),
requests abandoned before the answer, tokenize/detokenize, /metrics, /v1/models, malformed
bodies and generated hostile constraints (deep grammar and `$ref` chains, wide objects and
alternations, nested repeats, big choice lists, nested tool schemas, forced calls with a format). Fails on any 5xx, malformed response (bad JSON shape, error envelope missing, a stream we
did not cut that lacks `data: [DONE]`), a server crash or panic; on greedy probes whose output
changes during the run; when running/waiting/KV usage do not return to 0 or the admission count
leaked; when peak RSS passes --rss-limit-mb; or when SIGTERM does not stop the server.
Standard library only.  Usage: scripts/soak.sh [--duration 60] [--clients 16] ...
"""

import argparse, collections, http.client, json, os, random, re, shlex, signal, socket
import statistics, struct, subprocess, sys, threading, time

MT = 16  # max_tokens of load requests: the demo model is slow in debug builds
WORDS = "the quick brown fox jumps over lazy dogs while rust servers stream tokens to many clients".split()
FAILURES, LOCK = [], threading.Lock()
COUNTS = collections.Counter()  # (endpoint, status) -> requests
LAST = threading.local()  # a worker's last status, to back off after a 429 as a real client would


def fail(what):
    with LOCK:
        FAILURES.append(what)
    print(f"FAIL: {what}", file=sys.stderr, flush=True)


def count(endpoint, status, n=1):
    with LOCK:
        COUNTS[(endpoint, status)] += n


class Server:
    def __init__(self, flint, args):
        env = dict(os.environ, RUST_LOG="info", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([flint, "serve", "--port", "0", *args], stderr=subprocess.PIPE, text=True,
                                     env=env, errors="replace")
        self.tail, self.panics, self.host, self.port = collections.deque(maxlen=40), [], None, None
        found = threading.Event()

        def drain():  # keep reading stderr so the server never blocks on a full pipe
            for line in self.proc.stderr:
                self.tail.append(line.rstrip())
                if "panicked" in line:
                    self.panics.append(line.strip())
                m = re.search(r"listening on http://([^\s:]+):(\d+)", line)
                if m and not found.is_set():
                    self.host, self.port = m.group(1), int(m.group(2))
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(60) or self.port is None:
            sys.exit("flint serve did not start:\n" + "\n".join(self.tail))

    def rss_kb(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                vals = dict(l.split(":", 1) for l in f if l.startswith(("VmRSS", "VmHWM")))
            return int(vals["VmRSS"].split()[0]), int(vals["VmHWM"].split()[0])
        except (OSError, KeyError, ValueError):
            return None


class Client:
    def __init__(self, srv, api_key):
        self.srv = srv
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def conn(self, timeout=120):
        c = http.client.HTTPConnection(self.srv.host, self.srv.port, timeout=timeout)
        c.connect()
        return c

    def call(self, method, path, body=None, raw=None):
        """One request on its own connection: (status, parsed JSON or text, seconds)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        t0, c = time.monotonic(), self.conn()
        try:
            c.request(method, path, data, self.headers)
            r = c.getresponse()
            text = r.read().decode("utf-8", "replace")
            ctype = r.getheader("Content-Type", "")
        finally:
            c.close()
        return r.status, (json.loads(text) if "json" in ctype else text), time.monotonic() - t0

    def patiently(self, fn, *args):
        """A request that must get through: 429 (over capacity, expected under overload) is retried."""
        deadline = time.monotonic() + 300
        while True:
            out = fn(*args)
            if out[0] != 429 or time.monotonic() > deadline:
                return out
            count("retried_429", 429)
            time.sleep(0.25)

    def stream(self, path, body, cut_after=None, rst=False):
        """A streamed request read chunk by chunk, cut off after `cut_after` data events if given.
        Returns (status, events as parsed JSON, saw [DONE], we cut it)."""
        c, r = self.conn(), None
        sock = c.sock  # kept: http.client may drop its own reference once the response begins
        try:
            c.request("POST", path, json.dumps(body).encode(), self.headers)
            r = c.getresponse()
            if r.status != 200:
                text = r.read().decode("utf-8", "replace")
                return r.status, [json.loads(text) if "json" in r.getheader("Content-Type", "") else text], False, False
            if not r.getheader("Content-Type", "").startswith("text/event-stream"):
                fail(f"{path}: stream answered with Content-Type {r.getheader('Content-Type')}")
            events, done = [], False
            for line in r:
                line = line.decode("utf-8", "replace").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue  # blank separators and keep-alive comments
                payload = line[5:].strip()
                if done:
                    fail(f"{path}: data after [DONE]: {payload[:100]}")
                if payload == "[DONE]":
                    done = True
                    continue
                events.append(json.loads(payload))
                if cut_after is not None and len(events) >= cut_after:
                    if rst:  # SO_LINGER 0: close sends RST, as a killed client would
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return 200, events, done, True
            return 200, events, done, False
        finally:  # the response holds a reference to the socket: close all three
            if r is not None:
                r.close()
            c.close()
            sock.close()

    def abandon(self, path, body, after):
        """Send a request and hang up before the answer (a client timing out)."""
        c = self.conn()
        c.request("POST", path, json.dumps(body).encode(), self.headers)
        time.sleep(after)
        c.close()

    def metrics(self):
        status, text, _ = self.call("GET", "/metrics")
        if status != 200:
            fail(f"/metrics answered {status}")
            return {}
        out = {}
        for line in text.splitlines():
            m = re.match(r'^([a-z_:]+)(\{[^}]*\})? (\S+)$', line)
            if m and "_bucket" not in m.group(1):
                reason = re.search(r'(?:finished_reason|reason)="([^"]+)"', m.group(2) or "")
                out[m.group(1) + (f"[{reason.group(1)}]" if reason else "")] = float(m.group(3))
        return out


def is_envelope(v):
    e = v.get("error") if isinstance(v, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str) \
        and "param" in e and "code" in e


def check_status(endpoint, status, payload):
    """Count the status; anything but 200 must be a 4xx in OpenAI's envelope. Returns ok-to-validate."""
    count(endpoint, status)
    LAST.status = status
    if status >= 500:
        fail(f"{endpoint}: {status} {str(payload)[:200]}")
    elif status != 200 and not is_envelope(payload):
        fail(f"{endpoint}: {status} without the error envelope: {str(payload)[:200]}")
    return status == 200


def check_usage(endpoint, usage, want_tokens):
    """With ignore_eos every choice runs to max_tokens, so usage must count exactly that."""
    if not isinstance(usage, dict) or (want_tokens is not None and usage.get("completion_tokens") != want_tokens):
        fail(f"{endpoint}: usage {usage}, want {want_tokens} completion tokens")


def check_stream(endpoint, events, done, cut, want_choices, chat, body):
    """Shape of every chunk; a stream we did not cut must finish every choice, report usage if
    asked, and end in [DONE]."""
    finished = set()
    for ev in events:
        if is_envelope(ev) or not isinstance(ev.get("choices"), list):
            return fail(f"{endpoint}: bad stream event {str(ev)[:200]}")
        if ev.get("object") != ("chat.completion.chunk" if chat else "text_completion"):
            return fail(f"{endpoint}: stream event object {ev.get('object')!r}")
        for ch in ev["choices"]:
            if not isinstance(ch.get("index"), int) or (chat and not isinstance(ch.get("delta"), dict)) \
                    or (not chat and not isinstance(ch.get("text"), str)):
                return fail(f"{endpoint}: bad choice {str(ch)[:200]}")
            if ch.get("finish_reason"):
                finished.add(ch["index"])
    if not cut:
        if not done:
            fail(f"{endpoint}: stream ended without data: [DONE] ({len(events)} events)")
        elif finished != set(range(want_choices)):
            fail(f"{endpoint}: finished choices {sorted(finished)}, want 0..{want_choices - 1}")
        elif body["stream_options"]["include_usage"]:
            check_usage(endpoint, events[-1].get("usage"), want_choices * body["max_tokens"] if body["ignore_eos"] else None)


def check_json(endpoint, v, want_choices, chat, body):
    ok = isinstance(v, dict) and v.get("object") == ("chat.completion" if chat else "text_completion") \
        and isinstance(v.get("choices"), list) and len(v["choices"]) == want_choices \
        and isinstance(v.get("usage"), dict) \
        and [c.get("index") for c in v["choices"]] == list(range(want_choices)) \
        and all(c.get("finish_reason") in ("stop", "length") for c in v["choices"]) \
        and all(isinstance(c["message"].get("content"), str) if chat else isinstance(c.get("text"), str)
                for c in v["choices"])
    if not ok:
        return fail(f"{endpoint}: unexpected JSON {str(v)[:300]}")
    check_usage(endpoint, v["usage"], want_choices * body["max_tokens"] if body["ignore_eos"] else None)


def prompt(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))


# Malformed requests: each must get a 4xx with the envelope, never a 5xx or a hang.
MALFORMED = [
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"'),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "n": 0}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "n": 100000}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": -1}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": "hot"}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "model": "no-such-model"}'),
    ("POST", "/v1/completions", b'{"prompt": [[1, -5]], "max_tokens": 2}'),
    ("POST", "/v1/completions", b"\xff\xfe\x00garbage"),
    ("POST", "/v1/completions", b"[1, 2, 3]"),
    ("POST", "/detokenize", b'{"tokens": [-1]}'),
    ("POST", "/tokenize", b'{"prompt": "a", "messages": []}'),
    ("POST", "/v1/no-such-route", b"{}"),
    ("POST", "/v1/chat/completions", b'{"messages": [' + b",".join([b'{"role":"user","content":"x"}'] * 9000) + b"]}"),
    ("POST", "/detokenize", b"{}"),
    ("POST", "/v1/completions", b'{"prompt": "x", "logit_bias": {"+5": 1}}'),
    ("GET", "/v1/chat/completions", None),
]


def name(rng, i):
    """A random identifier that is unique for `i` (and never a schema keyword)."""
    return "_" + "".join(rng.choice("abcdefghij") for _ in range(2)) + str(i)


def hostile_constraint(rng):
    """A generated constraint of the shapes that once crashed the server, ran unbounded or failed
    mid-generation: (extra body fields, whether a 200 is possible). Every one must end in a 4xx
    with the envelope or a well-formed 200, with the server alive."""
    shape = rng.choice(["lark_chain", "ref_chain", "optional", "alternatives", "repeat", "choice", "nested_tool",
                        "forced_with_format"])
    if shape == "lark_chain":
        n = rng.randint(4000, 9000)
        names = [name(rng, i) for i in range(n + 1)]
        rules = "".join(f'{names[i]}: {names[i + 1]} | "{rng.choice(WORDS)}"\n' for i in range(n))
        return {"structured_outputs": {"grammar": f"start: {names[0]}\n{rules}{names[n]}: \"end\"\n"}}, False
    if shape == "ref_chain":
        n = rng.randint(2000, 8000)
        names = [name(rng, i) for i in range(n + 1)]
        schema = {names[i]: {"$ref": f"#/{names[i + 1]}"} for i in range(n)}
        schema[names[n]] = {"type": "string"}
        schema["$ref"] = f"#/{names[0]}"
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, False
    if shape == "optional":
        props = {name(rng, i): {"type": rng.choice(["integer", "string", "boolean"])} for i in range(rng.randint(500, 4000))}
        return {"guided_json": {"type": "object", "properties": props}}, False
    if shape == "alternatives":
        words = " | ".join(f'"{rng.choice(WORDS)}{i}"' for i in range(rng.randint(2500, 25000)))
        return {"structured_outputs": {"grammar": "start: " + words}}, False
    if shape == "repeat":
        # Small products compile and run (the output is a prefix of abab…); large ones are refused.
        return {"structured_outputs": {"regex": f"(ab){{{rng.randint(50, 1000)}}}{{{rng.randint(50, 1000)}}}"}}, True
    if shape == "choice":
        return {"structured_outputs": {"choice": [f"{rng.choice(WORDS)} {i}" for i in range(rng.randint(1, 4096))]}}, True
    # Tools whose parameters nest models through `$defs`, as Pydantic writes them.
    depth = rng.randint(1, 6)
    defs = {f"M{d}": {"type": "object", "properties": {"v": {"enum": WORDS[:3]}, "next": {"$ref": f"#/$defs/M{d + 1}"}},
                      "required": ["v", "next"], "additionalProperties": False} for d in range(depth)}
    defs[f"M{depth}"] = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["n"], "additionalProperties": False}
    params = {"type": "object", "properties": {"root": {"$ref": "#/$defs/M0"}}, "required": ["root"], "$defs": defs}
    tool = {"type": "function", "function": {"name": "nested", "parameters": params, "strict": True}}
    extra = {"tools": [tool], "tool_choice": rng.choice(["required", {"type": "function", "function": {"name": "nested"}}])}
    if shape == "forced_with_format":
        extra["response_format"] = {"type": "json_object"}
    return extra, True


def one_request(cl, rng, stats):
    """One request of the weighted mix, validated."""
    kind = rng.choices(["chat_stream", "cmpl_stream", "chat", "cmpl", "abandon", "tokenize", "metrics",
                        "models", "malformed", "hostile", "embed"], [22, 18, 12, 12, 5, 8, 3, 3, 8, 4, 4])[0]
    temp = rng.choice([0.0, 0.7, 1.0])
    common = {"max_tokens": rng.randint(2, MT), "temperature": temp, "seed": rng.randint(0, 1 << 30),
              "ignore_eos": rng.random() < 0.5}
    if kind in ("chat_stream", "cmpl_stream"):
        chat, n = kind == "chat_stream", rng.randint(1, 3)
        prompts = [prompt(rng) for _ in range(1 if chat else rng.randint(1, 2))]
        body = dict(common, n=n, stream=True, stream_options={"include_usage": rng.random() < 0.5})
        body.update({"messages": [{"role": "user", "content": prompts[0]}]} if chat else
                    {"prompt": prompts if len(prompts) > 1 else prompts[0], "logprobs": rng.choice([None, 2])})
        cut = rng.randint(1, 6) if rng.random() < 0.5 else None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, events, done, was_cut = cl.stream(path, body, cut, rst=rng.random() < 0.5)
        if check_status(kind, status, events[0] if events and status != 200 else {}):
            check_stream(kind, events, done, was_cut, n * len(prompts), chat, body)
        if was_cut:
            stats["disconnects"] += 1
    elif kind in ("chat", "cmpl"):
        chat, n = kind == "chat", rng.randint(1, 4)
        prompts = [prompt(rng) for _ in range(1 if chat else rng.randint(1, 3))]
        body = dict(common, n=n)
        body.update({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompts[0]}]}
                    if chat else {"prompt": prompts, "echo": rng.random() < 0.3, "logprobs": rng.choice([None, 1])})
        status, v, _ = cl.call("POST", "/v1/chat/completions" if chat else "/v1/completions", body)
        if check_status(kind, status, v):
            check_json(kind, v, n * len(prompts), chat, body)
    elif kind == "abandon":
        chat = rng.random() < 0.5
        body = dict(common, n=rng.randint(1, 4), max_tokens=MT)
        body.update({"messages": [{"role": "user", "content": prompt(rng)}]} if chat else {"prompt": prompt(rng)})
        cl.abandon("/v1/chat/completions" if chat else "/v1/completions", body, rng.uniform(0, 0.05))
        count(kind, "hung-up")
        stats["disconnects"] += 1
    elif kind == "tokenize":
        text = prompt(rng)
        status, v, _ = cl.call("POST", "/tokenize", {"prompt": text})
        if check_status(kind, status, v):
            if not isinstance(v.get("tokens"), list) or v.get("count") != len(v["tokens"]):
                return fail(f"/tokenize: unexpected JSON {str(v)[:200]}")
            status, d, _ = cl.call("POST", "/detokenize", {"tokens": v["tokens"]})
            if check_status("detokenize", status, d) and d.get("prompt") != text:
                fail(f"/detokenize round trip: {text!r} -> {d.get('prompt')!r}")
    elif kind == "metrics":
        status, text, _ = cl.call("GET", "/metrics")
        if check_status(kind, status, text) and "vllm:num_requests_running" not in text:
            fail("/metrics lacks vllm:num_requests_running")
    elif kind == "embed":
        # The server runs --runner pooling: embeddings share the engine with everything above.
        inputs = [prompt(rng) for _ in range(rng.randint(1, 4))]
        body = {"input": inputs if len(inputs) > 1 else inputs[0], "dimensions": rng.choice([None, 16])}
        status, v, _ = cl.call("POST", "/v1/embeddings", {k: x for k, x in body.items() if x is not None})
        if check_status(kind, status, v):
            data = v.get("data") if isinstance(v, dict) else None
            if not (isinstance(data, list) and len(data) == len(inputs)
                    and all(abs(sum(x * x for x in d["embedding"]) - 1) < 1e-3 for d in data)):
                fail(f"/v1/embeddings: unexpected answer {str(v)[:200]}")
    elif kind == "models":
        status, v, _ = cl.call("GET", "/v1/models")
        if check_status(kind, status, v) and not (v.get("object") == "list" and v["data"][0].get("id")):
            fail(f"/v1/models: unexpected JSON {str(v)[:200]}")
    elif kind == "hostile":
        extra, may_succeed = hostile_constraint(rng)
        body = dict(extra, messages=[{"role": "user", "content": prompt(rng)}], max_tokens=120)
        status, v, _ = cl.call("POST", "/v1/chat/completions", body)
        count(kind, status)
        if 400 <= status < 500 and is_envelope(v):
            return
        if status == 200 and may_succeed and isinstance(v, dict) and isinstance(v.get("choices"), list):
            msg = v["choices"][0].get("message", {})
            if "tools" in body and v["choices"][0].get("finish_reason") == "tool_calls":
                json.loads(msg["tool_calls"][0]["function"]["arguments"])
            elif "choice" in body.get("structured_outputs", {}) and v["choices"][0].get("finish_reason") == "stop" \
                    and msg.get("content") not in body["structured_outputs"]["choice"]:
                fail(f"hostile choice: {msg.get('content')!r} is not one of the choices")
            elif "regex" in body.get("structured_outputs", {}) and set(msg.get("content") or "ab") - {"a", "b"}:
                fail(f"hostile regex: {msg.get('content')!r:.80} is not a run of ab")
            return
        fail(f"hostile {list(extra)}: got {status} {str(v)[:200]}")
    else:
        method, path, raw = rng.choice(MALFORMED)
        status, v, _ = cl.call(method, path, raw=raw)
        count(kind, status)
        if not (400 <= status < 500 and is_envelope(v)):
            fail(f"malformed {method} {path} {raw!r:.60}: got {status} {str(v)[:200]}")


def worker(cl, seed, stop, srv):
    rng, stats = random.Random(seed), collections.Counter()
    while not stop.is_set():
        try:
            LAST.status = None
            one_request(cl, rng, stats)
            if LAST.status == 429:
                time.sleep(rng.uniform(0.05, 0.5))
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            time.sleep(0.5)  # time for a dying server to be reaped, so the crash is reported once
            if srv.proc.poll() is None:
                fail(f"transport error: {type(e).__name__}: {e}")
            stop.set()
    count("disconnects", "by us", stats["disconnects"])


def greedy_probes(cl):
    """Fixed temperature-0 requests, reduced to what must not change: texts and finish reasons."""
    chat_msgs = [{"role": "user", "content": "Write a haiku about rust."}]
    base = {"max_tokens": MT, "temperature": 0, "ignore_eos": True}
    out = []
    for path, body in [("/v1/completions", dict(base, prompt="The capital of France is")),
                       ("/v1/completions", dict(base, prompt=["Once upon a time", "1, 2, 3,"])),
                       ("/v1/chat/completions", dict(base, messages=chat_msgs, n=2))]:
        status, v, _ = cl.patiently(cl.call, "POST", path, body)
        chat = "messages" in body
        out.append([status] + [(c["message"]["content"] if chat else c["text"], c["finish_reason"])
                               for c in (v.get("choices", []) if isinstance(v, dict) else [])])
        status, events, done, _ = cl.patiently(cl.stream, path, dict(body, stream=True))
        texts = collections.defaultdict(str)
        for ev in events:
            for c in ev.get("choices", []):
                texts[f"text{c['index']}"] += c.get("text") or c.get("delta", {}).get("content") or ""
                texts[f"finish{c['index']}"] += c.get("finish_reason") or ""
        out.append([status, done, sorted(texts.items())])
    return [json.dumps(o, ensure_ascii=False) for o in out]


def same_as(baseline, now, when):
    for i, (b, n) in enumerate(zip(baseline, now)):
        if b != n:
            fail(f"greedy probe {i} changed {when}:\n    was {b[:300]}\n    now {n[:300]}")


def pct(xs, q):
    return statistics.quantiles(xs, n=100)[q - 1] * 1000 if len(xs) >= 2 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flint", default="target/debug/flint")
    ap.add_argument("--duration", type=float, default=60, help="seconds of load")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    # The demo model at default settings: ~220 MiB at start, plus its 128 MiB KV pool as blocks get
    # touched, plus transients; 430 MiB peak measured over 4 minutes (debug build, 16 clients).
    ap.add_argument("--rss-limit-mb", type=float, default=768, help="bound on peak RSS (VmHWM), MiB")
    ap.add_argument("--server-args", default="", help='extra `flint serve` arguments, e.g. "--max-num-seqs 8"')
    ap.add_argument("--api-key", default=None, help="passed to the server and sent by every client")
    ap.add_argument("--probe-every", type=float, default=10, help="seconds between greedy re-checks")
    ap.add_argument("--idle-timeout", type=float, default=30, help="seconds for the gauges to return to 0")
    a = ap.parse_args()
    server_args = shlex.split(a.server_args) + (["--api-key", a.api_key] if a.api_key else [])
    if "--runner" not in server_args:
        server_args += ["--runner", "pooling"]  # embeddings in the mix; the server still generates
    # The admission check at the end sends one request of the whole admission limit: let one
    # request hold that much (by default it may hold half).
    if "--max-seqs-per-request" not in server_args:
        opt = lambda name, dflt: int(server_args[server_args.index(name) + 1]) if name in server_args else dflt
        server_args += ["--max-seqs-per-request", str(opt("--max-num-seqs", 64) + opt("--max-queued-requests", 256))]
    srv = Server(a.flint, server_args)
    cl = Client(srv, a.api_key)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # /health turns 200 once the model is loaded
        try:
            if cl.call("GET", "/health")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        sys.exit("flint serve never became healthy:\n" + "\n".join(srv.tail))
    rss_start = srv.rss_kb()
    baseline, probe_runs = greedy_probes(cl), [1]
    stop, latencies, rss_peak, rss_trace = threading.Event(), [], 0, []
    threads = [threading.Thread(target=worker, args=(cl, a.seed * 1000 + i, stop, srv)) for i in range(a.clients)]

    def greedy_loop():  # its own thread: under load one round of probes takes many seconds
        while not stop.wait(a.probe_every):
            try:
                same_as(baseline, greedy_probes(cl), f"under load (check {probe_runs[0] + 1})")
            except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
                if srv.proc.poll() is None:
                    fail(f"greedy probe request failed: {e}")
            probe_runs[0] += 1

    threads.append(threading.Thread(target=greedy_loop))
    t_start = time.monotonic()
    for t in threads:
        t.start()
    # The monitor (this thread): RSS samples and a small latency probe about once a second.
    while time.monotonic() - t_start < a.duration and not stop.is_set():
        if srv.proc.poll() is not None:
            break
        rss = srv.rss_kb()
        if rss:
            rss_peak = max(rss_peak, *rss)
            rss_trace.append((time.monotonic() - t_start, rss[0]))
        try:
            status, _, secs = cl.call("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
            count("latency_probe", status)
            if status == 200:
                latencies.append(secs)
        except (OSError, http.client.HTTPException) as e:
            if srv.proc.poll() is None:
                fail(f"latency probe failed: {e}")
        time.sleep(1)
    stop.set()
    t_stop = time.monotonic()
    for t in threads:
        t.join(timeout=180)
    elapsed, drain_secs = t_stop - t_start, time.monotonic() - t_stop
    alive = srv.proc.poll() is None
    end_metrics, idle_secs = {}, None
    if alive:
        same_as(baseline, greedy_probes(cl), "at the end")
        probe_runs[0] += 1
        # Accounting: the engine gauges must drain to 0 once every client is gone.
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.idle_timeout:
            end_metrics = cl.metrics()
            if all(end_metrics.get(k, 0) == 0 for k in
                   ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")):
                idle_secs = time.monotonic() - t0
                break
            time.sleep(0.5)
        else:
            fail("server did not go idle: " + ", ".join(f"{k}={end_metrics.get(k)}" for k in (
                "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")))
        # The admission counter is not exported: a request of exactly the admission limit
        # (max-num-seqs + max-queued-requests sequences) is accepted only if nothing leaked.
        opt = lambda name, dflt: int(server_args[server_args.index(name) + 1]) if name in server_args else dflt
        limit = opt("--max-num-seqs", 64) + opt("--max-queued-requests", 256)
        status, v, _ = cl.call("POST", "/v1/completions", {"prompt": ["x"] * limit, "max_tokens": 1})
        if status != 200:
            fail(f"admission leak: a {limit}-sequence request got {status} {str(v)[:200]}")
        rss = srv.rss_kb()
    else:
        fail(f"server crashed (exit status {srv.proc.returncode})")
        rss = None
    if srv.panics:
        fail(f"server panicked: {srv.panics[0]}")
    peak_kb = max(rss_peak, rss[1] if rss else 0)
    if peak_kb / 1024 > a.rss_limit_mb:
        fail(f"peak RSS {peak_kb / 1024:.0f} MiB exceeds --rss-limit-mb {a.rss_limit_mb:.0f}")
    exit_status = None
    if alive:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            exit_status = srv.proc.wait(timeout=40)
            if exit_status != 0:
                fail(f"server exited with status {exit_status} after SIGTERM")
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            fail("server did not exit within 40 s of SIGTERM")

    print(f"\n=== soak: {a.clients} clients, {elapsed:.0f} s (+{drain_secs:.1f} s for the last requests), "
          f"seed {a.seed}, server args {server_args} ===")
    total = sum(v for (k, _), v in COUNTS.items() if k != "disconnects")
    print(f"requests: {total} ({total / elapsed:.1f}/s); by endpoint and status:")
    for (k, s), v in sorted(COUNTS.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        print(f"  {k:<14} {s!s:<8} {v}")
    print(f"latency probe (completion, 1 token): n={len(latencies)} p50 {pct(latencies, 50):.1f} ms, "
          f"p95 {pct(latencies, 95):.1f} ms")
    print(f"greedy probes: {probe_runs[0]} checks, {'unchanged' if not any('greedy' in f for f in FAILURES) else 'CHANGED'}")
    print(f"RSS: start {rss_start[0] / 1024 if rss_start else 0:.0f} MiB, peak {peak_kb / 1024:.0f} MiB "
          f"(limit {a.rss_limit_mb:.0f}), end {rss[0] / 1024 if rss else 0:.0f} MiB")
    step = max(1, len(rss_trace) // 8)  # a flat tail means no leak; a steady climb is worth a longer run
    print("RSS over the run (s: MiB): " + ", ".join(f"{t:.0f}: {kb / 1024:.0f}" for t, kb in rss_trace[::step]))
    print(f"idle after {idle_secs:.1f} s" if idle_secs is not None else "idle: NOT reached")
    for k, v in sorted(end_metrics.items()):
        if k.startswith(("vllm:num_requests", "vllm:kv_cache_usage", "vllm:request_success", "flint:request_failure",
                         "vllm:num_preemptions", "vllm:generation_tokens", "vllm:prefix_cache")):
            print(f"  {k} {v:g}")
    print(f"SIGTERM: exit status {exit_status}")
    if FAILURES:
        print(f"\nSOAK FAILED: {len(FAILURES)} failure(s); first ones:", file=sys.stderr)
        for f in FAILURES[:15]:
            print(f"  - {f}", file=sys.stderr)
        print("server log tail:\n  " + "\n  ".join(list(srv.tail)[-15:]), file=sys.stderr)
        sys.exit(1)
    print("SOAK PASSED")


if __name__ == "__main__":
    main()
