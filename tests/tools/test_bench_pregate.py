"""tools/bench_pregate.py: the residuals it captures are what transformers' own routers route
from, and each pair scores the later layer's router applied one layer early."""

from __future__ import annotations

import pytest
import torch

from tests.support.checkpoints import (
    available_families,
    load_reference_model,
    make_tiny_checkpoint,
    moe_block,
    moe_layer_indices,
)
from tools.bench_pregate import hit_rate, pregate_hits, residuals, routed


def test_hit_rate_counts_each_tokens_shared_ids():
    actual = torch.tensor([[1, 2], [3, 4]])
    assert hit_rate(actual, actual) == 1.0
    assert hit_rate(torch.tensor([[2, 9], [5, 6]]), actual) == 0.25
    assert hit_rate(torch.tensor([[7, 8], [5, 6]]), actual) == 0.0


@pytest.mark.parametrize("family", available_families())
def test_pairs_score_the_next_routers_guess_from_this_layers_residual(family, tmp_path, seed):
    model = load_reference_model(make_tiny_checkpoint(family, tmp_path / "ckpt", seed=seed))
    layers = model.model.layers
    tokens = torch.randint(0, 101, (1, 24), generator=torch.Generator().manual_seed(seed))
    moe = moe_layer_indices(model)
    taken = {}  # the ids transformers' own forward routed, by layer
    hooks = [
        moe_block(model, i).gate.register_forward_hook(
            lambda _m, _a, out, i=i: taken.__setitem__(i, out[2].clone())
        )
        for i in moe
    ]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    res = residuals(model, tokens)
    with torch.no_grad():
        for i in moe:  # the captured residual is what the layer's router routed from
            assert torch.equal(
                routed(moe_block(model, i), layers[i].post_attention_layernorm, res[i]), taken[i]
            )
        hits = pregate_hits(model, tokens)
        assert [(a, b) for a, b, _ in hits] == list(zip(moe, moe[1:]))
        for a, b, hit in hits:
            x = layers[b].post_attention_layernorm(res[a])
            guess = moe_block(model, b).gate(x.reshape(-1, x.shape[-1]))[2]
            assert hit == hit_rate(guess, taken[b])
