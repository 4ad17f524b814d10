#!/usr/bin/env python3
"""Conformance of `flint serve` with the official `openai` Python package.

Starts the real binary five times (the built-in demo model; a scripted model that answers with a
tool call; a scripted reasoning model behind --reasoning-parser; the demo behind an API key with a
one-slot queue; the demo as an embedding server, `--runner pooling`) and drives each with the SDK
the way applications do: chat and completions,
streaming with include_usage, n=2, stop strings, logprobs, echo, tool calls, structured outputs
(`chat.completions.parse` with a Pydantic model, forced tool calls), reasoning fields, the
Responses API (`responses.create` streaming and not, `responses.parse`, a function-call round
trip, reasoning items), `embeddings.create` (float and the SDK's default base64, `dimensions`, token
ids) and LangChain's `OpenAIEmbeddings`, and the error statuses as the SDK raises them. Exits non-zero on the first
failure. Run by .ci/run:  python scripts/openai_conformance.py --flint target/debug/flint
"""

import argparse
import array
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai
import pydantic
from typing import Literal

REASONING_SCRIPT = 'The user wants a city.</think>\n\n{"city": "Paris"}'
TOOL_SCRIPT = '<tool_call>{"name": "get_weather","arguments":{"city":"Paris"}}</tool_call>'
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
CHECKS = []


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    CHECKS.append(what)


class Server:
    def __init__(self, flint, *args):
        env = dict(os.environ, RUST_LOG="info", HF_HUB_OFFLINE="1")
        env.pop("FLINT_API_KEY", None)
        self.proc = subprocess.Popen([flint, "serve", "--port", "0", *args], stderr=subprocess.PIPE, text=True, env=env)
        self.base = None
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                m = re.search(r"listening on (http://\S+)", line)
                if m and self.base is None:
                    self.base = m.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(60):
            self.stop()
            raise RuntimeError("flint serve did not start")
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("flint serve never became ready")

    def client(self, **kw):
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.base + "/v1", max_retries=0, **kw)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def demo_checks(srv):
    c = srv.client()
    models = c.models.list()
    name = models.data[0].id
    check(name == "demo", "models.list returns the served name")
    try:
        c.embeddings.create(model=name, input="Hi")
        check(False, "a generation server must refuse embeddings")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "--runner pooling" in str(e), "embeddings on a generation server: 400 naming the flag")

    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    check(r.object == "chat.completion" and r.choices[0].message.role == "assistant", "chat completion shape")
    check(r.choices[0].finish_reason == "length", "finish_reason length at max_tokens")
    check(r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0, "usage counts")
    check(r.usage.prompt_tokens_details.cached_tokens is not None, "usage.prompt_tokens_details.cached_tokens")

    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
                                  temperature=0.9, seed=7)
    check(len(r.choices) == 2 and {ch.index for ch in r.choices} == {0, 1}, "n=2 gives two choices")
    check(r.usage.completion_tokens == 8, "n=2 usage sums both choices")

    # Seeded, so the run is deterministic and the streamed text can be compared with the whole one
    # (seed 8 gives 3- and 4-byte characters on the demo model).
    stream = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       stream=True, stream_options={"include_usage": True}, seed=8)
    chunks = list(stream)
    check(chunks[0].choices[0].delta.role == "assistant", "first streamed delta carries the role")
    check(len({ch.id for ch in chunks}) == 1, "one id on every chunk")
    check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6, "final usage chunk with empty choices")
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    check(finishes == ["length"], "finish_reason once, on the last content chunk")
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    whole = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                      seed=8).choices[0].message.content
    # The random demo model can emit byte sequences that are not UTF-8; a full decode shows them
    # as U+FFFD. Streaming must add no other: its chunks join to exactly the non-streamed text.
    check(text == whole, "streamed chunks join to the non-streamed text (no character broken across chunks)")

    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                  logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    check(len(lp) == 3 and len(lp[0].top_logprobs) == 2 and lp[0].logprob <= 0, "chat logprobs and top_logprobs")

    r = c.completions.create(model=name, prompt="Hello world", max_tokens=3, logprobs=2, echo=True, temperature=0)
    ch = r.choices[0]
    check(ch.text.startswith("Hello world"), "echo returns the prompt first")
    check(ch.logprobs.token_logprobs[0] is None and ch.logprobs.token_logprobs[1] is not None,
          "echo + logprobs gives the prompt tokens' logprobs")
    check(len(ch.logprobs.tokens) == 2 + 3, "logprobs cover prompt and completion")
    r = c.completions.create(model="demo", prompt="Hello world", echo=True, max_tokens=0, logprobs=0)
    ch = r.choices[0]
    check(ch.text == "Hello world" and ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.tokens) == 2
          and r.usage.completion_tokens == 0, "echo with max_tokens 0 scores the prompt")

    r = c.completions.create(model=name, prompt=["Once upon", "Hi"], max_tokens=2, n=2)
    check(len(r.choices) == 4, "list of prompts x n choices")
    s = list(c.completions.create(model=name, prompt="Once", max_tokens=3, stream=True,
                                  stream_options={"include_usage": True}))
    check(s[-1].usage.completion_tokens == 3, "streamed completions usage")

    for kwargs, param in [({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"), ({"n": 0}, "n"),
                          ({"extra_body": {"best_of": 4}}, "best_of")]:
        try:
            c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **kwargs)
            check(False, f"invalid {param} must fail")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.body.get("param") == param, f"400 BadRequestError names {param}")
    try:
        c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=10 ** 6)
        check(False, "context overflow must fail")
    except openai.BadRequestError as e:
        check("maximum context length is" in e.message, "context overflow uses vLLM's wording")
    try:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        check(False, "unknown model must fail")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and e.body.get("code") == "model_not_found", "404 NotFoundError for an unknown model")
    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                  user="someone", metadata={"a": "b"}, store=False,
                                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                              "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": True,
                                              "cache_salt": "tenant-a", "chat_template_kwargs": {}})
    check(r.usage.completion_tokens == 2, "accepted fields and vLLM extensions")


def tool_checks(srv):
    c = srv.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS)
    ch = r.choices[0]
    check(ch.finish_reason == "tool_calls", "finish_reason tool_calls")
    call = ch.message.tool_calls[0]
    check(call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"},
          "tool call parsed into message.tool_calls")
    stream = list(c.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, stream=True))
    deltas = [tc for ch in stream if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    check(len(deltas) == 1 and deltas[0].function.name == "get_weather", "streamed tool-call delta")
    check(any(ch.choices and ch.choices[0].finish_reason == "tool_calls" for ch in stream), "streamed tool_calls finish")
    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22C, sunny"},
    ]
    r = c.chat.completions.create(model="scripted", messages=follow, tools=TOOLS, max_tokens=3)
    check(r.usage.prompt_tokens > 0, "tool-role messages are rendered back")

    r = c.chat.completions.create(model="scripted", messages=msgs, stop=["weather\",\"arg"])
    check(r.choices[0].message.content == '<tool_call>{"name": "get_' and r.choices[0].finish_reason == "stop",
          "stop string cuts the output")
    stream = list(c.chat.completions.create(model="scripted", messages=msgs, stop="Paris", stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    check(text.endswith('"city":"') and "Par" not in text, "a partial stop string is never streamed")


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    pets: list[Literal["cat", "dog"]] = pydantic.Field(max_length=2)
    address: Address


class Item(pydantic.BaseModel):
    sku: Literal["A1", "B2"]
    qty: int = pydantic.Field(ge=1, le=9)


class Order(pydantic.BaseModel):
    customer: Address
    items: list[Item] = pydantic.Field(max_length=2)


def nested_tool_checks(c, msgs):
    """Nested Pydantic models as tools: their schemas carry `$defs` (what pydantic-ai, instructor's
    TOOLS mode and openai-agents send), forced, and a forced call together with an output format."""
    tool = openai.pydantic_function_tool(Order)
    r = c.chat.completions.parse(model="demo", messages=msgs, tools=[tool], tool_choice="required", max_tokens=200,
                                 seed=5, parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    check(isinstance(call.function.parsed_arguments, Order)
          and isinstance(call.function.parsed_arguments.customer, Address),
          "pydantic_function_tool with a nested model, tool_choice required: parsed arguments")
    r = c.chat.completions.parse(model="demo", messages=msgs, tools=[tool], max_tokens=200, seed=6,
                                 tool_choice={"type": "function", "function": {"name": "Order"}},
                                 response_format=Person)
    call = r.choices[0].message.tool_calls[0]
    check(isinstance(call.function.parsed_arguments, Order), "a forced call wins over response_format")
    fn = {"type": "function", "name": "Order", "strict": True, "parameters": tool["function"]["parameters"]}
    r = c.responses.create(model="demo", input="Order something.", tools=[fn], max_output_tokens=200, store=False,
                           tool_choice={"type": "function", "name": "Order"},
                           text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}})
    item = r.output[0]
    check(item.type == "function_call" and Order.model_validate_json(item.arguments) is not None,
          "responses: a forced call with text.format (instructor's RESPONSES_TOOLS)")


def structured_checks(srv):
    c = srv.client()
    msgs = [{"role": "user", "content": "Describe a person."}]
    r = c.chat.completions.parse(model="demo", messages=msgs, response_format=Person, max_tokens=200, seed=3)
    p = r.choices[0].message.parsed
    check(isinstance(p, Person) and isinstance(p.address, Address), "chat.completions.parse returns the Pydantic object")
    r = c.chat.completions.create(model="demo", messages=msgs, response_format={"type": "json_object"}, max_tokens=60,
                                  temperature=0)
    ch = r.choices[0]
    check(ch.finish_reason == "length" or isinstance(json.loads(ch.message.content), dict),
          "json_object: a JSON object (or cut by max_tokens)")
    r = c.chat.completions.create(model="demo", messages=msgs, max_tokens=10, n=3,
                                  extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    check(all(ch.message.content in ("red", "green") for ch in r.choices), "structured_outputs.choice")
    # Random weights: bounded arguments, so a forced call always closes within max_tokens.
    weather = json.loads(json.dumps(TOOLS[0]))
    weather["function"]["parameters"]["properties"]["city"]["maxLength"] = 10
    weather["function"]["parameters"]["additionalProperties"] = False
    tools = [weather, {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}}]
    r = c.chat.completions.create(model="demo", messages=msgs, tools=tools, tool_choice="required", max_tokens=100,
                                  parallel_tool_calls=False)
    ch = r.choices[0]
    call = ch.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    check(ch.finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
          and (isinstance(args.get("city"), str) or isinstance(args.get("utc"), bool)),
          "tool_choice required: a schema-valid tool call")
    r = c.chat.completions.create(model="demo", messages=msgs, tools=tools, max_tokens=100,
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    check(call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["utc"], bool),
          "named tool_choice forces that function")
    nested_tool_checks(c, msgs)
    try:
        c.chat.completions.create(model="demo", messages=msgs, max_tokens=2,
                                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
        check(False, "a bad schema must be refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.body.get("param") == "response_format", "bad schema: 400 naming response_format")


def responses_checks(srv):
    """The Responses API on the demo model: shapes, streaming events, text.format, refusals."""
    c = srv.client()
    r = c.responses.create(model="demo", input="Say hi", max_output_tokens=5, store=False)
    check(r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
          and r.usage.output_tokens == 5 and r.output[0].type == "message" and isinstance(r.output_text, str),
          "responses.create: an incomplete response at max_output_tokens")
    events = list(c.responses.create(model="demo", input=[{"role": "user", "content": "Hi"}], instructions="Be brief.",
                                     max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    check(types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
          and "response.output_text.delta" in types and "response.output_item.done" in types,
          "streamed responses: typed events from created to incomplete")
    check([e.sequence_number for e in events] == list(range(len(events))), "streamed events are numbered in order")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(text == events[-1].response.output_text, "streamed text deltas join to the final output_text")
    r = c.responses.parse(model="demo", input="Describe a person.", text_format=Person, max_output_tokens=200)
    check(isinstance(r.output_parsed, Person), "responses.parse with text_format returns the Pydantic object")
    try:
        c.responses.create(model="demo", input="Hi", previous_response_id="resp_123")
        check(False, "previous_response_id must be refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.body.get("param") == "previous_response_id",
              "previous_response_id: 400 (flint is stateless)")


def responses_tool_checks(srv):
    """A function-call round trip through the Responses API (scripted tool-calling model)."""
    c = srv.client()
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = c.responses.create(model="scripted", input="Weather in Paris?", tools=tools)
    calls = [o for o in r.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"},
          "responses: a function_call output item")
    follow = [{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22C and sunny"}]
    r2 = c.responses.create(model="scripted", input=follow, tools=tools, max_output_tokens=3)
    check(r2.usage.input_tokens > r.usage.input_tokens + 5, "function_call_output goes back into the prompt")
    events = list(c.responses.create(model="scripted", input="Weather in Paris?", tools=tools, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    check(len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
          and events[-1].type == "response.completed", "streamed function_call arguments")


def reasoning_checks(srv):
    c = srv.client()
    msgs = [{"role": "user", "content": "Capital of France?"}]
    r = c.chat.completions.create(model="r1", messages=msgs)
    m = r.choices[0].message
    check(getattr(m, "reasoning_content", None) == "The user wants a city." and getattr(m, "reasoning", None) == m.reasoning_content,
          "message.reasoning / reasoning_content hold the chain of thought")
    check(m.content == '{"city": "Paris"}', "the answer follows </think>")
    check(r.usage.completion_tokens_details.reasoning_tokens > 0, "usage reasoning_tokens")
    chunks = list(c.chat.completions.create(model="r1", messages=msgs, stream=True))
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(reasoning == "The user wants a city." and content == '{"city": "Paris"}', "streamed delta.reasoning_content")

    class City(pydantic.BaseModel):
        city: str

    r = c.chat.completions.parse(model="r1", messages=msgs, response_format=City)
    check(r.choices[0].message.parsed == City(city="Paris"), "parse after the reasoning")
    r = c.responses.create(model="r1", input="Capital of France?")
    check([o.type for o in r.output] == ["reasoning", "message"] and r.output[0].content[0].text == "The user wants a city."
          and r.output_text == '{"city": "Paris"}' and r.usage.output_tokens_details.reasoning_tokens > 0,
          "responses: a reasoning item before the message")


def limit_checks(srv):
    good = srv.client(api_key="sekret")
    check(good.models.list().data[0].id == "demo", "a valid API key is accepted")
    try:
        srv.client(api_key="wrong").models.list()
        check(False, "a wrong key must fail")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, "401 AuthenticationError for a wrong key")
    long = good.completions.create(model="demo", prompt="Hi", max_tokens=3000, stream=True,
                                   extra_body={"ignore_eos": True})
    next(iter(long))
    try:
        good.completions.create(model="demo", prompt="Hi", max_tokens=2)
        check(False, "a full queue must refuse")
    except openai.RateLimitError as e:
        check(e.status_code == 429 and e.response.headers.get("retry-after"), "429 RateLimitError with Retry-After")
    long.close()


def embedding_checks(srv):
    from langchain_openai import OpenAIEmbeddings

    c = srv.client()
    texts = ["The quick brown fox", "jumps over the lazy dog", "and runs away"]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    r = c.embeddings.create(model="demo", input=texts)
    check(r.object == "list" and [d.index for d in r.data] == [0, 1, 2], "embeddings.create: a list in input order")
    vecs = [d.embedding for d in r.data]
    dim = len(vecs[0])
    check(all(len(v) == dim for v in vecs) and dim > 0, "every embedding has the model's width")
    check(all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vecs), "embeddings are L2-normalised")
    check(r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, "embedding usage")
    # JSON carries each f32 in its shortest decimal form: rounded back to f32 it is the same bits.
    f32 = lambda v: list(array.array("f", v))
    f = c.embeddings.create(model="demo", input=texts, encoding_format="float")
    check([f32(d.embedding) for d in f.data] == [f32(v) for v in vecs],
          "encoding_format float and base64 carry the same f32s")
    one = c.embeddings.create(model="demo", input=texts[1], encoding_format="float")
    check(f32(one.data[0].embedding) == f32(vecs[1]), "one input alone: the same vector as in a list")
    cut = c.embeddings.create(model="demo", input=texts[0], dimensions=16).data[0].embedding
    norm = sum(x * x for x in vecs[0][:16]) ** 0.5
    check(len(cut) == 16 and max(abs(a - b / norm) for a, b in zip(cut, vecs[0])) < 1e-6,
          "dimensions: the renormalised prefix")
    req = urllib.request.Request(srv.base + "/tokenize", data=json.dumps({"prompt": texts[2]}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        ids = json.load(resp)["tokens"]
    by_ids = c.embeddings.create(model="demo", input=[ids], encoding_format="float")
    check(f32(by_ids.data[0].embedding) == f32(vecs[2]), "token-id input embeds as its text does")
    for bad in [dict(dimensions=0), dict(dimensions=100_000), dict(input=[])]:
        try:
            c.embeddings.create(**{"model": "demo", "input": "x", **bad})
            check(False, f"embeddings {bad} must be refused")
        except openai.BadRequestError as e:
            check(e.status_code == 400, f"embeddings {bad}: 400")
    # LangChain, as its docs configure it for servers other than OpenAI's (its default tokenizes
    # with tiktoken for OpenAI's own models and downloads the encoding).
    lc = OpenAIEmbeddings(model="demo", base_url=srv.base + "/v1", api_key="unused", check_embedding_ctx_length=False)
    docs = lc.embed_documents(texts)
    check(len(docs) == 3 and all(max(abs(a - b) for a, b in zip(d, v)) < 1e-6 for d, v in zip(docs, vecs)),
          "LangChain OpenAIEmbeddings.embed_documents")
    q = lc.embed_query(texts[0])
    check(max(abs(a - b) for a, b in zip(q, vecs[0])) < 1e-6, "LangChain OpenAIEmbeddings.embed_query")
    # The same server still generates.
    r = c.completions.create(model="demo", prompt="Hi", max_tokens=3)
    check(r.usage.completion_tokens == 3, "a pooling server still generates")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flint", default="target/debug/flint")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scripted = os.path.join(tmp, "scripted")
        subprocess.run([args.flint, "synth", "--shape", "scripted", "--script", TOOL_SCRIPT, "--out", scripted],
                       check=True, capture_output=True)
        r1 = os.path.join(tmp, "r1")
        subprocess.run([args.flint, "synth", "--shape", "scripted", "--script", REASONING_SCRIPT, "--out", r1],
                       check=True, capture_output=True)
        for srv_args, checks in [
            (["--served-model-name", "demo"],
             lambda srv: (demo_checks(srv), structured_checks(srv), responses_checks(srv))),
            (["--model", r1, "--served-model-name", "r1", "--reasoning-parser", "deepseek_r1"], reasoning_checks),
            (["--model", scripted, "--served-model-name", "scripted"],
             lambda srv: (tool_checks(srv), responses_tool_checks(srv))),
            (["--served-model-name", "demo", "--api-key", "sekret", "--max-num-seqs", "1",
              "--max-queued-requests", "0"], limit_checks),
            (["--served-model-name", "demo", "--runner", "pooling"], embedding_checks),
        ]:
            srv = Server(args.flint, *srv_args)
            try:
                checks(srv)
            finally:
                srv.stop()
    print(f"openai {openai.__version__}: {len(CHECKS)} conformance checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"conformance FAILED ({len(CHECKS)} passed before): {e}", file=sys.stderr)
        sys.exit(1)
