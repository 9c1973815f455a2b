"""Synthetic experts (a benchmark-only weight source): refused without its environment variable;
the same values whatever the shard's range or threads; a well-formed model of each format, read
through ktk.h's documented layout (test_dequant's numpy oracle) and run by the kernel against the
plain torch MoE; served end to end by a real worker under a GPU service on the CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.real_checkpoint import SHAPES, write
from expert_service import synthetic_experts
from expert_service.kernels import MoEKernel, default_isa
from expert_service.shard import load_shard
from gpu_service.models import Batch, SeqInput
from ktserve import shared_store
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401
from tests.support.expert_stores import numpy_dequant
from tests.support.kernel_bounds import BOUNDS, rel_err
from tests.support.reference_moe import reference_moe
from tests.support.worker_services import worker_service

FORMATS = ("bf16", "int8", "int4")
# Qwen3-30B-A3B's geometry, shrunk: sizes that are multiples of 64, as real models' are
SHAPE = dataclasses.replace(SHAPES["qwen3"], hidden=128, moe_inter=128, dense_inter=128, experts=6,
                            top_k=2, heads=2, kv_heads=1, head_dim=64, vocab=8192)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, seed) -> Path:
    out = tmp_path_factory.mktemp("synthetic") / "qwen3-small"
    write(out, SHAPE, layers=2, experts="synthetic", seed=seed, dense_layers=0)
    return out


@pytest.fixture
def allowed(monkeypatch):
    monkeypatch.setenv(synthetic_experts.ENV, "1")


def test_refused_without_its_environment_variable(model_dir, monkeypatch):
    monkeypatch.delenv(synthetic_experts.ENV, raising=False)
    with pytest.raises(synthetic_experts.SyntheticExpertsError, match="benchmark-only"):
        load_shard(model_dir, None, "int4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_depend_on_the_seed_only(model_dir, fmt, allowed):
    whole = load_shard(model_dir, None, fmt, pack_threads=2)
    part = load_shard(model_dir, range(2, 5), fmt, pack_threads=1)
    assert sorted(whole.layers) == sorted(part.layers) == [0, 1]
    for layer in whole.layers:
        for name, t in whole.layers[layer].tensors.items():
            np.testing.assert_array_equal(t[2:5], part.layers[layer].tensors[name])
    a, b = (whole.layers[i].tensors["w13"] for i in (0, 1))
    assert not np.array_equal(a, b)  # each layer its own values
    assert not np.array_equal(a[0], a[1])  # and each expert


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_well_formed_model_of_each_format(model_dir, fmt, seed, allowed):
    shard = load_shard(model_dir, None, fmt)
    packed = shard.layers[1]
    H, I = SHAPE.hidden, SHAPE.moe_inter  # noqa: E741
    gate, up, down = (torch.from_numpy(w) for w in numpy_dequant(packed, H, I))
    for w in (gate, up, down):  # about 0.02 in size, as bench/real_checkpoint.py's weights
        assert 0.01 < float(w.std()) < 0.04
    if fmt == "int8":  # the row sums the kernel uses are the rows' sums
        for w, s, r, k in (("w13", "s13", "r13", H), ("w2", "s2", "r2", I)):
            q = packed.tensors[w].reshape(len(shard.experts), -1, k // 4, 16, 4)
            sums = q.astype(np.int64).sum(axis=(2, 4)).reshape(len(shard.experts), -1)
            np.testing.assert_array_equal(packed.tensors[r], sums)
            assert (packed.tensors[s] > 0).all()
    x, ids, w = routed_inputs(seed, 7)
    [out] = kernel_outputs([packed], x, ids, w)
    assert rel_err(out, reference_moe(x, ids, w, gate, up, down)) <= BOUNDS[fmt]


def test_intermediate_slices_are_halves_of_one_model(model_dir, seed, allowed):
    """--intermediate-rows: each slice packed as experts of its width; the two workers' sum is
    the MoE of the concatenated weights (what the GPU side adds up)."""
    H, half = SHAPE.hidden, SHAPE.moe_inter // 2
    slices = [load_shard(model_dir, None, "int4", intermediate=range(a, a + half), share=True)
              for a in (0, half)]  # fmt: skip
    assert [s.rows for s in slices] == [range(0, half), range(half, 2 * half)]
    assert all(s.store is None for s in slices)  # a slice is never shared
    weights = [numpy_dequant(s.layers[0], H, half) for s in slices]
    gate, up, down = (torch.from_numpy(np.concatenate(w, axis=axis))
                      for w, axis in zip(zip(*weights), (1, 1, 2)))  # fmt: skip
    x, ids, w = routed_inputs(seed, 5)
    total = sum(kernel_outputs([s.layers[0] for s in slices], x, ids, w))
    assert rel_err(total, reference_moe(x, ids, w, gate, up, down)) <= BOUNDS["int4"]


def routed_inputs(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], ids [T, k], routing weights [T, k] of a seeded draw."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, SHAPE.hidden, generator=g)
    ids = torch.randint(0, SHAPE.experts, (tokens, SHAPE.top_k), generator=g, dtype=torch.int32)
    return x, ids, torch.rand(tokens, SHAPE.top_k, generator=g)


def kernel_outputs(layers, x, ids, w) -> list[torch.Tensor]:
    """The worker's kernel (one thread, this CPU's best ISA) on each packed layer."""
    kernel = MoEKernel(1, default_isa())
    try:
        outs = [torch.empty(x.shape) for _ in layers]
        for packed, out in zip(layers, outs):
            kernel.forward(packed, x, ids, w, out)
        return outs
    finally:
        kernel.close()


def test_shared_store_holds_the_same_values(model_dir, allowed):
    private = load_shard(model_dir, None, "int4")
    shared = load_shard(model_dir, None, "int4", share=True)
    try:
        assert shared.store is not None and Path(shared.store.dir).is_dir()
        for layer, packed in private.layers.items():
            for name, t in packed.tensors.items():
                np.testing.assert_array_equal(t, shared.layers[layer].tensors[name])
    finally:
        shared_store.remove(Path(shared.store.dir))


def test_served_by_a_worker(model_dir):
    """`ktserve expert` loads it when let, and a GPU service (its GPU part from the same
    directory: no routed experts there) computes finite logits through it."""
    worker = ExpertProcess("--model", str(model_dir), "--format", "int4", "--threads", "1",
                           env={synthetic_experts.ENV: "1"})  # fmt: skip
    service = None
    try:
        service = worker_service(model_dir, worker, dtype="float32", kv_cache_tokens=256)
        model, kv = service.engine.model, service.engine.scheduler.kv_manager
        cache = kv.allocate(5)
        try:
            logits = model.forward(Batch((SeqInput([1, 2, 3, 4, 5], cache, 0),)))
        finally:
            kv.free(cache)
        assert logits.shape == (1, SHAPE.vocab) and torch.isfinite(logits).all()
        assert float(logits.std()) > 0
    finally:
        if service is not None:
            service.close()
        worker.close()
