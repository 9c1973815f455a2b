"""Expert-id ranges against intermediate slices (`ktserve serve --expert-split`), two workers.

Each worker's shard is packed from the same random experts: split by ids (worker w holds experts
[w*E/2, (w+1)*E/2)) or by intermediate rows (worker w holds rows [w*I/2, (w+1)*I/2) of every
expert). For the same random routings, each call is timed on each worker's shard in turn (one
kernel, --threads threads); the call's critical path is the slower worker's time, which is what
a step waits for when the workers run side by side on their own NUMA nodes. The bound is the
slower worker's packed bytes read over the DRAM bandwidth measured in this run; max/mean bytes
is how much more the busier worker reads than the mean, per call (1.00: balanced).

NOTE: on a machine of one node and few cores the workers are timed one after the other, not side
by side: the table shows the balance of the work, not the gain of two nodes' bandwidth.

    python -m tools.bench_expert_split [--tokens 1 8] [--format int8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import Column, print_table
from expert_service.kernels import MoEKernel, pack_experts
from ktserve.dram import dram_read_gbs
from ktserve.intermediate_split import split_rows


def shards(split: str, gate, up, down, fmt: str, threads: int):
    """The two workers' packed experts and how each localizes ids [T, k]."""
    num_experts = gate.shape[0]
    if split == "experts":
        half = num_experts // 2
        ranges = (range(0, half), range(half, num_experts))
        packed = [pack_experts(gate[r.start:r.stop], up[r.start:r.stop], down[r.start:r.stop],
                               fmt, num_threads=threads) for r in ranges]  # fmt: skip

        def localize(ids, r):
            local = ids - r.start
            local[(ids < r.start) | (ids >= r.stop)] = -1
            return local.astype(np.int32)

        return [(p, lambda ids, r=r: localize(ids, r)) for p, r in zip(packed, ranges)]
    result = []
    for rows in split_rows(gate.shape[1], 2):
        s = slice(rows.start, rows.stop)
        p = pack_experts(gate[:, s].contiguous(), up[:, s].contiguous(),
                         down[:, :, s].contiguous(), fmt, num_threads=threads)  # fmt: skip
        result.append((p, lambda ids: ids.astype(np.int32)))
    return result


def touched_bytes(packed, local: np.ndarray) -> int:
    return int(len(np.unique(local[local >= 0]))) * packed.expert_nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--format", default="int8", choices=("bf16", "int8", "int4"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"seed={args.seed}")
    g = torch.Generator().manual_seed(args.seed)
    E, H, I = args.experts, args.hidden, args.intermediate  # noqa: E741
    gate = torch.randn(E, I, H, generator=g) * 0.02
    up = torch.randn(E, I, H, generator=g) * 0.02
    down = torch.randn(E, H, I, generator=g) * 0.02
    bandwidth = dram_read_gbs(args.threads, 1.0)
    print(f"E={E} H={H} I={I} k={args.top_k} {args.format}, {args.threads} kernel threads, "
          f"DRAM read {bandwidth:.1f} GB/s (torch.sum, {args.threads} threads)")  # fmt: skip
    rows = []
    with MoEKernel(args.threads) as kernel:
        for split in ("experts", "intermediate"):
            workers = shards(split, gate, up, down, args.format, args.threads)
            for T in args.tokens:
                rng = np.random.default_rng(args.seed + T)
                critical, per_worker, bound, skew = [], np.zeros(2), [], []
                for call in range(args.calls + 2):
                    x = rng.standard_normal((T, H), dtype=np.float32)
                    ids = np.stack([rng.choice(E, args.top_k, replace=False) for _ in range(T)])
                    weights = rng.random((T, args.top_k), dtype=np.float32)
                    times, nbytes = [], []
                    for packed, localize in workers:
                        local = localize(ids)
                        out = np.empty((T, H), np.float32)
                        t0 = time.perf_counter()
                        kernel.forward(packed, x, local, weights, out)
                        times.append(time.perf_counter() - t0)
                        nbytes.append(touched_bytes(packed, local))
                    if call >= 2:  # NOTE: two warm-up calls
                        critical.append(max(times))
                        per_worker += times
                        bound.append(max(nbytes) / bandwidth / 1e9)
                        skew.append(max(nbytes) / max(np.mean(nbytes), 1))
                w0, w1 = per_worker / args.calls * 1e6
                rows.append((split, str(T), f"{w0:.0f}", f"{w1:.0f}",
                             f"{np.mean(critical) * 1e6:.0f}", f"{np.mean(bound) * 1e6:.0f}",
                             f"{np.mean(skew):.2f}"))  # fmt: skip
    print_table(
        [Column("split", 12, "<"), Column("T", 4), Column("worker 0 us", 11),
         Column("worker 1 us", 11), Column("critical us", 11), Column("bound us", 9),
         Column("max/mean bytes", 14)],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
