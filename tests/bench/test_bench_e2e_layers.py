"""bench_e2e --layers: a view of a checkpoint's first N layers (its files linked, the config's
layer count set) that ktserve's loader and the experts' byte count read as an N-layer model; its
logits are transformers' for the same view."""

from __future__ import annotations

import json

import torch

from bench.bench_e2e import expert_tensor_bytes, layer_view
from gpu_service.attention.batch import Batch, SeqInput
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.models import TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader, ModelSpec
from tests.support.checkpoints import load_reference_model, make_tiny_checkpoint


def test_a_layer_view_is_the_first_layers_of_the_checkpoint(tmp_path, seed):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed, num_hidden_layers=3)
    view = layer_view(path, 2, tmp_path)
    assert json.loads((view / "config.json").read_text())["num_hidden_layers"] == 2
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    assert ModelSpec.from_checkpoint(path).moe_layers == (0, 1)  # the tiny model's layer 2 is dense
    assert ModelSpec.from_checkpoint(view).moe_layers == (0, 1)
    per_layer = expert_tensor_bytes(path, 1)
    assert per_layer > 0
    assert expert_tensor_bytes(path, 2) == expert_tensor_bytes(path) == 2 * per_layer

    reference = load_reference_model(view)
    assert len(reference.model.layers) == 2
    experts = TorchExperts(CheckpointReader(view), torch.device("cpu"), torch.float32)
    model = load_model(view, torch.device("cpu"), torch.float32, experts=experts,
                       max_num_tokens_in_cache=64)  # fmt: skip
    prompt = torch.randint(3, 100, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0, -1].float()
    cache = KVCacheManager(model.kv_cache.config).allocate(len(prompt))
    got = model.forward(Batch((SeqInput(prompt, cache, 0),)))[0]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_a_layer_view_longer_than_the_checkpoint_is_refused(tmp_path, seed):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed, num_hidden_layers=2)
    try:
        layer_view(path, 3, tmp_path)
    except SystemExit as exc:
        assert "the checkpoint has 2" in str(exc)
    else:
        raise AssertionError("a 3-layer view of a 2-layer checkpoint was made")
