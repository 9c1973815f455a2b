"""What the host's call that launches a CUDA graph costs, by the graph's size and node kinds.

A decode step's graph costs the engine thread its launch (`ktserve_engine_host_seconds{part=
"launch"}`; docs/results/2026-12-02-chained-decode-steps.md has the figures), and a chained step is
launched only after the step before it ends. This captures graphs of N small kernels (N about a
step's node count: ~21 a layer) and times `CUDAGraph.replay()` on the host, the GPU idle before each
call, for:

    kernels        N elementwise kernels
    kernels+write  the same and, last, a stream write of a word in mapped host memory
                   (cuStreamWriteValue32: how a step's graph signals its end to the host)
    triton         N Triton kernels of 8 pointer and scalar arguments (like the hand-off and
                   fused kernels), where Triton imports

    python tools/probe_graph_launch.py [--nodes 200,1000,2000] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

import torch  # noqa: E402

from bench.common import Column, print_table  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the triton variant is then left out
    triton = None

if triton is not None:

    @triton.jit
    def _scaled_add(a, b, c, d, out, n, alpha, beta, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(a + offs, mask=mask) * alpha + tl.load(b + offs, mask=mask) * beta
        x += tl.load(c + offs, mask=mask) + tl.load(d + offs, mask=mask)
        tl.store(out + offs, x, mask=mask)


def capture(nodes: int, kind: str, driver, word) -> torch.cuda.CUDAGraph:
    bufs = [torch.zeros(256, device="cuda") for _ in range(5)]

    def body():
        for _ in range(nodes):
            if kind == "triton":
                _scaled_add[(1,)](*bufs, 256, 1.0, 0.5, BLOCK=256)
            else:
                bufs[0].add_(1.0)
        if kind == "kernels+write":
            driver.write32(torch.cuda.current_stream().cuda_stream, word, 1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up: compiles the Triton kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def launch_us(graph: torch.cuda.CUDAGraph, reps: int) -> tuple[float, float]:
    """(median host microseconds of replay(), median microseconds from the call to the graph's
    end) over reps launches, each onto an idle GPU."""
    calls, totals = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        called = time.perf_counter()
        torch.cuda.synchronize()
        calls.append((called - start) * 1e6)
        totals.append((time.perf_counter() - start) * 1e6)
    return statistics.median(calls), statistics.median(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="200,1000,2000", help="kernels per graph")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_graph_launch needs a CUDA GPU")
    from gpu_service.experts.device_calls import CudaDriver

    driver = CudaDriver()
    host_word = torch.zeros(16, dtype=torch.int32, pin_memory=True)  # pinned and mapped
    word = driver.device_pointer(host_word.data_ptr())
    kinds = ["kernels", "kernels+write"] + (["triton"] if triton is not None else [])
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for kind in kinds:
            graph = capture(nodes, kind, driver, word)
            call, total = launch_us(graph, args.reps)
            rows.append((kind, str(nodes), f"{call:.1f}", f"{call / nodes * 1e3:.0f}",
                         f"{total:.1f}"))  # fmt: skip
            del graph
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: medians of {args.reps}")
    print_table([Column("graph", 14, "<"), Column("nodes", 6), Column("call us", 8),
                 Column("ns/node", 8), Column("to end us", 9)], rows)  # fmt: skip


if __name__ == "__main__":
    main()
