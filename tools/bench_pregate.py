"""How well a MoE layer's router, applied one layer early, names the experts that layer will use.

A prefetch of the next layer's experts during the GPU's part of a decode step (bench_prefetch.py
times what it would save) needs their ids before that layer's own router runs. The cheapest
guess: the next layer's post-attention norm and router applied to this layer's post-attention
residual (the state its own router sees, one attention and one MoE block earlier). This runs a
checkpoint through transformers (float32) on a text and prints, per pair of consecutive MoE
layers, the share of the later layer's routed experts the guess names, beside chance (k / E).

    python tools/bench_pregate.py [CHECKPOINT (default: the demo model)] [--text FILE]
        [--tokens 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO_MODEL, Column, print_table  # noqa: E402
from ktserve.checkpoint import ModelSpec  # noqa: E402
from tests.support.checkpoints import moe_block, moe_layer_indices  # noqa: E402


def routed(block: torch.nn.Module, norm: torch.nn.Module, residual: torch.Tensor) -> torch.Tensor:
    """[tokens, k] expert ids the block's router picks for norm(residual) (transformers' routers
    return (logits, weights, ids) for every family here)."""
    x = norm(residual)
    return block.gate(x.reshape(-1, x.shape[-1]))[2]


def hit_rate(guess: torch.Tensor, actual: torch.Tensor) -> float:
    """The share of actual's [tokens, k] ids that the same token's row of guess names."""
    hits = sum(len(set(g.tolist()) & set(a.tolist())) for g, a in zip(guess, actual, strict=True))
    return hits / actual.numel()


def residuals(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each decoder layer's post-attention residual (its post-attention norm's input) for the
    tokens, from one forward pass."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(
            lambda _m, args, _out, i=i: seen.__setitem__(i, args[0].detach())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def pregate_hits(model: torch.nn.Module, input_ids: torch.Tensor) -> list[tuple[int, int, float]]:
    """(layer, next MoE layer, share of the next layer's experts its router names from this
    layer's residual) for each consecutive pair of MoE layers."""
    moe = moe_layer_indices(model)
    res = residuals(model, input_ids)
    out = []
    with torch.no_grad():
        for a, b in zip(moe, moe[1:]):
            block, norm = moe_block(model, b), model.model.layers[b].post_attention_layernorm
            out.append((a, b, hit_rate(routed(block, norm, res[a]), routed(block, norm, res[b]))))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", nargs="?", default=str(DEMO_MODEL))
    p.add_argument("--text", default=str(Path(__file__).resolve().parent.parent / "README.md"))
    p.add_argument("--tokens", type=int, default=1024)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(a.checkpoint)
    ids = tokenizer(Path(a.text).read_text(), return_tensors="pt").input_ids[:, : a.tokens]
    spec = ModelSpec.from_checkpoint(a.checkpoint)
    k, experts = spec.num_experts_per_tok, spec.num_experts
    print(f"{a.checkpoint}: {ids.shape[1]} tokens of {a.text}; top {k} of {experts} experts "
          f"(chance {k / experts:.3f})")  # fmt: skip
    columns = [Column("layer", 5), Column("next MoE layer", 14), Column("experts named", 13)]
    rows = [[str(i), str(j), f"{hit:.3f}"] for i, j, hit in pregate_hits(model, ids)]
    print_table(columns, rows)


if __name__ == "__main__":
    main()
