"""MappedStore: a worker's reported packed store is mapped read-only only after its owner, mode
and every offset are checked; the mapped arrays are the packed bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpu_service.experts.stream_prefill.staging import LayerStager
from gpu_service.experts.stream_prefill.store import UntrustedStore
from tests.support.expert_stores import E, make_store, open_store


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_maps_the_packed_bytes(fmt, tmp_path, seed):
    layers, info = make_store(tmp_path / "s", seed, fmt, range(E))
    store = open_store(info)
    try:
        assert set(store.layers) == set(layers)
        for layer, packed in layers.items():
            for name, arr in packed.tensors.items():
                view = store.layers[layer].tensors[name]
                assert not view.flags.writeable
                np.testing.assert_array_equal(view, arr)
    finally:
        store.close()


def test_two_workers_stores_stage_as_one_layer(tmp_path, seed):
    low, info_low = make_store(tmp_path / "a", seed, "int4", range(0, 5))
    high, info_high = make_store(tmp_path / "b", seed + 1, "int4", range(5, E))
    stores = [open_store(info_high), open_store(info_low)]
    stager = LayerStager(stores, E, torch.device("cpu"))
    try:
        for layer in low:
            staged = stager.acquire(layer)
            for name in low[layer].tensors:
                whole = np.concatenate((low[layer].tensors[name], high[layer].tensors[name]))
                np.testing.assert_array_equal(staged[name].numpy(), whole)
            stager.release(layer)
        assert stager.copies == 2
        stager.acquire(min(low))  # still staged: two slots, two layers
        assert stager.copies == 2
        with pytest.raises(ValueError, match="not each of 12 once"):
            LayerStager(stores[:1], E, torch.device("cpu"))
    finally:
        for s in stores:
            s.close()


def test_refuses_a_directory_others_can_write(tmp_path, seed):
    _, info = make_store(tmp_path / "s", seed, "int8", range(E))
    os.chmod(tmp_path / "s", 0o777)
    with pytest.raises(UntrustedStore, match="no one else can write"):
        open_store(info)


def test_refuses_a_file_others_can_write(tmp_path, seed):
    _, info = make_store(tmp_path / "s", seed, "int8", range(E))
    os.chmod(tmp_path / "s" / info.store.layers[0].file, 0o666)
    with pytest.raises(UntrustedStore, match="no one else can write"):
        open_store(info)


def test_refuses_a_symlinked_file(tmp_path, seed):
    _, info = make_store(tmp_path / "s", seed, "int8", range(E))
    name = info.store.layers[0].file
    os.rename(tmp_path / "s" / name, tmp_path / name)
    os.symlink(tmp_path / name, tmp_path / "s" / name)
    with pytest.raises(UntrustedStore):
        open_store(info)


@pytest.mark.parametrize("tamper", ["offset", "shape", "dtype", "missing", "file", "layers",
                                    "relative", "none"])  # fmt: skip
def test_refuses_a_layout_that_does_not_check(tamper, tmp_path, seed):
    _, info = make_store(tmp_path / "s", seed, "int4", range(E))
    entry = info.store.layers[0]
    tensor = next(t for t in entry.tensors if t.name == "w13")
    if tamper == "offset":
        tensor.offset += 1 << 20  # past the file's end
    elif tamper == "shape":
        tensor.shape[0] += 1
    elif tamper == "dtype":
        tensor.dtype = "<f4"
    elif tamper == "missing":
        del entry.tensors[0]
    elif tamper == "file":
        entry.file = "../" + entry.file
    elif tamper == "layers":
        del info.store.layers[1]
    elif tamper == "relative":
        info.store.dir = os.path.relpath(info.store.dir)
    else:
        info.ClearField("store")
    with pytest.raises(UntrustedStore):
        open_store(info)
