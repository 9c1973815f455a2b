"""LayerStager's two slots and streamed_moe on the staged layers: the CPU (always) and CUDA (on
the GPU host: pinned registration of the read-only mappings, side-stream copies ordered by
events) against the store's bytes and a plain torch MoE of the numpy-dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_service.experts.stream_prefill.compute import streamed_moe
from gpu_service.experts.stream_prefill.staging import LayerStager
from tests.support.expert_stores import E, H, I, make_store, numpy_dequant, open_store
from tests.support.reference_moe import reference_moe

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA staging runs on the GPU host"))]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_alternating_layers_compute_from_fresh_copies(fmt, device, tmp_path, seed):
    layers, info = make_store(tmp_path / "s", seed, fmt, range(E))
    store = open_store(info)
    stager = LayerStager([store], E, torch.device(device))
    try:
        if device == "cuda":
            assert stager.pinned, "cudaHostRegister of the read-only mappings failed"
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(37, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(37)]).int()
        ids[::5, 0] = -1
        weights = torch.rand(37, 3, generator=g)
        want = {}
        for layer, packed in layers.items():
            gate, up, down = (torch.from_numpy(a) for a in numpy_dequant(packed, H, I))
            want[layer] = reference_moe(x, ids, weights, gate, up, down)
        order = sorted(layers)
        stager.prefetch(order[0])
        for i in range(6):
            layer = order[i % 2]
            staged = stager.acquire(layer)
            y = streamed_moe(fmt, staged, H, I, x.to(device), ids.to(device),
                             weights.to(device), torch.float32)  # fmt: skip
            stager.release(layer)
            other = order[(i + 1) % 2]
            stager.forget(other)  # NOTE: a copy every layer, as a model with many layers makes
            stager.prefetch(other, busy=layer)
            err = float((y.cpu() - want[layer]).abs().max() / want[layer].abs().max())
            assert err < (1e-5 if device == "cpu" else 1e-3), (i, err)
        assert stager.copies == 7
        for layer in order:  # the slots hold the store's bytes
            staged = stager.acquire(layer)
            for name, arr in layers[layer].tensors.items():
                got = staged[name].cpu().numpy()
                np.testing.assert_array_equal(got.view(arr.dtype), arr)
    finally:
        stager.close()
        store.close()
