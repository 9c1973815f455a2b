"""RoutedExperts that stream a step's prefill rows through the GPU and send the rest to the
CPU workers:

    begin_step(seq_lens): rows of sequences with more than one new token (prefill chunks) are
                          the step's prefill rows; if there are at least min_tokens of them the
                          step streams: the first MoE layer's copy starts now
    submit(layer, ...):   decode rows ──▶ cpu backend (workers, hot GPU experts), submitted first
                          prefill rows: routed (one host sync), the layer's staged experts
                          (staging.py) acquired, the next MoE layer's copy started, then
                          computed on the device (compute.py)
    wait():               both parts in their rows of y [T, H] float32
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_service.experts.routed import PendingExperts, RoutedExperts, abandon
from gpu_service.experts.stream_prefill.compute import (
    DEFAULT_SCRATCH_BYTES,
    route_rows,
    routed_moe,
    scratch_bound,
)
from gpu_service.experts.stream_prefill.cost_model import StreamCost
from gpu_service.experts.stream_prefill.staging import LayerStager
from gpu_service.experts.stream_prefill.store import MappedStore, UntrustedStore

log = logging.getLogger("ktserve.gpu")

# NOTE: the decode graphs' device calls are the cpu backend's (decode rows never stream)
_FROM_CPU = ("device_calls",)


@dataclass(frozen=True)
class _StepRows:
    num_tokens: int
    streamed: torch.Tensor  # [S] int64 row indices, on the device
    others: torch.Tensor  # [T - S] int64


class StreamingExperts:
    """RoutedExperts: prefill rows through `stager` on the device, the others through `cpu`."""

    def __init__(self, cpu: RoutedExperts, stager: LayerStager, hidden: int, inter: int,
                 moe_layers: tuple[int, ...], dtype: torch.dtype, min_tokens: int | None,
                 scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:  # fmt: skip
        """min_tokens: the fewest prefill rows a step streams (None: never)."""
        self.cpu = cpu
        self.stager = stager
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self.moe_layers = tuple(sorted(moe_layers))
        self._next = dict(zip(self.moe_layers, self.moe_layers[1:]))
        self.min_tokens = min_tokens
        self.scratch_bytes = scratch_bytes
        self.cost: StreamCost | None = None
        self.workers = None  # the ShmExperts whose stores it maps: see follow()
        self._rows: _StepRows | None = None
        self.steps_streamed = 0  # stats
        self.rows_streamed = 0
        self.on_streamed: Callable[[int], None] | None = None  # a metric: rows per step

    def __getattr__(self, name: str):
        if name in _FROM_CPU:
            return getattr(self.cpu, name)
        raise AttributeError(name)

    @property
    def scratch_bound(self) -> int:
        """Most device memory one layer's dequantized group (and its intermediates) takes."""
        return scratch_bound(self.hidden, self.inter, self.dtype, self.stager.num_experts,
                             self.scratch_bytes)  # fmt: skip

    @property
    def memory_bytes(self) -> int:
        """Device memory streaming holds: two layers' packed experts and the dequant scratch."""
        return self.stager.memory_bytes + self.scratch_bound

    def follow(self, workers) -> None:
        """Map a worker's new store when it restarts (its re-attach brings new WorkerInfo):
        the old mapping's memory goes as soon as it is unmapped."""
        self.workers = workers
        self._dirs = _store_dirs(workers)

    def _follow_restarts(self) -> None:
        dirs = _store_dirs(self.workers)
        if dirs == self._dirs:
            return
        self._dirs = dirs
        stores = []
        try:
            for w in self.workers.workers:
                stores.append(MappedStore(w.info, self.hidden, self.inter, self.moe_layers))
            old = self.stager.replace_stores(stores)
        except (UntrustedStore, ValueError, OSError) as exc:
            for store in stores:
                store.close()
            log.error("prefill: a restarted worker's experts cannot be streamed (%s); prefill "
                      "stays on the CPU workers from now on", exc)  # fmt: skip
            self.min_tokens = None
            return
        for store in old:
            store.close()
        log.info("prefill: mapped the restarted workers' stores %s", dirs)

    def begin_step(self, seq_lens: list[int]) -> bool:
        """Plan a step of sequences with these new-token counts; True if its prefill rows
        stream."""
        self._rows = None
        if self.workers is not None and self.min_tokens is not None:
            self._follow_restarts()
        prefill = sum(n for n in seq_lens if n > 1)
        if self.min_tokens is None or prefill == 0 or prefill < self.min_tokens:
            return False
        device = self.stager.device
        lens = torch.tensor(seq_lens)
        row_is_prefill = torch.repeat_interleave(lens > 1, lens)  # [T]
        self._rows = _StepRows(
            int(lens.sum()),
            torch.nonzero(row_is_prefill).squeeze(1).to(device),
            torch.nonzero(~row_is_prefill).squeeze(1).to(device),
        )
        self.steps_streamed += 1
        self.rows_streamed += prefill
        if self.on_streamed is not None:
            self.on_streamed(prefill)
        self.stager.prefetch(self.moe_layers[0])
        return True

    def end_step(self) -> None:
        self._rows = None

    def reset_stats(self) -> None:
        """Count from now on (the memory plan's profiling forwards stream too, on CUDA)."""
        self.steps_streamed = self.rows_streamed = 0

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> PendingExperts:  # fmt: skip
        rows = self._rows
        if rows is None or layer not in self.moe_layers:
            return self.cpu.submit(layer, x, ids, weights)
        if x.shape[0] != rows.num_tokens:
            raise ValueError(
                f"the step began with {rows.num_tokens} tokens, layer {layer} got {x.shape[0]}"
            )
        others = None
        if rows.others.numel():
            o = rows.others
            others = self.cpu.submit(layer, x[o], ids[o], weights[o])
        try:
            s = rows.streamed
            # NOTE: order: the routing's host sync before the stream waits for this layer's
            # copy, and the next layer's copy queued before this layer's compute, so the copy
            # runs while the host queues the compute and the device runs it
            routed = route_rows(ids[s], weights[s], self.stager.num_experts)
            packed = self.stager.acquire(layer)
            if layer in self._next:
                self.stager.prefetch(self._next[layer], busy=layer)
            y = routed_moe(self.stager.fmt, packed, self.hidden, self.inter, x[s], routed,
                           self.dtype, self.scratch_bytes)  # fmt: skip
            self.stager.release(layer)
        except BaseException:
            abandon(others)
            raise
        return _RowsJoined(rows, y, others)

    def close(self) -> None:
        self.stager.close()
        for store in self.stager.stores:
            store.close()


def _store_dirs(workers) -> list[str | None]:
    return [w.info.store.dir if w.info is not None and w.info.HasField("store") else None
            for w in workers.workers]  # fmt: skip


class _RowsJoined:
    def __init__(self, rows: _StepRows, streamed: torch.Tensor,
                 others: PendingExperts | None) -> None:  # fmt: skip
        self.rows, self.streamed, self.others = rows, streamed, others

    def wait(self) -> torch.Tensor:
        out = torch.empty(self.rows.num_tokens, self.streamed.shape[1], dtype=torch.float32,
                          device=self.streamed.device)  # [T, H]  # fmt: skip
        out[self.rows.streamed] = self.streamed
        if self.others is not None:
            out[self.rows.others] = self.others.wait().to(out.device, torch.float32)
        return out

    def abandon(self) -> None:
        abandon(self.others)
