"""What one MoE call costs beyond its kernel: the hand-off between the GPU service and a worker.

A `ktserve expert` worker (subprocess) serves random Qwen3-30B-A3B-shaped layers; this process
calls it as the GPU service does (ShmExperts, here on the CPU: no device copies) with T tokens
of random top-k routings, layer after layer. In alternate phases (never both at once: each would
take the other's cores) the same packed layers run in this process on a kernel with the same
threads, called directly. Per call: the round trip, the kernel alone, and what is left, the
hand-off (copy into the slot, the worker's wake-up and dispatch, the reply, the copy out). This
process's torch runs on one thread, as the GPU service's host side does on a GPU machine.
Weights rotate over every layer, so with enough layers they come from DRAM, not the cache.

    python bench/bench_worker_call.py [--layers 8] [--format int4] [--threads 15] [--tokens 1,4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.bench_convert import SHAPES, write_checkpoint
from bench.common import Column, print_table
from bench.worker_process import expert_worker


def routings(num_experts: int, top_k: int, tokens: int, count: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=g)
        out.append((ids.to(torch.int32), weights / weights.sum(1, keepdim=True)))
    return out


def main() -> None:
    import torch

    from expert_service.kernels import MoEKernel
    from expert_service.shard import load_shard
    from gpu_service.config import ExpertClientConfig
    from gpu_service.moe_client import ShmExperts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="MoE layers (default 8)")
    p.add_argument("--format", default="int4", help="bf16, int8 or int4 (default int4)")
    p.add_argument("--threads", type=int, default=2, help="kernel threads (default 2)")
    p.add_argument("--tokens", default="1,4", help="tokens per call (default 1,4)")
    p.add_argument("--calls", type=int, default=400, help="calls per phase (default 400)")
    p.add_argument("--phases", type=int, default=3, help="alternations (default 3)")
    p.add_argument("--dir", help="where the checkpoint goes (default: a temporary directory)")
    args = p.parse_args()
    # NOTE: the caller's torch ops (the copy into the slot) stay on this thread: a parallel copy
    # leaves OpenMP threads spinning on the cores the worker's kernel pool needs.
    torch.set_num_threads(1)
    shape = SHAPES["qwen3"]
    token_counts = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "bf16"
        write_checkpoint(path, shape, args.layers, "bf16", seed=0)
        shard = load_shard(path, None, args.format)
        layers = sorted(shard.layers)
        kernel = MoEKernel(args.threads)
        rows = []
        with expert_worker(path, args.format, args.threads) as address:
            client = ShmExperts(ExpertClientConfig((address,), wire_dtype="bfloat16"),
                                hidden_size=shape.hidden, top_k=shape.top_k,
                                max_tokens=max(token_counts))  # fmt: skip
            try:
                for tokens in token_counts:
                    calls = routings(shape.experts, shape.top_k, tokens, 64, seed=tokens)
                    x = torch.randn(tokens, shape.hidden).to(torch.bfloat16)
                    out = torch.empty(tokens, shape.hidden, dtype=torch.float32)
                    samples = {"round trip": [], "kernel": []}
                    for _ in range(args.phases):
                        for i in range(args.calls):
                            ids, w = calls[i % len(calls)]
                            layer = layers[i % len(layers)]
                            t0 = time.perf_counter()
                            client.submit(layer, x, ids, w).wait()
                            samples["round trip"].append(time.perf_counter() - t0)
                        for i in range(args.calls):
                            ids, w = calls[i % len(calls)]
                            packed = shard.layers[layers[i % len(layers)]]
                            t0 = time.perf_counter()
                            kernel.forward(packed, x, ids, w, out)
                            samples["kernel"].append(time.perf_counter() - t0)
                    trip = statistics.median(samples["round trip"]) * 1e6
                    alone = statistics.median(samples["kernel"]) * 1e6
                    share = (trip - alone) / trip
                    rows.append([str(tokens), f"{trip:.1f}", f"{alone:.1f}",
                                 f"{trip - alone:.1f}", f"{share:.0%}"])  # fmt: skip
            finally:
                client.close()
                kernel.close()
    print(f"one MoE call to a `ktserve expert` worker: Qwen3-30B-A3B layers ({args.layers}, "
          f"{args.format}, {args.threads} threads, isa {kernel.isa}), bf16 x, medians of "
          f"{args.phases} x {args.calls} calls per column")  # fmt: skip
    print_table(
        [Column("tokens", 6), Column("round trip us", 13), Column("kernel alone us", 15),
         Column("hand-off us", 11), Column("of the trip", 11)],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
