#!/usr/bin/env python3
"""Generate the golden fixtures of the other families in fixtures/families/ (see fixtures/README.md).

Usage (from the repository root, in the venv of scripts/requirements-golden.txt):

    .venv/bin/python scripts/golden_families.py            # (re)write fixtures/families/
    .venv/bin/python scripts/golden_families.py --check    # regenerate into a temp dir and compare sha256

One tiny random checkpoint per family, each with the switch that sets it apart from Qwen2:

- qwen3:   no q/k/v bias, RMSNorm over each q and k head, head_dim 48 with hidden 128 and 4 heads
           (head_dim != hidden / heads), tied embeddings; classic `rope_theta` config.
- llama3:  no biases, `llama3` RoPE scaling over an original context of 64 (so most frequencies are
           rescaled), untied; transformers 5's `rope_parameters` config.
- mistral: no biases, a 64-token sliding window on every layer (shorter than the 160- and
           300-token prompts); classic config.
- qwen3_moe: Qwen3's attention, layer 0 a mixture of 8 experts (2 per token, renormalised),
           layer 1 dense (`mlp_only_layers`); GGUF arch `qwen3moe`.
- qwen2_moe: Qwen2's biased attention, both layers 8 experts (2 per token, not renormalised)
           plus the sigmoid-gated shared expert; GGUF arch `qwen2moe`.

The mixtures' GGUFs are laid out as llama.cpp's converter writes them: each projection's experts
stacked into one 3-D tensor (`ffn_{gate,up,down}_exps`), the router in F32, the `expert_*` keys.
llama.cpp's `qwen3moe` has no dense layer, so its converter could not write qwen3_moe's layer 1;
the file holds it under the dense names, which flint reads (a layer without a router is dense).

For the mixtures the seed walk also asks every routing decision to be clear: at each token and
sparse layer the k-th and (k+1)-th router probabilities differ by more than MIN_ROUTER_GAP (1e-5,
a hundred times what f32 rounding moves them), so a token reaches the same experts in flint.

Weights are rounded to bf16 and stored as bf16 (safetensors and GGUF alike), so the GGUF, written
as llama.cpp's converter writes the family (`qwen3`, or `llama` with q/k rows permuted and Llama 3's
`rope_freqs`), holds exactly the same numbers; references are transformers in f32 (eager
attention, one thread), prefill logits then KV-cached greedy steps, as scripts/golden.py.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import golden  # noqa: E402  (the shared helpers: model runs, references, hashing)

REPO = golden.REPO
DEFAULT_OUT = REPO / "fixtures" / "families"
EOS = [2, 3]
# First weight seed tried per family; the script walks upwards until every greedy margin exceeds
# golden.MIN_MARGIN, no greedy token is an EOS id and each prompt's greedy run has >= 3 distinct tokens.
FIRST_SEED = {"qwen3": 3000, "llama3": 3100, "mistral": 3200, "qwen3_moe": 3888, "qwen2_moe": 3610}
MIN_ROUTER_GAP = 1e-5
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")

COMMON = {
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 512,
}


# What both mixtures share: 8 experts of 64, 2 per token, every layer a candidate for sparsity.
EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1}


def family_config(family: str) -> dict:
    cfg = dict(COMMON)
    if family == "qwen3":
        cfg.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            attention_bias=False,
            head_dim=48,
            max_window_layers=2,
            rms_norm_eps=1e-6,
            rope_scaling=None,
            rope_theta=1000000.0,
            sliding_window=None,
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
    elif family == "llama3":
        cfg.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            attention_bias=False,
            head_dim=32,
            mlp_bias=False,
            pretraining_tp=1,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
    elif family == "qwen3_moe":
        cfg.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            attention_bias=False,
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            **EXPERTS,
        )
    elif family == "qwen2_moe":
        cfg.update(
            architectures=["Qwen2MoeForCausalLM"],
            model_type="qwen2_moe",
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[],
            **EXPERTS,
        )
    elif family == "mistral":
        cfg.update(
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            head_dim=32,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=64,
            tie_word_embeddings=False,
        )
    else:
        raise ValueError(family)
    return cfg


def make_weights(cfg: dict, seed: int) -> dict:
    """golden.make_weights (no biases outside Qwen2, Qwen3's head norms), rounded to bf16. A tied
    embedding at std 1 makes each token predict itself (logits ~100): golden.py's full-vocab
    model uses the same 0.25."""
    base = dict(cfg, model_type=cfg["model_type"].removesuffix("_moe"))
    w = golden.make_weights(base, seed, embed_std=0.25 if cfg["tie_word_embeddings"] else 1.0)
    if cfg["model_type"] in MOE_FAMILIES:
        w = with_experts(w, cfg, seed)
    return {k: v.to(torch.bfloat16) for k, v in w.items()}


def sparse_layers(cfg: dict) -> list[int]:
    return [
        i
        for i in range(cfg["num_hidden_layers"])
        if i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0
    ]


def with_experts(w: dict, cfg: dict, seed: int) -> dict:
    """The sparse layers' dense MLP replaced by a router (std 4/sqrt(H): well-separated choices),
    experts N(0, 1/fan_in) and Qwen2-MoE's shared expert and its gate, from a second generator."""
    g = torch.Generator().manual_seed(seed + 100_000)
    H, E, I = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]

    def linear(out_f, in_f, scale=1.0):
        return torch.randn(out_f, in_f, generator=g, dtype=torch.float32) * (scale / math.sqrt(in_f))

    for i in sparse_layers(cfg):
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del w[p + name + ".weight"]
        w[p + "gate.weight"] = linear(E, H, scale=4.0)
        for e in range(E):
            w[p + f"experts.{e}.gate_proj.weight"] = linear(I, H)
            w[p + f"experts.{e}.up_proj.weight"] = linear(I, H)
            w[p + f"experts.{e}.down_proj.weight"] = linear(H, I)
        if "shared_expert_intermediate_size" in cfg:
            S = cfg["shared_expert_intermediate_size"]
            w[p + "shared_expert.gate_proj.weight"] = linear(S, H)
            w[p + "shared_expert.up_proj.weight"] = linear(S, H)
            w[p + "shared_expert.down_proj.weight"] = linear(H, S)
            w[p + "shared_expert_gate.weight"] = linear(1, H)
    return w


def router_gap(model, prompts, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th router probabilities over every token of
    `prompts` at every sparse layer (prefill only: the greedy steps see tokens of the same kind)."""
    gaps = []

    def hook(_module, _inputs, output):
        probs = torch.softmax(output[0].float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return min(gaps)


# ----------------------------------------------------------------------------------------
# GGUF, as llama.cpp's convert_hf_to_gguf.py writes these families

def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter for the `llama` arch: RoPE pairs adjacent instead of in halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rp: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for `llama3` scaling."""
    base, factor = rp["rope_theta"], rp["factor"]
    low, high, old = rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}


def merge_experts(weights: dict, cfg: dict) -> dict:
    """The converter's layout for a mixture: each projection's experts stacked into one
    [experts, out, in] tensor under `mlp.experts.{proj}.weight`, in the layer's place."""
    out: dict = {}
    for name, t in weights.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"]:
            merged = ".".join(parts[:5] + parts[6:])
            if merged not in out:
                p = ".".join(parts[:5])
                out[merged] = torch.stack([weights[f"{p}.{e}.{parts[6]}.weight"] for e in range(cfg["num_experts"])])
        else:
            out[name] = t
    return out


def write_gguf(weights: dict, cfg: dict, path: Path) -> None:
    import gguf

    arch = GGUF_ARCH.get(cfg["model_type"], "llama")
    if cfg["model_type"] in MOE_FAMILIES:
        weights = merge_experts(weights, cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"flint golden {cfg['model_type']}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rp = cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"]}
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg["model_type"] in MOE_FAMILIES:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in cfg:
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("sliding_window") and cfg["model_type"] == "mistral":
        w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_BF16))
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    names = list(weights)
    order = ["model.embed_tokens.weight"] + [n for n in names if n.startswith("model.layers.")]
    order += ["model.norm.weight"] + (["lm_head.weight"] if "lm_head.weight" in weights else [])
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rp, cfg["head_dim"]))
    for hf in order:
        data = weights[hf].float().numpy()
        if arch == "llama" and hf.endswith("self_attn.q_proj.weight"):
            data = llama_permute(data, cfg["num_attention_heads"])
        if arch == "llama" and hf.endswith("self_attn.k_proj.weight"):
            data = llama_permute(data, cfg["num_key_value_heads"])
        if hf.endswith("mlp.gate.weight"):
            # The router stays F32, as the converter keeps every ffn_gate_inp.
            w.add_tensor(golden.gguf_name(hf), np.ascontiguousarray(data))
        elif data.ndim >= 2:
            q = gguf.quants.quantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType.BF16)
            w.add_tensor(golden.gguf_name(hf), q, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(golden.gguf_name(hf), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------------


def gen_family(family: str, out: Path, log: dict) -> None:
    d = out / family
    prompts = golden.small_prompts()
    seed = FIRST_SEED[family]
    while True:
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        cfg = family_config(family)
        weights = make_weights(cfg, seed)
        golden.write_json(d / "config.json", cfg)
        golden.write_json(d / "generation_config.json", {"bos_token_id": 1, "eos_token_id": EOS})
        golden.save_safetensors(weights, d / "model.safetensors")
        m = golden.load_model(d)
        assert type(m).__name__ == cfg["architectures"][0], type(m).__name__
        if family == "mistral":
            assert m.config.sliding_window == 64, m.config.sliding_window
        if family == "llama3":
            assert m.config.rope_parameters["rope_type"] == "llama3", m.config.rope_parameters
        gap = 1.0
        if family in MOE_FAMILIES:
            assert m.config.num_experts == cfg["num_experts"], m.config
            gap = router_gap(m, prompts, cfg["num_experts_per_tok"])
        res = golden.run_small(m, prompts)
        del m
        mm, hit = golden.check_results(res, EOS)
        distinct = min(len(set(r["greedy"].tolist())) for r in res)
        print(f"{family} seed {seed}: min margin {mm:.4f}, eos hits {hit}, distinct greedy >= {distinct}, router gap {gap:.2e}", flush=True)
        if mm > golden.MIN_MARGIN and not hit and distinct >= 3 and gap > MIN_ROUTER_GAP:
            break
        seed += 1
    golden.save_safetensors(golden.reference_tensors(res), d / "reference.safetensors")
    write_gguf(weights, cfg, d / "model-bf16.gguf")
    log[family] = {"weight_seed": seed, "min_margin": mm, "greedy": [r["greedy"].tolist() for r in res]}


def generate(out: Path, only: list[str] | None = None) -> dict:
    golden.setup_torch()
    out.mkdir(parents=True, exist_ok=True)
    log: dict = {}
    for family in only or FIRST_SEED:
        gen_family(family, out, log)
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default fixtures/families)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare sha256 with --out")
    ap.add_argument("--only", nargs="+", choices=list(FIRST_SEED), help="(re)write these families only")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory(prefix="flint-families-check-") as t:
            tmp = Path(t) / "families"
            generate(tmp)
            want, got = golden.file_hashes(args.out), golden.file_hashes(tmp)
            bad = [n for n in sorted(set(want) | set(got)) if want.get(n) != got.get(n)]
            for n in bad:
                print(f"DIFFERS or missing: {n}")
            print(f"--check {'FAILED' if bad else 'OK'}: {len(got) - len(bad)}/{len(got)} files byte-identical")
            return 1 if bad else 0
    log = generate(args.out, args.only)
    for family, entry in log.items():
        print(f"{family}: seed {entry['weight_seed']}, min margin {entry['min_margin']:.4f}")
    for p in sorted(args.out.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size:>10}  {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
