"""MLA prefill, absorbed against expanded (gpu_service/attention/mla_prefill.py), side by side.

One prompt chunk at the end of a sequence's context, random weights and latent cache (shuffled
blocks of 64 tokens), in the model dtype (bf16): the attention part of a DeepSeek layer from the
roped queries on (q_nope, q_rot) to the per-head values before o_proj.
- absorbed: deepseek.absorbed_attention (queries W_uk^T q_nope over the latent [c | k_rot],
  values c, then W_uv: the decode path, and short chunks'; on CUDA through the torch reference,
  as a model's AttentionBackend picks for the latent);
- expanded: mla_prefill.expanded_prefill (keys decompressed per head, a key block of
  EXPANDED_BLOCK_BYTES at a time; on CUDA through the Triton prefill kernel, which serving uses;
  elsewhere through the torch reference, which serving does not: on the CPU it stays absorbed).
Each cell is the median of --reps calls, the two alternated; FLOPs counted per visible
query-key pair (causal) plus the expansion, per the formulas in mla_prefill's docstring.

    python bench/bench_mla_prefill.py [--shape demo|deepseek-v3] [--contexts 2048,4096]
        [--chunks 128,512,2048] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

import torch

from bench.common import Column, default_device, print_table
from gpu_service.attention import mla_prefill
from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.batch import AttentionGroup
from gpu_service.attention.paged_attention import paged_prefill
from gpu_service.models.deepseek import absorbed_attention

BLOCK = 64


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    nope: int
    rope: int
    rank: int
    v: int


SHAPES = {
    "demo": Shape("demo", 8, 32, 16, 64, 32),  # demo_model/config.json
    "deepseek-v3": Shape("deepseek-v3", 128, 128, 64, 512, 128),
}


class Case:
    def __init__(self, s: Shape, context: int, chunk: int, device: str, dtype: torch.dtype):
        g = torch.Generator().manual_seed(context + chunk)
        blocks = -(-context // BLOCK)
        order = torch.randperm(blocks + 1, generator=g).to(torch.int32)[:blocks]
        self.cache = torch.randn(((blocks + 1) * BLOCK, s.rank + s.rope), generator=g).to(
            device, dtype
        )
        q = torch.randn((chunk, s.heads, s.nope + s.rope), generator=g).to(device, dtype)
        self.q_nope, self.q_rot = q.split([s.nope, s.rope], dim=-1)
        scale = s.rank**-0.5
        self.w_uk = (torch.randn((s.heads, s.nope, s.rank), generator=g) * scale).to(device, dtype)
        self.w_uv = (torch.randn((s.heads, s.v, s.rank), generator=g) * scale).to(device, dtype)
        i32 = dict(dtype=torch.int32, device=device)
        self.group = AttentionGroup(slice(0, chunk), order[None, :].to(device),
                                    torch.tensor([0, chunk], **i32),
                                    torch.tensor([context], **i32))  # fmt: skip
        self.scale = (s.nope + s.rope) ** -0.5
        self.shape, self.context, self.chunk = s, context, chunk
        self.backend = AttentionBackend.choose(device, dtype, dtype, s.rank + s.rope)

    def absorbed(self) -> torch.Tensor:
        attend = partial(self.backend.attend_group, group=self.group, block_size=BLOCK,
                         scale=self.scale, prefill=True)  # fmt: skip
        return absorbed_attention(self.q_nope, self.q_rot, self.cache, self.w_uk, self.w_uv,
                                  attend)  # fmt: skip

    def expanded(self) -> torch.Tensor:
        kernel = self.backend.expanded_prefill_kernel() or paged_prefill
        q_nope, q_rot, w_uk, w_uv = self.q_nope, self.q_rot, self.w_uk, self.w_uv
        return mla_prefill.expanded_prefill(q_nope, q_rot, self.cache, self.group, BLOCK, w_uk,
                                            w_uv, self.scale, kernel)  # fmt: skip

    def flops(self) -> tuple[float, float]:
        """(absorbed, expanded) multiply-adds x 2 over the visible pairs."""
        s, n, ctx = self.shape, self.chunk, self.context
        pairs = n * (ctx - n) + n * (n + 1) / 2
        absorbed = pairs * s.heads * (2 * s.rank + s.rope) + n * s.heads * s.rank * (s.nope + s.v)
        expanded = pairs * s.heads * (s.nope + s.rope + s.v) + ctx * s.rank * s.heads * (
            s.nope + s.v
        )
        return 2 * absorbed, 2 * expanded


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--contexts", default="2048,4096", help="tokens of context per case")
    parser.add_argument("--chunks", default="128,512,2048", help="prompt tokens of the chunk")
    parser.add_argument("--reps", type=int, default=5, help="calls per cell (medians)")
    parser.add_argument("--device", default=default_device())
    args = parser.parse_args()
    shape, device = SHAPES[args.shape], args.device
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for chunk in (int(c) for c in args.chunks.split(",")):
            if chunk > context:
                continue
            case = Case(shape, context, chunk, device, torch.bfloat16)
            diff = (case.absorbed().float() - case.expanded().float()).abs().max().item()
            times: dict[str, list[float]] = {"absorbed": [], "expanded": []}
            for _ in range(args.reps):
                times["absorbed"].append(timed(case.absorbed, device))
                times["expanded"].append(timed(case.expanded, device))
            a, e = (statistics.median(times[k]) for k in ("absorbed", "expanded"))
            fa, fe = case.flops()
            rows.append((str(context), str(chunk), f"{a * 1e3:.2f}", f"{e * 1e3:.2f}",
                         f"{a / e:.2f}x", f"{fa / a / 1e12:.2f}", f"{fe / e / 1e12:.2f}",
                         "yes" if mla_prefill.worth_expanding(chunk, shape.rank, shape.nope,
                                                              shape.v) else "no",
                         f"{diff:.1e}"))  # fmt: skip
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    threads = "" if device == "cuda" else f", {torch.get_num_threads()} torch threads"
    gpu = AttentionBackend.choose(device, torch.bfloat16, torch.bfloat16).gpu_kernels
    kernel = "Triton" if gpu else "torch reference"
    print(f"MLA prefill at {shape.name} shapes ({shape.heads} heads, r {shape.rank}, nope "
          f"{shape.nope}, rope {shape.rope}, v {shape.v}), bf16 on {device}{threads}, medians "
          f"of {args.reps}, alternated; expanded through the {kernel}")  # fmt: skip
    cols = [Column("context", 7), Column("chunk", 5), Column("absorbed ms", 11),
            Column("expanded ms", 11), Column("speedup", 7), Column("abs TFLOP/s", 11),
            Column("exp TFLOP/s", 11), Column("> crossover", 11),
            Column("max|diff|", 9)]  # fmt: skip
    print_table(cols, rows)


if __name__ == "__main__":
    main()
