"""One MoE layer's routed experts computed from its packed weights on the device they were
staged to: tokens sorted by expert, the experts dequantized a group at a time (bounded scratch),
each group's products one grouped GEMM (torch._grouped_mm where the device and dtype take it,
else a matmul per expert), combined as the worker's kernel combines them:

    y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j] (-1: skip)
    each expert's output in float32, times its float32 weight, summed in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_service.experts.stream_prefill.dequant import dequantize

DEFAULT_SCRATCH_BYTES = 1 << 30  # dequantized weights of one group of experts


@functools.cache
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here for this dtype (torch builds and GPUs differ)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 32, 16, dtype=dtype, device=device_type).transpose(1, 2)
        offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
        out = torch._grouped_mm(a, b, offs=offs)
        return bool(torch.all(out == 16).item())
    except (RuntimeError, NotImplementedError):
        return False


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int],
                   offs: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x [n, K] rows grouped by expert (counts[i] rows each), w [G, N, K] -> [n, N]: the rows of
    group i times w[i].T. offs: the groups' cumulative ends, int32 on x's device."""
    if _grouped_mm_works(x.device.type, x.dtype):
        try:
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        except RuntimeError:  # NOTE: shapes the kernel does not take (alignment): the loop
            pass
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for i, n in enumerate(counts):
        if n:
            torch.matmul(x[start : start + n], w[i].T, out=out[start : start + n])
        start += n
    return out


def experts_per_group(hidden: int, inter: int, dtype: torch.dtype, scratch_bytes: int) -> int:
    """How many experts' dequantized weights (and their float32 intermediates) fit the scratch."""
    per_expert = 3 * hidden * inter * (dtype.itemsize + 8)
    return max(1, scratch_bytes // per_expert)


def scratch_bound(hidden: int, inter: int, dtype: torch.dtype, num_experts: int,
                  scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> int:  # fmt: skip
    """Most device memory one layer's dequantized group (and its intermediates) takes."""
    group = min(experts_per_group(hidden, inter, dtype, scratch_bytes), num_experts)
    return group * 3 * hidden * inter * (dtype.itemsize + 8)


@dataclass(frozen=True)
class ExpertRows:
    """A layer's routed (token, expert) pairs sorted by expert (each expert's pairs are the next
    counts[e] of them), and how many each expert has."""

    token: torch.Tensor  # [n] int64
    weight: torch.Tensor  # [n] float32
    counts: list[int]  # [E] on the host


def route_rows(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertRows:
    """ids [T, k] global expert ids (-1 skips), weights [T, k] -> the pairs by expert. Its one
    host sync (the counts) waits only for the routing, so a caller that has not yet made its
    stream wait for the layer's weights does not wait for their copy here."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1).long()  # [T*k]
    keep = flat >= 0
    expert = flat[keep]  # [n]
    token = torch.arange(num_tokens, device=ids.device).repeat_interleave(top_k)[keep]  # [n]
    weight = weights.reshape(-1)[keep].float()  # [n]
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts).tolist()  # NOTE: one host sync
    if len(counts) > num_experts:
        raise ValueError(f"expert id {len(counts) - 1} is outside the {num_experts} staged")
    return ExpertRows(token[order], weight[order], counts)


def routed_moe(fmt: str, packed: dict[str, torch.Tensor], hidden: int, inter: int,
               x: torch.Tensor, rows: ExpertRows, dtype: torch.dtype,
               scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> torch.Tensor:  # fmt: skip
    """y [T, H] float32 for x [T, H] and its routed pairs, from `packed` (every expert's rows
    [E, per expert] of the format's buffers, on x's device); the products run in `dtype`
    (float32 accumulation inside each GEMM)."""
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)  # [T, H]
    counts, token, weight = rows.counts, rows.token, rows.weight
    hit = [e for e, n in enumerate(counts) if n]
    group = experts_per_group(hidden, inter, dtype, scratch_bytes)
    start = 0
    for g in range(0, len(hit), group):
        chosen = hit[g : g + group]
        sizes = [counts[e] for e in chosen]
        end = start + sum(sizes)
        index = torch.tensor(chosen, device=x.device)
        w13, w2 = dequantize(fmt, {n: t.index_select(0, index) for n, t in packed.items()},
                             hidden, inter, dtype)  # [c, 2I, H], [c, H, I]  # fmt: skip
        offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
        xs = x[token[start:end]].to(dtype)  # [m, H]
        h = grouped_matmul(xs, w13, sizes, offs)  # [m, 2I]
        act = F.silu(h[:, :inter]) * h[:, inter:]  # [m, I]
        y = grouped_matmul(act, w2, sizes, offs)  # [m, H]
        out.index_add_(0, token[start:end], y.float() * weight[start:end, None])
        start = end
    return out


def streamed_moe(fmt: str, packed: dict[str, torch.Tensor], hidden: int, inter: int,
                 x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                 scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> torch.Tensor:  # fmt: skip
    """route_rows then routed_moe: y [T, H] float32 for x [T, H], ids [T, k] global expert ids
    (-1 skips), weights [T, k]."""
    rows = route_rows(ids, weights, packed["w13"].shape[0])
    return routed_moe(fmt, packed, hidden, inter, x, rows, dtype, scratch_bytes)
