"""The GPU part's linear layers at a decode step's rows, one kernel per format, at real shapes.

Per (shape, rows): bf16 weights through F.linear (cuBLAS), fp8 weights through torch._scaled_mm
with the activations quantized per row first (fp8_scaled_mm: FP8Linear's path for more than
FP8_WEIGHT_ONLY_MAX_ROWS rows), and fp8 and int8 weights through the weight-only Triton kernels
(weight_only_triton.py) at their defaults (the GEMV kernel up to GEMV_MAX_ROWS rows, there the
tile kernel beside it) and, with --sweep, the best of a grid of tiles (--gemv-sweep: the GEMV
kernel's other launch shapes).
Each is timed as a server runs it: a CUDA graph of calls over enough copies of the weights that
they are read from HBM, not L2, replayed; microseconds a call (medians of --reps replays), and the
weights' bytes over that time against the copy bandwidth measured in the same run.

    python bench/bench_weight_only_mm.py [--rows 1,4,16] [--sweep] [--gemv-sweep]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

import torch
import torch.nn.functional as F

from bench.common import Column, print_table
from gpu_service.layers import weight_only_triton as wo
from gpu_service.layers.linear import fp8_scaled_mm
from gpu_service.layers.weight_formats import quantize_fp8, quantize_int8

# (name, N outputs, K inputs): the decode step's linear layers
SHAPES = {
    "DeepSeek-V3": [("q_a+kv_a", 2112, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384),
                    ("shared gate+up", 4096, 7168), ("shared down", 7168, 2048)],
    "Qwen3-30B-A3B": [("qkv", 5120, 2048), ("o_proj", 2048, 4096)],
}  # fmt: skip
GEMV_SWEEP = [wo.GemvTiles(n, k, w) for n, k, w in ((2, 2048, 4), (4, 1024, 4), (8, 1024, 4),
                                                     (8, 2048, 8), (16, 512, 4),
                                                     (4, 4096, 8))]  # fmt: skip
HBM_MIN_BYTES = 256 << 20  # the copies a graph walks: over 5x the H200's 50 MB L2


def graph_us(calls, reps: int) -> float:
    """Median microseconds a call of one replayed CUDA graph of `calls` (callables)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up: compiles, cuBLAS workspaces
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def copy_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    seconds = graph_us([lambda: b.copy_(a)], 10) / 1e6
    return 2 * a.numel() / seconds / 1e9


def sweep_tiles(rows: int) -> list[wo.MMTiles]:
    block_m = 16 if rows <= 16 else 32
    grid = itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4))
    return [wo.MMTiles(block_m, n, k, w, s) for n, k, w, s in grid]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16", help="activation rows (tokens of a step)")
    parser.add_argument("--reps", type=int, default=20, help="graph replays a cell (medians)")
    parser.add_argument("--sweep", action="store_true", help="also the fp8 kernel's best tiles")
    parser.add_argument("--gemv-sweep", action="store_true",
                        help="also the int8 GEMV kernel at other shapes (rows <= GEMV_MAX_ROWS)",
                        )  # fmt: skip
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    print("seed 0")
    bandwidth = copy_gbs()
    rows_out = []
    for model in args.shapes.split(","):
        for name, n, k in SHAPES[model]:
            w = torch.randn(n, k, device="cuda") * 0.02
            copies = max(1, -(-HBM_MIN_BYTES // (n * k)))  # by fp8's bytes; bf16's are twice
            fp8 = [quantize_fp8(w) for _ in range(copies)]
            int8 = [quantize_int8(w, torch.bfloat16) for _ in range(copies)]
            bf16 = [w.bfloat16() for _ in range(copies)]
            del w
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, device="cuda").bfloat16()
                cells = {  # label: (the calls, one per weight copy; bytes per weight)
                    "bf16 cuBLAS": ([partial(F.linear, x, b) for b in bf16], 2),
                    "fp8 _scaled_mm": ([partial(fp8_scaled_mm, x, *w) for w in fp8], 1),
                    "fp8 weight-only": ([partial(wo.weight_only_mm, x, *w) for w in fp8], 1),
                    "int8 weight-only": ([partial(wo.weight_only_mm, x, *w) for w in int8], 1),
                }
                if rows <= wo.GEMV_MAX_ROWS:  # the defaults above are the GEMV kernel's
                    tiles = wo.default_tiles(rows, n, k, wo._num_sms(x.device))
                    tile_calls = [partial(wo.weight_only_mm, x, *w, tiles) for w in int8]
                    cells["int8 tile kernel"] = (tile_calls, 1)
                    for t in GEMV_SWEEP if args.gemv_sweep else ():
                        calls = [partial(wo.weight_only_mm, x, *w, t) for w in int8]
                        cells[f"int8 gemv {t.block_n},{t.block_k},{t.num_warps}"] = (calls, 1)
                base = None
                for label, (calls, elem) in cells.items():
                    us = graph_us(calls, args.reps)
                    base = base or us
                    gbs = n * k * elem / (us / 1e6) / 1e9
                    rows_out.append([model, name, str(rows), label, f"{us:.1f}",
                                     f"{100 * gbs / bandwidth:.0f}%", f"{base / us:.2f}",
                                     ""])  # fmt: skip
                if args.sweep:
                    best = None
                    for t in sweep_tiles(rows):
                        try:
                            calls = [partial(wo.weight_only_mm, x, *w, t) for w in fp8]
                            us = graph_us(calls, max(3, args.reps // 4))
                        except Exception:  # noqa: BLE001 - a shape that does not compile
                            continue
                        best = min(best or (us, t), (us, t), key=lambda c: c[0])
                    if best:
                        us, t = best
                        gbs = n * k / (us / 1e6) / 1e9
                        rows_out.append([model, name, str(rows), "fp8 weight-only, best",
                                         f"{us:.1f}", f"{100 * gbs / bandwidth:.0f}%",
                                         f"{base / us:.2f}",
                                         f"{t.block_n},{t.block_k},{t.num_warps},{t.num_stages}",
                                         ])  # fmt: skip
            del fp8, int8, bf16
            torch.cuda.empty_cache()
    print(
        f"device copy bandwidth (read + write) in this run: {bandwidth:.0f} GB/s; "
        "% = the weights' bytes a call over its time, against it"
    )
    print_table([Column("model", 13, "<"), Column("linear", 14, "<"), Column("rows", 4),
                 Column("kernel", 21, "<"), Column("us", 7), Column("% copy", 6),
                 Column("vs bf16", 7), Column("tiles n,k,w,s", 13, "<")], rows_out)  # fmt: skip


if __name__ == "__main__":
    main()
