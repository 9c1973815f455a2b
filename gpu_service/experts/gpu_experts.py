"""Hot routed experts kept on the GPU; the rest go to the CPU workers.

    submit: ids [T, k] ──split──▶ hot ids: computed on the GPU (while the CPU works)
                              └─▶ the rest: sent to the workers with hot ids masked to -1
    wait:   y = y_gpu + y_cpu

Which experts are hot, per layer: a placement file ({"layer": [expert ids]}), else the
activation counts the workers report (GetStats), else the lowest ids. HybridExperts counts every
routed id it sees (GPU and CPU alike, on the device) once HotExpertRefresher asks, which re-chooses
the hot experts from the counts of the last interval:

    refresher thread: counts delta ──▶ top-N per layer ──▶ read the new experts (CPU) ──▶ staged
    engine thread:    submit(layer) installs a staged set first (upload, swap), then computes
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_service.experts.moe_client import ShmExperts
from gpu_service.experts.routed import abandon
from ktserve.checkpoint import CheckpointReader
from ktserve.protocol import expert_pb2 as pb

log = logging.getLogger("ktserve.gpu")


def choose_hot_experts(
    moe_layers: tuple[int, ...],
    num_experts: int,
    per_layer: int,
    counts: Mapping[tuple[int, int], int] | None = None,
    placement_file: str | None = None,
) -> dict[int, list[int]]:
    """The `per_layer` hottest experts of each MoE layer."""
    if not 0 < per_layer <= num_experts:
        raise ValueError(f"gpu experts per layer must be in [1, {num_experts}], got {per_layer}")
    if placement_file:
        data = json.loads(Path(placement_file).read_text())
        hot = {int(layer): sorted(int(e) for e in ids) for layer, ids in data.items()}
        for layer, ids in hot.items():
            if layer not in moe_layers or any(not 0 <= e < num_experts for e in ids):
                raise ValueError(f"{placement_file}: layer {layer} / experts {ids} are not valid")
        return hot
    counts = counts or {}
    hot = {}
    for layer in moe_layers:
        ranked = sorted(range(num_experts), key=lambda e: (-counts.get((layer, e), 0), e))
        hot[layer] = sorted(ranked[:per_layer])
    return hot


def worker_activation_counts(experts: ShmExperts) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for worker in experts.workers:
        stats = worker.stub.GetStats(pb.StatsRequest(), timeout=10)
        for a in stats.activations:
            counts[(a.layer, a.expert)] = counts.get((a.layer, a.expert), 0) + a.count
    return counts


@dataclass(frozen=True)
class _HotLayer:
    ids: torch.Tensor  # [n] int32, sorted, on the device
    gate: torch.Tensor  # [n, I, H]
    up: torch.Tensor  # [n, I, H]
    down: torch.Tensor  # [n, H, I]


@dataclass(frozen=True)
class _Staged:
    ids: list[int]  # the new hot set, sorted
    added: list[int]  # its experts not on the device yet, sorted
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # of `added`, on the CPU


class HybridExperts:
    """RoutedExperts: hot experts on `device`, everything else on the CPU workers."""

    def __init__(self, cpu: ShmExperts, reader: CheckpointReader, hot: dict[int, list[int]],
                 device: torch.device | str, dtype: torch.dtype) -> None:  # fmt: skip
        self.cpu = cpu
        self.reader = reader
        self.device = torch.device(device)
        self.dtype = dtype
        self.layers: dict[int, _HotLayer] = {}
        for layer, ids in hot.items():
            gate, up, down = reader.read_experts(layer, ids, dtype)  # [n, I, H] x2, [n, H, I]
            ids_t = torch.tensor(ids, dtype=torch.int32)
            self.layers[layer] = self._upload(ids_t, gate, up, down)
        self.counts: dict[int, torch.Tensor] = {}  # see count_routing
        self._staged: dict[int, _Staged] = {}
        self._swap_lock = threading.Lock()  # stage (refresher) vs install (engine) of one layer
        self.swaps = 0

    def count_routing(self) -> None:
        """From now on count the routed ids each call sees, GPU and CPU alike, per layer:
        counts[layer] [E] int64 on the device."""
        num_experts = self.reader.spec.num_experts
        self.counts = {
            layer: torch.zeros(num_experts, dtype=torch.int64, device=self.device)
            for layer in self.reader.spec.moe_layers
        }

    def _upload(self, ids, gate, up, down) -> _HotLayer:
        dev = self.device
        return _HotLayer(ids.to(dev), gate.to(dev), up.to(dev), down.to(dev))

    def hot_ids(self, layer: int) -> list[int]:
        hot = self._staged.get(layer)
        return list(hot.ids) if hot is not None else self.layers[layer].ids.tolist()

    def stage(self, layer: int, ids: list[int]) -> None:
        """Make `ids` the hot set of `layer` from its next call on (reads the new experts now)."""
        with self._swap_lock:  # NOTE: `added` is relative to the installed set: none may land now
            current = set(self.layers[layer].ids.tolist())
            added = sorted(set(ids) - current)
            weights = self.reader.read_experts(layer, added, self.dtype)
            self._staged[layer] = _Staged(sorted(ids), added, weights)

    def _install(self, layer: int) -> None:
        if layer not in self._staged:  # the usual case: no lock on the per-call path
            return
        with self._swap_lock:
            self._swap_in(layer, self._staged.pop(layer))

    def _swap_in(self, layer: int, staged: _Staged) -> None:
        old = self.layers[layer]
        pool_ids = old.ids.tolist() + staged.added  # rows of [old tensors; added tensors]
        rows = torch.tensor([pool_ids.index(e) for e in staged.ids], device=self.device)
        new = self._upload(torch.tensor(staged.ids, dtype=torch.int32), *staged.weights)
        self.layers[layer] = _HotLayer(
            new.ids, *(torch.cat((a, b))[rows] for a, b in
                       ((old.gate, new.gate), (old.up, new.up), (old.down, new.down))),
        )  # fmt: skip
        self.swaps += 1
        log.info("GPU experts of layer %d: now %s (%d read in)", layer, staged.ids,
                 len(staged.added))  # fmt: skip

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        counts = self.counts.get(layer)
        if counts is not None:
            flat = ids.reshape(-1).long()
            counts.index_add_(0, flat.clamp(min=0), (flat >= 0).long())
        self._install(layer)
        hot = self.layers.get(layer)
        if hot is None:
            return self.cpu.submit(layer, x, ids, weights)
        on_gpu = torch.isin(ids, hot.ids)  # [T, k]
        pending = self.cpu.submit(layer, x, torch.where(on_gpu, -1, ids), weights)
        y = self._gpu_part(hot, x, ids, weights, on_gpu)
        return _Sum(pending, y)

    def _gpu_part(self, hot: _HotLayer, x, ids, weights, on_gpu) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        token, slot = torch.nonzero(on_gpu, as_tuple=True)  # [n], [n]
        if token.numel() == 0:
            return out
        local = torch.searchsorted(hot.ids, ids[token, slot].contiguous())  # [n] hot-set rows
        for j in torch.unique(local).tolist():
            pick = local == j
            t = token[pick]
            xe = x[t].to(self.dtype)  # [m, H]
            h = F.silu(xe @ hot.gate[j].T) * (xe @ hot.up[j].T)  # [m, I]
            y = (h @ hot.down[j].T).float()  # [m, H]
            out.index_add_(0, t, y * weights[t, slot[pick], None].float())
        return out


class HotExpertRefresher:
    """Every `interval_s`, re-chooses each layer's hot experts from the routed ids counted since
    the last time (ties keep the current ones) and stages the layers whose set changed."""

    def __init__(self, experts: HybridExperts, per_layer: int, interval_s: float) -> None:
        self.experts, self.per_layer, self.interval_s = experts, per_layer, interval_s
        experts.count_routing()
        self._last = {layer: experts.counts[layer].to("cpu", copy=True) for layer in experts.layers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hot-experts", daemon=True)

    def start(self) -> HotExpertRefresher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - keep serving with the current placement
                log.exception("re-choosing the GPU experts failed")

    def refresh(self) -> dict[int, list[int]]:
        """Stage new hot sets now; returns {layer: new hot ids} for the layers that change."""
        changed = {}
        for layer in self.experts.layers:
            now = self.experts.counts[layer].to("cpu", copy=True)
            recent, self._last[layer] = now - self._last[layer], now
            if int(recent.sum()) == 0:
                continue
            current = set(self.experts.hot_ids(layer))
            ranked = sorted(range(len(recent)),
                            key=lambda e: (-int(recent[e]), e not in current, e))  # fmt: skip
            chosen = sorted(ranked[: self.per_layer])
            if set(chosen) != current:
                self.experts.stage(layer, chosen)
                changed[layer] = chosen
        return changed


class _Sum:
    def __init__(self, pending, gpu_part: torch.Tensor) -> None:
        self.pending = pending
        self.gpu_part = gpu_part

    def wait(self) -> torch.Tensor:
        return self.pending.wait().to(self.gpu_part.device).add_(self.gpu_part)

    def abandon(self) -> None:
        abandon(self.pending)
