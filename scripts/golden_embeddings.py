#!/usr/bin/env python3
"""Generate the pooled-embedding references fixtures/families/<family>/embeddings.safetensors
(see fixtures/README.md).

Usage (from the repository root, in the venv of scripts/requirements-golden.txt):

    .venv/bin/python scripts/golden_embeddings.py            # (re)write the embeddings.safetensors
    .venv/bin/python scripts/golden_embeddings.py --check    # regenerate into a temp dir and compare sha256

Reads the checkpoints scripts/golden_families.py wrote (qwen3, llama3, mistral; it writes nothing
else there) and loads each with the base-model class, `AutoModel.from_pretrained(dir, dtype=float32,
attn_implementation="eager")` (Qwen3Model / LlamaModel / MistralModel, no lm_head), one thread, as
scripts/golden.py. For every prompt `prompt.N` of that dir's reference.safetensors (the same ids:
lengths 1, 7, 33, 160, 300) one forward without a cache gives `last_hidden_state` [L, hidden] in f32.
In transformers 5.23 this is AFTER the final RMSNorm: `Qwen3Model.forward`, `LlamaModel.forward`
and `MistralModel.forward` each end with `hidden_states = self.norm(hidden_states)` and return it as
`BaseModelOutputWithPast(last_hidden_state=...)`, i.e. exactly the rows the lm_head multiplies (the
script checks this against reference.safetensors' prefill logits). Pooled, then L2-normalised in f32
with `torch.nn.functional.normalize` (p=2, eps=1e-12):

    last.N  = normalize(h[L-1])      mean.N = normalize(h.mean(0))      cls.N = normalize(h[0])

So an embeddings endpoint (last-token, mean and CLS pooling) can be checked row by row against
transformers on the same tiny bf16 checkpoints the generation tests use.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import golden  # noqa: E402  (the shared helpers: torch setup, safetensors writing, hashing)

REPO = golden.REPO
FAMILIES_DIR = REPO / "fixtures" / "families"
FAMILIES = ["qwen3", "llama3", "mistral"]
OUT_NAME = "embeddings.safetensors"
# Max abs difference allowed between h @ lm_head^T and the stored prefill logits (f32 noise ~1e-5).
LOGIT_TOL = 1e-4


def load_base_model(d: Path):
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(
        str(d), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # A base model ignores lm_head.weight in an untied checkpoint; everything else must match.
    unexpected = [k for k in info.get("unexpected_keys", []) if k != "lm_head.weight"]
    for key, val in (("missing_keys", info.get("missing_keys")), ("unexpected_keys", unexpected),
                     ("mismatched_keys", info.get("mismatched_keys")), ("error_msgs", info.get("error_msgs"))):
        if val:
            raise SystemExit(f"loading {d}: {key} = {val}")
    return model.float().eval()


def prompts_of(d: Path) -> tuple[list[torch.Tensor], dict]:
    from safetensors.torch import load_file

    ref = load_file(str(d / "reference.safetensors"))
    n = sum(1 for k in ref if k.startswith("prompt."))
    return [ref[f"prompt.{k}"] for k in range(n)], ref


def output_matrix(d: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    w = load_file(str(d / "model.safetensors"))
    return w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()


@torch.no_grad()
def gen_family(family: str, src: Path, out: Path) -> dict:
    d = src / family
    model = load_base_model(d)
    assert type(model).__name__.endswith("Model") and not hasattr(model, "lm_head"), type(model).__name__
    prompts, ref = prompts_of(d)
    w_out = output_matrix(d)
    t: dict[str, torch.Tensor] = {}
    worst = 0.0
    for k, ids in enumerate(prompts):
        h = model(input_ids=ids.long().unsqueeze(0), use_cache=False).last_hidden_state[0].float()
        assert h.shape == (ids.numel(), model.config.hidden_size), h.shape
        # last_hidden_state is post-norm: projecting it reproduces the reference logits.
        want = ref[f"prefill_logits.{k}"]
        got = h[ref[f"prefill_rows.{k}"]] @ w_out.T
        worst = max(worst, float((got - want).abs().max()))
        t[f"prompt.{k}"] = ids.to(torch.int32)
        t[f"last.{k}"] = F.normalize(h[-1], dim=0)
        t[f"mean.{k}"] = F.normalize(h.mean(dim=0), dim=0)
        t[f"cls.{k}"] = F.normalize(h[0], dim=0)
        if k == 0:
            t[f"hidden.{k}"] = h.clone()
    if worst > LOGIT_TOL:
        raise SystemExit(f"{family}: last_hidden_state @ lm_head^T differs from the reference logits by {worst}")
    (out / family).mkdir(parents=True, exist_ok=True)
    golden.save_safetensors(t, out / family / OUT_NAME)
    return {"prompts": len(prompts), "max_logit_diff": worst}


def generate(src: Path, out: Path) -> dict:
    golden.setup_torch()
    return {family: gen_family(family, src, out) for family in FAMILIES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=FAMILIES_DIR, help="family checkpoints (default fixtures/families)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare sha256 with --dir")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory(prefix="flint-embeddings-check-") as t:
            tmp = Path(t)
            generate(args.dir, tmp)
            names = [f"{f}/{OUT_NAME}" for f in FAMILIES]
            bad = []
            for n in names:
                a, b = args.dir / n, tmp / n
                if not a.exists() or golden.sha256(a) != golden.sha256(b):
                    bad.append(n)
                    print(f"DIFFERS or missing: {n}")
                    if a.exists():
                        print(golden.describe_diff(a, b))
            print(f"--check {'FAILED' if bad else 'OK'}: {len(names) - len(bad)}/{len(names)} files byte-identical")
            return 1 if bad else 0
    log = generate(args.dir, args.dir)
    for family, entry in log.items():
        p = args.dir / family / OUT_NAME
        print(f"{family}: {entry['prompts']} prompts, max |h @ lm_head^T - reference| {entry['max_logit_diff']:.2e}, "
              f"{p.stat().st_size} bytes  {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
