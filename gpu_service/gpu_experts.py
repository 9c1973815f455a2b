"""Hot routed experts kept on the GPU; the rest go to the CPU workers.

    submit: ids [T, k] ──split──▶ hot ids: computed on the GPU (while the CPU works)
                              └─▶ the rest: sent to the workers with hot ids masked to -1
    wait:   y = y_gpu + y_cpu

Which experts are hot, per layer: a placement file ({"layer": [expert ids]}), else the
activation counts the workers report (GetStats), else the lowest ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from expert_service.checkpoint import CheckpointReader
from expert_service.protocol import expert_pb2 as pb
from gpu_service.moe_client import ShmExperts


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


class HybridExperts:
    """RoutedExperts: hot experts on `device`, everything else on the CPU workers."""

    def __init__(self, cpu: ShmExperts, reader: CheckpointReader, hot: dict[int, list[int]],
                 device: torch.device | str, dtype: torch.dtype) -> None:  # fmt: skip
        self.cpu = cpu
        self.device = torch.device(device)
        self.dtype = dtype
        self.hot: dict[int, torch.Tensor] = {}
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer, ids in hot.items():
            gate, up, down = reader.read_experts(
                layer, ids, dtype
            )  # [n, I, H], [n, I, H], [n, H, I]
            self.weights[layer] = (gate.to(self.device), up.to(self.device), down.to(self.device))
            self.hot[layer] = torch.tensor(ids, dtype=torch.int32, device=self.device)

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        hot = self.hot.get(layer)
        if hot is None:
            return self.cpu.submit(layer, x, ids, weights)
        on_gpu = torch.isin(ids, hot)  # [T, k]
        pending = self.cpu.submit(layer, x, torch.where(on_gpu, -1, ids), weights)
        y = self._gpu_part(layer, x, ids, weights, on_gpu)
        return _Sum(pending, y)

    def _gpu_part(self, layer, x, ids, weights, on_gpu) -> torch.Tensor:
        gate, up, down = self.weights[layer]
        hot = self.hot[layer]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        token, slot = torch.nonzero(on_gpu, as_tuple=True)  # [n], [n]
        if token.numel() == 0:
            return out
        local = torch.searchsorted(hot, ids[token, slot].contiguous())  # [n] rows of the hot set
        for j in torch.unique(local).tolist():
            pick = local == j
            t = token[pick]
            xe = x[t].to(self.dtype)  # [m, H]
            h = F.silu(xe @ gate[j].T) * (xe @ up[j].T)  # [m, I]
            y = (h @ down[j].T).float()  # [m, H]
            out.index_add_(0, t, y * weights[t, slot[pick], None].float())
        return out


class _Sum:
    def __init__(self, pending, gpu_part: torch.Tensor) -> None:
        self.pending = pending
        self.gpu_part = gpu_part

    def wait(self) -> torch.Tensor:
        return self.pending.wait().to(self.gpu_part.device).add_(self.gpu_part)
