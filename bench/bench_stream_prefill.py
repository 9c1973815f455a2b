"""One MoE layer of prefill streamed to the GPU (gpu_service/experts/stream_prefill) at real shapes.

Random experts are packed (a few distinct ones, their packed rows repeated to the layer's expert
count: the bytes and the work are a real layer's), written as a worker's store into a 0700
directory under /dev/shm (removed at the end) and mapped as the GPU service maps it. Per shape,
format and chunk size T (uniform random routing, top-k distinct experts per token):
  H2D GB/s      one layer's copy into a staging slot: mappings registered as pinned memory (the
                service's path), and from pageable memory (its fallback)
  compute ms    dequantize + grouped GEMM of the staged layer for T tokens
  pipelined ms  per layer, LAYERS layers in a row alternating between two stored layers: copy of
                layer L+1 on the side stream while L computes (what a prefill chunk does)
  tok/s         T / pipelined; the PCIe bound is T / (layer bytes / H2D); % of it
  CPU ms        (--worker-threads N) the same call to the CPU kernel in this process, for the
                cost model's other side

    python bench/bench_stream_prefill.py [--shapes qwen3,deepseek] [--formats int4]
        [--tokens 512,2048,8192] [--layers 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import functools
import secrets
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import Column, default_device, print_table  # noqa: E402
from expert_service import packed_store  # noqa: E402
from expert_service.kernels import MoEKernel, pack_experts  # noqa: E402
from gpu_service.experts.stream_prefill.compute import route_rows, routed_moe  # noqa: E402
from gpu_service.experts.stream_prefill.cost_model import timed  # noqa: E402
from gpu_service.experts.stream_prefill.staging import LayerStager  # noqa: E402
from gpu_service.experts.stream_prefill.store import MappedStore  # noqa: E402
from ktserve.names import weight_format_to_pb  # noqa: E402
from ktserve.protocol import expert_pb2 as pb  # noqa: E402

# (hidden, moe_intermediate, experts, top_k)
SHAPES = {"qwen3": (2048, 768, 128, 8), "deepseek": (7168, 2048, 256, 8), "tiny": (256, 128, 16, 4)}
DISTINCT = 8  # distinct random experts packed per layer; the rest repeat them


def write_store(root: Path, shape: str, fmt: str, num_layers: int) -> pb.WorkerInfo:
    hidden, inter, experts, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    n = min(DISTINCT, experts)
    layers = {}
    for layer in range(num_layers):
        gate = torch.randn(n, inter, hidden, generator=g, dtype=torch.bfloat16) * 0.02
        up = torch.randn(n, inter, hidden, generator=g, dtype=torch.bfloat16) * 0.02
        down = torch.randn(n, hidden, inter, generator=g, dtype=torch.bfloat16) * 0.02
        packed = pack_experts(gate, up, down, fmt)
        reps = -(-experts // n)
        tiled = {k: np.ascontiguousarray(np.tile(v, (reps, 1))[:experts])
                 for k, v in packed.tensors.items()}  # fmt: skip
        layers[layer] = packed_store.write_layer(root, layer, _Tensors(tiled))
    info = pb.WorkerInfo(format=weight_format_to_pb(fmt), pid=0)
    info.experts.start, info.experts.stop = 0, experts
    info.store.dir = str(root)
    for layer, entry in layers.items():
        info.store.layers.add(layer=layer, file=entry["file"], tensors=[
            pb.StoreTensor(name=k, dtype=t["dtype"], shape=t["shape"], offset=t["offset"])
            for k, t in entry["tensors"].items()])  # fmt: skip
    return info


class _Tensors:
    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.tensors = tensors


def routing(num_tokens: int, experts: int, top_k: int, device) -> tuple:
    g = torch.Generator().manual_seed(num_tokens)
    scores = torch.rand(num_tokens, experts, generator=g)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.full((num_tokens, top_k), 1.0 / top_k)
    return ids.to(device), weights.to(device)


def bench_one(shape: str, fmt: str, args, device: torch.device, kernel) -> list[list[str]]:
    hidden, inter, experts, top_k = SHAPES[shape]
    root = Path("/dev/shm") / f"bench-stream-{secrets.token_hex(4)}"
    root.mkdir(mode=0o700)
    rows = []
    try:
        info = write_store(root, shape, fmt, 2)
        store = MappedStore(info, hidden, inter, (0, 1))
        pinned = LayerStager([store], experts, device)
        pageable = (
            LayerStager([store], experts, device, register=False) if device.type == "cuda" else None
        )

        def copy(stager):
            stager.reset()
            stager.acquire(0)

        layer_bytes = pinned.layer_nbytes
        h2d = layer_bytes / timed(lambda: copy(pinned), device)
        h2d_pageable = layer_bytes / timed(lambda: copy(pageable), device) if pageable else h2d
        if pageable is not None:
            pageable.close()
        for num_tokens in args.tokens:
            x = (torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
                 .to(device, args.dtype))  # fmt: skip
            ids, weights = routing(num_tokens, experts, top_k, device)
            routed = route_rows(ids, weights, experts)
            call = functools.partial(routed_moe, fmt, hidden=hidden, inter=inter, x=x,
                                     rows=routed, dtype=args.dtype)  # fmt: skip
            packed = pinned.acquire(0)
            compute_s = timed(functools.partial(call, packed), device)
            pipeline = functools.partial(pipelined, pinned, call, args.layers)
            per_layer = timed(pipeline, device, repeats=1) / args.layers
            bound = num_tokens / (layer_bytes / h2d)
            cpu = "-"
            if kernel is not None:
                cpu = f"{cpu_layer_ms(kernel, store, shape, fmt, x, ids, weights):.1f}"
            rate = num_tokens / per_layer
            rows.append([shape, fmt, str(num_tokens), f"{layer_bytes / 2**20:.0f}",
                         f"{h2d / 1e9:.1f}", f"{h2d_pageable / 1e9:.1f}",
                         f"{compute_s * 1e3:.1f}", f"{per_layer * 1e3:.1f}",
                         f"{layer_bytes / h2d * 1e3:.1f}", f"{rate:.0f}", f"{bound:.0f}",
                         f"{100 * rate / bound:.0f}%", cpu])  # fmt: skip
            print(f"{shape} {fmt} T={num_tokens}: {per_layer * 1e3:.1f} ms per layer", flush=True)
        pinned.close()
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def pipelined(stager: LayerStager, call, num_layers: int) -> None:
    """num_layers layers alternating between stored layers 0 and 1: each one's copy overlaps
    the previous one's compute, in StreamingExperts.submit's order (the routing known; the
    layer acquired, the next one's copy queued, then the compute)."""
    stager.reset()
    stager.prefetch(0)
    for i in range(num_layers):
        layer = i % 2
        packed = stager.acquire(layer)
        stager.forget(1 - layer)  # NOTE: as if it were another layer: every layer is a copy
        stager.prefetch(1 - layer, busy=layer)
        call(packed)
        stager.release(layer)


def cpu_layer_ms(kernel, store, shape, fmt, x, ids, weights) -> float:
    from expert_service.kernels import PackedExperts

    hidden, inter, experts, _ = SHAPES[shape]
    packed = PackedExperts.from_tensors(fmt, experts, hidden, inter, store.layers[0].tensors)
    xc = x.float().cpu().to(torch.bfloat16)
    idc, wc = ids.cpu().contiguous(), weights.cpu().contiguous()
    out = torch.empty(xc.shape, dtype=torch.float32)
    kernel.forward(packed, xc, idc, wc, out)  # warm-up
    start = time.perf_counter()
    kernel.forward(packed, xc, idc, wc, out)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3,deepseek")
    parser.add_argument("--formats", default="int4")
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--layers", type=int, default=8, help="layers in the pipelined run")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="also time the CPU kernel with this many threads (0: no)",
    )
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    kernel = MoEKernel(args.worker_threads) if args.worker_threads else None
    rows = []
    try:
        for shape in args.shapes.split(","):
            for fmt in args.formats.split(","):
                rows += bench_one(shape, fmt, args, device, kernel)
    finally:
        if kernel is not None:
            kernel.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nstreamed prefill, one MoE layer ({name}, {args.dtype}, {args.layers} layers "
          "pipelined)")  # fmt: skip
    cols = [Column("shape", 8, "<"), Column("fmt", 4, "<"), Column("T", 5), Column("MiB", 5),
            Column("H2D GB/s", 8), Column("pageable", 8), Column("compute ms", 10),
            Column("pipelined ms", 12), Column("copy ms", 7), Column("tok/s", 7),
            Column("PCIe bound", 10), Column("% bound", 7), Column("CPU ms", 6)]  # fmt: skip
    print_table(cols, rows)


if __name__ == "__main__":
    main()
