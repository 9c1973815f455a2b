"""The benchmarks' checkpoint writer: what it writes is a checkpoint transformers and ktserve
read alike (shrunk shapes here; the names, dtypes and layout are the real models')."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.real_checkpoint import SHAPES, write
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.models import Batch, SeqInput, TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoints import load_reference_model

SMALL = {  # the real shapes, shrunk: FP8 needs multiples of 128
    "qwen3": dict(hidden=256, moe_inter=128, dense_inter=256, experts=8, top_k=2, heads=4,
                  kv_heads=2, head_dim=64, vocab=512),
    "deepseek": dict(hidden=256, moe_inter=128, dense_inter=256, experts=16, top_k=2, heads=2,
                     kv_heads=2, vocab=512),
}  # fmt: skip


@pytest.mark.parametrize("experts", ["bf16", "fp8"])
@pytest.mark.parametrize("name", list(SMALL))
def test_written_checkpoint_loads_and_matches_transformers(tmp_path, seed, name, experts):
    shape = dataclasses.replace(SHAPES[name], **SMALL[name])
    dense = 1 if name == "deepseek" else 0  # DeepSeek-V3 leads with dense layers, Qwen3 not
    got = write(tmp_path, shape, layers=3, experts=experts, seed=seed, dense_layers=dense)
    assert got["expert_bytes"] > 0
    reader = CheckpointReader(tmp_path)
    assert reader.spec.moe_layers == tuple(range(dense, 3))
    model = load_model(tmp_path, "cpu", torch.float32,
                       experts=TorchExperts(reader, "cpu", torch.float32),
                       max_num_tokens_in_cache=64)  # fmt: skip
    prompt = torch.randint(0, shape.vocab, (9,), generator=torch.Generator().manual_seed(seed))
    cache = KVCacheManager(model.kv_cache.config).allocate(len(prompt))
    ours = model.forward(Batch((SeqInput(prompt.tolist(), cache, 0),)))[0]
    reference = load_reference_model(tmp_path)
    with torch.no_grad():
        theirs = reference(prompt[None]).logits[0, -1].float()
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"{name} {experts}: rel logits err {err:.2e}")
    assert err < 1e-3
