"""Shards split by intermediate dimension: slices of every expert whose partial outputs add up to
the MoE output of transformers' own expert weights (tests/support/reference_moe.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expert_service.kernels import MoEKernel
from expert_service.shard import load_shard
from ktserve.checkpoint import ModelSpec
from ktserve.intermediate_split import check_rows, split_rows
from tests.support.checkpoints import (
    FP8_OVERRIDES,
    load_reference_model,
    make_tiny_checkpoint,
    moe_layer_indices,
    reference_expert_weights,
)
from tests.support.reference_moe import reference_moe

# An intermediate dimension of two whole 64-row blocks, so that it splits in two.
SPLITTABLE = {"moe_intermediate_size": 128}


def reference_layer(model, layer: int, num_experts: int) -> tuple[torch.Tensor, ...]:
    """gate, up [E, I, H] and down [E, H, I] of one layer, from transformers' modules."""
    weights = [reference_expert_weights(model, layer, e) for e in range(num_experts)]
    return tuple(torch.stack([w[m] for w in weights]) for m in range(3))


def split_output(path: Path, slices: list[range], x, ids, weights, layer: int) -> torch.Tensor:
    """The sum of the partial outputs of one shard per slice (bf16 weights, the exact mode)."""
    total = torch.zeros(x.shape, dtype=torch.float32)
    with MoEKernel(1) as kernel:
        for rows in slices:
            shard = load_shard(path, None, "bf16", pack_threads=1, intermediate=rows)
            assert shard.rows == rows and shard.store is None
            assert shard.layers[layer].intermediate_size == len(rows)
            out = torch.empty(x.shape, dtype=torch.float32)
            kernel.forward(shard.layers[layer], x, ids, weights, out)
            total += out
    return total


def routing(seed: int, num_tokens: int, hidden: int, num_experts: int, k: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])
    ids = ids.to(torch.int32)
    ids[0, 1] = -1  # a slot that is not this call's
    weights = torch.rand(num_tokens, k, generator=g)
    return x, ids, weights


@pytest.mark.parametrize(
    "family, per_expert_names, overrides",
    [
        ("deepseek_v3", True, SPLITTABLE),
        ("qwen3_moe", False, SPLITTABLE),  # the fused layout: sliced from the float32 copy
        ("mixtral", True, {"intermediate_size": 128}),
    ],
)
def test_slices_add_up_to_the_whole_expert(family, per_expert_names, overrides, seed, tmp_path):
    path = make_tiny_checkpoint(family, tmp_path, seed=seed, per_expert_names=per_expert_names,
                                **overrides)  # fmt: skip
    model = load_reference_model(path)
    layer = moe_layer_indices(model)[0]
    gate, up, down = reference_layer(model, layer, ModelSpec.from_checkpoint(path).num_experts)
    x, ids, weights = routing(seed, 5, gate.shape[2], gate.shape[0])
    want = reference_moe(x, ids, weights, gate, up, down)
    got = split_output(path, list(split_rows(gate.shape[1], 2)), x, ids, weights, layer)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"{family}: two intermediate slices vs transformers' experts: {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize(
    "slices",
    [
        [range(0, 128), range(128, 192)],  # on the 128 scale blocks
        [range(0, 64), range(64, 192)],
    ],
)  # not: dequantized first
def test_fp8_slices_follow_the_block_scales(slices, seed, tmp_path):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=seed, fp8=True)
    model = load_reference_model(path)
    layer = moe_layer_indices(model)[0]
    gate, up, down = reference_layer(model, layer, ModelSpec.from_checkpoint(path).num_experts)
    assert gate.shape[1] == FP8_OVERRIDES["moe_intermediate_size"]
    x, ids, weights = routing(seed + 1, 4, gate.shape[2], gate.shape[0])
    # NOTE: bf16 packing rounds the dequantized weights to bf16, as the reference does here
    want = reference_moe(x, ids, weights, *(w.to(torch.bfloat16) for w in (gate, up, down)))
    got = split_output(path, slices, x, ids, weights, layer)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_slices_off_the_packing_blocks_are_refused(seed, tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path, seed=seed, **SPLITTABLE)
    with pytest.raises(ValueError, match="must start at a multiple of 64"):
        load_shard(path, None, "bf16", intermediate=range(32, 128))
    with pytest.raises(ValueError, match="not inside the experts' intermediate dimension 0-127"):
        load_shard(path, None, "bf16", intermediate=range(64, 192))
    check_rows(range(64, 100), 100)  # the last slice may end at I
    with pytest.raises(ValueError, match=r"multiple of 64 x 2 = 128.*split it: 1, 3"):
        split_rows(192, 2)
    assert split_rows(256, 4) == (range(0, 64), range(64, 128), range(128, 192), range(192, 256))
