"""What one MoE call costs beyond its kernel: the hand-off between the GPU service and a worker.

A `ktserve expert` worker (subprocess) serves random Qwen3-30B-A3B-shaped layers; this process
calls it as the GPU service does (ShmExperts, here on the CPU: no device copies) with T tokens
of random top-k routings, layer after layer. In alternate phases (never both at once: each would
take the other's cores) the same packed layers run in this process on a kernel with the same
threads, called directly. Per call: the round trip, the kernel alone, and what is left, the
hand-off (copy into the slot, the worker's wake-up and dispatch, the reply, the copy out). This
process's torch runs on one thread, as the GPU service's host side does on a GPU machine.
Weights rotate over every layer, so with enough layers they come from DRAM, not the cache.

The worker keeps its calls' per-part timings (--call-timing-samples; expert_service/
call_timing.py draws the parts), printed as a second table: the caller's part (copy in, its
wait's wake-up, copy out) is the round trip less the worker's (request published -> reply
published). With --baseline-tree DIR (a source tree with its extensions built, e.g. an older
commit's) a worker run from it takes alternate phases too, for a before/after in one run.

    python bench/bench_worker_call.py [--layers 8] [--format int4] [--threads 15] [--tokens 1,4]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.bench_convert import SHAPES, Shape, write_checkpoint
from bench.common import Column, print_table
from bench.worker_process import expert_worker

# Qwen3-30B-A3B's hidden size and routing (the wire's bytes) with a 12x thinner intermediate: a
# kernel short enough for the hand-off's parts to show on a small machine.
BENCH_SHAPES = {**SHAPES, "qwen3-thin": Shape("qwen3_moe", 2048, 64, 128, 8)}
PHASE_SUMS = ("dispatch", "kernel", "publish", "bookkeeping")  # WorkerStats' *_seconds
PARTS = ("queued", "wake", "dispatch", "kernel", "publish", "bookkeeping")


def routings(num_experts: int, top_k: int, tokens: int, count: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=g)
        out.append((ids.to(torch.int32), weights / weights.sum(1, keepdim=True)))
    return out


def median_us(values) -> float:
    return statistics.median(values) / 1e3 if len(values) else float("nan")


def main() -> None:
    import grpc
    import torch

    from expert_service.kernels import MoEKernel
    from expert_service.shard import load_shard
    from gpu_service.config import ExpertClientConfig
    from gpu_service.experts.moe_client import ShmExperts
    from ktserve.protocol import expert_pb2 as pb
    from ktserve.protocol import expert_pb2_grpc as pb_grpc

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3", choices=sorted(BENCH_SHAPES),
                   help="layer shape (default qwen3: Qwen3-30B-A3B)")  # fmt: skip
    p.add_argument("--layers", type=int, default=8, help="MoE layers (default 8)")
    p.add_argument("--format", default="int4", help="bf16, int8 or int4 (default int4)")
    p.add_argument("--threads", type=int, default=2, help="kernel threads (default 2)")
    p.add_argument("--tokens", default="1,4", help="tokens per call (default 1,4)")
    p.add_argument("--calls", type=int, default=400, help="calls per phase (default 400)")
    p.add_argument("--phases", type=int, default=3, help="alternations (default 3)")
    p.add_argument("--dir", help="where the checkpoint goes (default: a temporary directory)")
    p.add_argument("--baseline-tree", help="also time a worker run from this source tree")
    p.add_argument("--gap-us", type=float, default=0.0,
                   help="the caller sleeps this long before each call, as the GPU computes "
                   "between two layers' calls: past the worker's spin its threads sleep and the "
                   "parts show their wake-ups (default 0: back to back)")  # fmt: skip
    args = p.parse_args()
    # NOTE: the caller's torch ops (the copy into the slot) stay on this thread: a parallel copy
    # leaves OpenMP threads spinning on the cores the worker's kernel pool needs.
    torch.set_num_threads(1)
    shape = BENCH_SHAPES[args.shape]
    token_counts = [int(t) for t in args.tokens.split(",")]
    recorded = args.phases * args.calls
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, contextlib.ExitStack() as stack:
        path = Path(tmp) / "bf16"
        write_checkpoint(path, shape, args.layers, "bf16", seed=0)
        shard = load_shard(path, None, args.format)
        layers = sorted(shard.layers)
        kernel = stack.enter_context(MoEKernel(args.threads))
        timing_flags = ("--call-timing-samples", str(recorded))
        workers = {"this tree": stack.enter_context(
            expert_worker(path, args.format, args.threads, extra_args=timing_flags))}  # fmt: skip
        if args.baseline_tree:
            workers["baseline"] = stack.enter_context(
                expert_worker(path, args.format, args.threads, tree=args.baseline_tree)
            )
        clients = {}
        for name, address in workers.items():
            clients[name] = ShmExperts(ExpertClientConfig((address,), wire_dtype="bfloat16"),
                                       hidden_size=shape.hidden, top_k=shape.top_k,
                                       max_tokens=max(token_counts))  # fmt: skip
            stack.callback(clients[name].close)
        stubs = {
            name: pb_grpc.ExpertServiceStub(stack.enter_context(grpc.insecure_channel(address)))
            for name, address in workers.items()
        }
        stats = stubs["this tree"]

        def phase_totals(name: str) -> list[float]:
            s = stubs[name].GetStats(pb.StatsRequest(), timeout=30)
            return [s.calls, *(getattr(s, f"{p}_seconds") for p in PHASE_SUMS)]

        rows, part_rows, phase_rows = [], [], []
        for tokens in token_counts:
            calls = routings(shape.experts, shape.top_k, tokens, 64, seed=tokens)
            x = torch.randn(tokens, shape.hidden).to(torch.bfloat16)
            out = torch.empty(tokens, shape.hidden, dtype=torch.float32)
            samples = {name: [] for name in [*clients, "kernel"]}
            before = {name: phase_totals(name) for name in clients}
            for _ in range(args.phases):
                for name, client in clients.items():
                    for i in range(args.calls):
                        ids, w = calls[i % len(calls)]
                        layer = layers[i % len(layers)]
                        if args.gap_us:
                            time.sleep(args.gap_us / 1e6)
                        t0 = time.monotonic_ns()
                        client.submit(layer, x, ids, w).wait()
                        samples[name].append(time.monotonic_ns() - t0)
                for i in range(args.calls):
                    ids, w = calls[i % len(calls)]
                    packed = shard.layers[layers[i % len(layers)]]
                    t0 = time.monotonic_ns()
                    kernel.forward(packed, x, ids, w, out)
                    samples["kernel"].append(time.monotonic_ns() - t0)
            for name in clients:
                calls_made, *sums = (b - a for a, b in zip(before[name], phase_totals(name)))
                phase_rows.append(
                    [str(tokens), name, *[f"{t / calls_made * 1e6:.1f}" for t in sums]]
                )
            timings = stats.GetStats(pb.StatsRequest(), timeout=30).call_timings
            parts = {part: list(getattr(timings, f"{part}_ns"))[-recorded:] for part in PARTS}
            trips = samples["this tree"]
            in_worker = [sum(parts[p][i] for p in PARTS[:-1]) for i in range(recorded)]
            caller = [trip - w for trip, w in zip(trips, in_worker)]
            alone = median_us(samples["kernel"])
            for name in clients:
                trip = median_us(samples[name])
                rows.append([str(tokens), name, f"{trip:.1f}", f"{alone:.1f}",
                             f"{trip - alone:.1f}", f"{(trip - alone) / trip:.0%}"])  # fmt: skip
            known = [b for b in parts["bookkeeping"] if b >= 0]
            part_rows.append([str(tokens), f"{median_us(trips):.1f}", f"{median_us(caller):.1f}",
                              *[f"{median_us(parts[p]):.1f}" for p in PARTS[:-1]],
                              f"{median_us(known):.1f}"])  # fmt: skip
    print(f"one MoE call to a `ktserve expert` worker: {args.shape} layers ({args.layers}, "
          f"{args.format}, {args.threads} threads, isa {kernel.isa}), bf16 x, medians of "
          f"{args.phases} x {args.calls} calls per column, {args.gap_us:g} us between "
          "calls")  # fmt: skip
    print_table(
        [Column("tokens", 6), Column("worker", 10, "<"), Column("round trip us", 13),
         Column("kernel alone us", 15), Column("hand-off us", 11), Column("of the trip", 11)],
        rows,
    )  # fmt: skip
    print(
        "\nthe round trip's parts (this tree's worker), medians in us: caller = copy in, its "
        "wake-up, copy out; the worker's from its call timings (medians do not add up)"
    )
    print_table(
        [Column("tokens", 6), Column("trip", 7), Column("caller", 7),
         *[Column(part, max(7, len(part))) for part in PARTS]],
        part_rows,
    )  # fmt: skip

    print("\nthe worker's own phase sums (WorkerStats *_seconds, either tree's worker) per "
          "call, means in us: dispatch = taking the request to the kernel's start")  # fmt: skip
    print_table(
        [Column("tokens", 6), Column("worker", 10, "<"),
         *[Column(p, max(7, len(p))) for p in PHASE_SUMS]],
        phase_rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
