"""The routed-experts interface the MoE layers call, and an in-process torch reference backend.

Contract (shared/DESIGN.md), per MoE layer and step:
    submit(layer, x [T, H] model dtype on the model device, ids [T, k] int32 global expert ids
           (-1 = skip), weights [T, k] float32 final multipliers) -> PendingExperts
    PendingExperts.wait() -> y [T, H] on the model device, float32 or the model dtype, with
    y[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j].
The MoE layer submits, computes its shared expert meanwhile, then waits and adds.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ktserve.checkpoint import CheckpointReader, LayerHasNoExperts, ShardOutOfRange


class PendingExperts(Protocol):
    def wait(self) -> torch.Tensor: ...


def abandon(pending: PendingExperts | None) -> None:
    """Give up on a call nobody will wait for (an error came first), where the backend can:
    its slots are freed (ShmExperts: PendingShm.abandon)."""
    give_up = getattr(pending, "abandon", None)
    if give_up is not None:
        give_up()


class RoutedExperts(Protocol):
    def submit(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> PendingExperts: ...


class ReadyExperts:
    """A PendingExperts whose result is already computed."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


class TorchExperts:
    """Every routed expert of the checkpoint held on `device` (as `dtype`), computed in float32.

    The oracle-side backend: tests and single-process runs use it where the engine would use the
    expert workers over ktshm.
    """

    def __init__(
        self,
        reader: CheckpointReader,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        spec = reader.spec
        self.spec = spec
        self.device = torch.device(device)
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer in spec.moe_layers:
            gate, up, down = reader.read_experts(layer, range(spec.num_experts), dtype)
            # gate/up [E, I, H], down [E, H, I]
            self._weights[layer] = (gate.to(device), up.to(device), down.to(device))

    def submit(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> ReadyExperts:
        if layer not in self._weights:
            raise LayerHasNoExperts(layer, self.spec.moe_layers)
        if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"x {list(x.shape)}, ids {list(ids.shape)} and weights {list(weights.shape)} "
                "do not agree; expected x [T, H], ids [T, k], weights [T, k]"
            )
        gate, up, down = self._weights[layer]
        xf = x.float()  # [T, H]
        out = torch.zeros_like(xf)  # [T, H]
        hit = torch.unique(ids[ids >= 0]).tolist()
        if hit and (hit[0] < 0 or hit[-1] >= self.spec.num_experts):
            raise ShardOutOfRange("expert", str(hit[-1]), self.spec.num_experts)
        for expert in hit:
            token, slot = torch.where(ids == expert)  # [n], [n]
            xe = xf[token]  # [n, H]
            h = F.silu(xe @ gate[expert].float().T) * (xe @ up[expert].float().T)  # [n, I]
            y = h @ down[expert].float().T  # [n, H]
            out.index_add_(0, token, y * weights[token, slot, None].float())
        return ReadyExperts(out)
