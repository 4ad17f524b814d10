#!/usr/bin/env python3
"""Write the SentencePiece-in-GGUF tokenizer fixture (see fixtures/README.md and
fixtures/tokenizers/NOTICE).

Usage (from the repository root, any venv with the pinned packages):

    python3 -m venv target/spm-venv
    target/spm-venv/bin/pip install mistral-common==1.13.1 sentencepiece==0.2.3 gguf==0.19.0 numpy
    target/spm-venv/bin/python scripts/spm_tokenizer_fixture.py           # (re)write the two files
    target/spm-venv/bin/python scripts/spm_tokenizer_fixture.py --check   # regenerate in a temp dir, compare sha256

Data: Mistral 7B v0.1's SentencePiece model (32000 pieces, BPE, byte fallback), shipped as
`mistral_common/data/tokenizer.model.v1` in the PyPI package mistral-common (Apache-2.0).

Writes into fixtures/tokenizers/:
- mistral-v1-spm.gguf: a GGUF with no tensors, only the tokenizer metadata, laid out as
  llama.cpp's convert_hf_to_gguf.py (`_set_vocab_sentencepiece`, vocab-only write: header + KV,
  no padding) writes it: tokens / scores (f32) / token_type (i32) per id, model "llama",
  pre "default", bos/eos/unk ids, add_bos true, add_eos false, add_space_prefix from the model's
  normalizer_spec.add_dummy_prefix.
- mistral-v1-spm-cases.json: [{"text", "ids", "pieces", "decoded"}], ids = sp.encode(text)
  (no BOS), pieces = sp.encode(text, out_type=str), decoded = sp.decode(ids).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import gguf
import mistral_common
import sentencepiece as spm

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "fixtures" / "tokenizers"
MODEL = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
MODEL_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"
GGUF_NAME, CASES_NAME = "mistral-v1-spm.gguf", "mistral-v1-spm-cases.json"
# llama.cpp's token types (gguf.TokenType): NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6

CASES = [
    "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    " leading space", "trailing space ", "  two leading", "a  b   c    d", "   ", " ",
    "line one\nline two", "\n", "\n\n\n", "a\tb\n\nc", "\tindented", "crlf\r\nline",
    "0", "12345", "3.14159 and 2,718,281,828,459,045", "year 2024-06-01T12:34:56Z",
    "Wait... what?! (yes) [no] {maybe} <tag> a/b\\c \"q\" 'x' #1 @u $5 %9 ^&*~`|",
    "def f(x):\n    return x**2", "fn main() {\n\tprintln!(\"{}\", 1 + 2);\n}",
    "café naïve résumé", "señor niño", "Grüße über Öl", "e\u0301 (decomposed)",
    "日本語", "中文", "こんにちは世界", "안녕하세요", "Привет, мир", "مرحبا", "🙂", "👍🏽",
    "\u2603 snowman", "\u9f98\u9b31", "\U00020000", "\U0001f980 crab", "\ua66e \u01c2 \u2093",
    "<s>", "</s>", "a <s> b </s> c", "<unk>", "", "\u2581x\u2581", "\x00\x7f",
    "Pneumonoultramicroscopicsilicovolcanoconiosis", "a" * 64,
    "Mixed: English, 日本語, Русский, العربية, 😀 and 123!",
]


def add_dummy_prefix(path: Path) -> bool:
    """ModelProto.normalizer_spec (field 3) .add_dummy_prefix (field 3, default true), by hand."""

    def fields(buf: bytes):
        i = 0
        while i < len(buf):
            key, i = varint(buf, i)
            num, wt = key >> 3, key & 7
            if wt == 0:
                val, i = varint(buf, i)
            elif wt == 2:
                n, i = varint(buf, i)
                val, i = buf[i:i + n], i + n
            elif wt in (1, 5):
                n = 8 if wt == 1 else 4
                val, i = buf[i:i + n], i + n
            else:
                raise ValueError(f"wire type {wt}")
            yield num, val

    def varint(buf: bytes, i: int) -> tuple[int, int]:
        v = shift = 0
        while True:
            b = buf[i]
            v, i, shift = v | (b & 0x7F) << shift, i + 1, shift + 7
            if not b & 0x80:
                return v, i

    spec = [v for n, v in fields(path.read_bytes()) if n == 3]
    flags = [bool(v) for n, v in fields(spec[-1] if spec else b"") if n == 3]
    return flags[-1] if flags else True


def generate(out: Path) -> dict:
    assert hashlib.sha256(MODEL.read_bytes()).hexdigest() == MODEL_SHA256, f"unexpected {MODEL}"
    sp = spm.SentencePieceProcessor(model_file=str(MODEL))
    n = sp.vocab_size()
    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(float(sp.get_score(i)))
        t = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            t = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            t = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            t = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            t = gguf.TokenType.BYTE
        types.append(int(t))
    prefix = add_dummy_prefix(MODEL)
    assert prefix == sp.encode("a", out_type=str)[0].startswith("\u2581")

    out.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out / GGUF_NAME), "llama")  # writes general.architecture
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()

    r = gguf.GGUFReader(out / GGUF_NAME)
    assert len(r.tensors) == 0
    f = r.fields
    assert f["general.architecture"].contents() == "llama"
    assert [t.encode("utf-8") for t in f["tokenizer.ggml.tokens"].contents()] == tokens
    assert f["tokenizer.ggml.scores"].contents() == scores  # all exactly representable in f32
    assert f["tokenizer.ggml.token_type"].contents() == types
    assert f["tokenizer.ggml.scores"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32]
    assert f["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert f["tokenizer.ggml.add_space_prefix"].contents() is prefix

    cases = []
    for text in CASES:
        ids = sp.encode(text)
        cases.append({"text": text, "ids": ids, "pieces": sp.encode(text, out_type=str),
                      "decoded": sp.decode(ids)})
    (out / CASES_NAME).write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    byte_cases = sum(any(types[i] == gguf.TokenType.BYTE for i in c["ids"]) for c in cases)
    return {"vocab": n, "bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(),
            "add_space_prefix": prefix, "cases": len(cases), "byte_fallback_cases": byte_cases}


def file_hashes(root: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / GGUF_NAME, root / CASES_NAME)
            if p.is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default fixtures/tokenizers)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare sha256 with --out")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory(prefix="flint-spm-check-") as t:
            generate(Path(t))
            want, got = file_hashes(args.out), file_hashes(Path(t))
            bad = [n for n in (GGUF_NAME, CASES_NAME) if n not in want or want.get(n) != got.get(n)]
            for n in bad:
                print(f"DIFFERS or missing: {n}")
            print(f"--check {'FAILED' if bad else 'OK'}: {2 - len(bad)}/2 files byte-identical")
            return 1 if bad else 0
    print(json.dumps(generate(args.out)))
    for name in (GGUF_NAME, CASES_NAME):
        p = args.out / name
        print(f"{p.stat().st_size:>10}  {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
