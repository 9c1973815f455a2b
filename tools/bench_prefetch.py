"""What reading a call's experts ahead of it would save: the kernel's time on a call whose first j
routed experts were just read by the kernel's own threads, beside the same call cold.

Between two MoE layers of a decode step the worker idles while the GPU runs its part of the layer:
DRAM time nobody uses. If the experts the next layer routes to were read then (predicted, say, by
the next layer's router applied to this layer's activations), the next call would find them in the
cores' caches. This measures both sides of that trade on the kernel alone: how long reading an
expert takes on the pool (MoEKernel.stream_read over its packed rows, one pool run per tensor), and
how much of the next call it takes off (what it found, and why the read-ahead was not built:
docs/results/2026-12-02-chained-decode-steps.md).

Each measured call's weights start out of cache, one of two ways: --cold rotate (default) runs
the calls over enough copies of the layer (>= 8x the last-level cache, as bench_moe_kernel does),
each call on the copy used least recently, as a decode step's layers follow one another;
--cold flush reads --flush-gb first, which also evicts the page tables' lines (a colder start than
a decode step's). Then the call's first j distinct routed experts are read, then the call is
timed. The j values are interleaved call by call (the order rotating), so drift hits all alike.
"again" in --experts adds a row whose call ran once just before, untimed: its weights as hot as
this pool leaves them, the kernel's own speed with no DRAM wait.

    python tools/bench_prefetch.py [--threads 15] [--shape qwen3|dsv3] [--format int4]
        [--tokens 1] [--experts 0,1,2,4,8,again] [--calls 40] [--cold rotate|flush] [--flush-gb 1.0]
        [--seed 1234]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe_kernel import (  # noqa: E402
    SHAPES,
    Shape,
    layers_past_llc,
    replicate,
    routing,
    seed_weights,
)
from bench.common import Column, llc_bytes, print_table, stream_read_gbs  # noqa: E402
from expert_service.kernels import MoEKernel, PackedExperts, pack_experts  # noqa: E402

AGAIN = -1  # in PrefetchConfig.experts: the call itself ran just before


@dataclass(frozen=True)
class PrefetchConfig:
    threads: int
    shape: str
    fmt: str
    tokens: int
    experts: tuple[int, ...]  # how many of a call's distinct experts are read ahead, or AGAIN
    calls: int
    cold: str  # "rotate" or "flush"
    flush_gb: float
    seed: int


@dataclass
class Sample:
    read_us: list[float]
    call_us: list[float]


def distinct_experts(ids: torch.Tensor) -> list[int]:
    """A call's routed experts, each once, in the order its tokens name them."""
    return list(dict.fromkeys(int(e) for e in ids.flatten().tolist() if e >= 0))


def read_ahead(kernel: MoEKernel, packed: PackedExperts, experts: list[int]) -> None:
    """Every packed tensor's row of each expert read by the kernel's threads."""
    for e in experts:
        for t in packed.tensors.values():
            kernel.stream_read(t[e])


def run(cfg: PrefetchConfig) -> tuple[dict[int, Sample], float, float, int]:
    """Each j's read-ahead and call times; the DRAM read rate (GB/s: the median of the pool's best
    reads before and after the calls); an expert's MB; the layer copies rotated."""
    shape: Shape = SHAPES[cfg.shape]
    E, H = shape.num_experts, shape.hidden_size
    rng = torch.Generator().manual_seed(cfg.seed)
    seed = pack_experts(*seed_weights(rng, shape), cfg.fmt)
    copies = 1 if cfg.cold == "flush" else layers_past_llc(seed, E, 8, llc_bytes())
    layers = [replicate(seed, E) for _ in range(copies)]
    routes = [routing(rng, cfg.tokens, shape) for _ in range(cfg.calls)]
    x = torch.randn(cfg.tokens, H, generator=rng).to(torch.bfloat16)
    out = torch.empty(cfg.tokens, H)
    flush = np.ones(int(cfg.flush_gb * 1e9) // 8, dtype=np.uint64) if cfg.cold == "flush" else None
    samples = {j: Sample([], []) for j in cfg.experts}
    dram = [stream_read_gbs(cfg.threads, cfg.flush_gb, pin=False)]
    used = 0  # calls run: the next one goes to layers[used % copies]
    with MoEKernel(cfg.threads) as kernel:
        for packed in layers:  # warm-up: the pool, its buffers, first touches
            kernel.forward(packed, x, *routes[0], out)
        for c, (ids, w) in enumerate(routes):
            order = cfg.experts[c % len(cfg.experts) :] + cfg.experts[: c % len(cfg.experts)]
            experts = distinct_experts(ids)
            for j in order:
                packed = layers[used % copies]
                used += 1
                if flush is not None:
                    kernel.stream_read(flush)
                t1 = time.perf_counter()
                if j == AGAIN:
                    kernel.forward(packed, x, ids, w, out)
                else:
                    read_ahead(kernel, packed, experts[:j])
                t2 = time.perf_counter()
                kernel.forward(packed, x, ids, w, out)
                t3 = time.perf_counter()
                samples[j].read_us.append((t2 - t1) * 1e6)
                samples[j].call_us.append((t3 - t2) * 1e6)
    dram.append(stream_read_gbs(cfg.threads, cfg.flush_gb, pin=False))
    return samples, float(np.median(dram)), seed.expert_nbytes / 1e6, copies


def report(
    cfg: PrefetchConfig, samples: dict[int, Sample], dram: float, expert_mb: float, copies: int
) -> None:
    shape = SHAPES[cfg.shape]
    cold = f"{copies} copies of the layer rotated" if cfg.cold == "rotate" else "a flush each"
    print(f"{shape.name} {cfg.fmt}, T={cfg.tokens}, {cfg.threads} threads, {cfg.calls} calls per "
          f"row, cold by {cold}; an expert {expert_mb:.2f} MB; DRAM read ({cfg.flush_gb:g} GB on "
          f"a pool, before and after) median {dram:.1f} GB/s; seed {cfg.seed}")  # fmt: skip
    base = statistics.median(samples[0].call_us) if 0 in samples else None
    columns = [Column("experts read ahead", 18), Column("MB", 6), Column("read-ahead us", 13),
               Column("call us", 8), Column("p10-p90 us", 15), Column("call / j=0", 10),
               Column("us saved per us read", 20)]  # fmt: skip
    rows = []
    for j in cfg.experts:
        s = samples[j]
        call = statistics.median(s.call_us)
        read = statistics.median(s.read_us)
        p10, p90 = np.percentile(s.call_us, [10, 90])
        saved = f"{(base - call) / read:.2f}" if base is not None and j > 0 else ""
        ratio = f"{call / base:.3f}" if base is not None else ""
        label, mb = ("again", "") if j == AGAIN else (str(j), f"{j * expert_mb:.1f}")
        rows.append([label, mb, f"{read:.1f}", f"{call:.1f}", f"{p10:.1f}-{p90:.1f}", ratio, saved])
    print_table(columns, rows)


def parse(argv: list[str] | None = None) -> PrefetchConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=15)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    p.add_argument("--format", dest="fmt", choices=("int4", "int8", "bf16"), default="int4")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument(
        "--experts",
        default="0,1,2,4,8,again",
        help="experts read ahead, comma-separated; 'again': the call itself",
    )
    p.add_argument("--calls", type=int, default=40, help="calls per row")
    p.add_argument(
        "--cold",
        choices=("rotate", "flush"),
        default="rotate",
        help="how a call's weights leave the caches (see above)",
    )
    p.add_argument(
        "--flush-gb",
        type=float,
        default=1.0,
        help="GB read for the DRAM rate (before and after the calls) and, with --cold flush, "
        "before each call",
    )
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    try:
        experts = tuple(AGAIN if v == "again" else int(v) for v in a.experts.split(","))
    except ValueError:
        p.error(f"--experts takes counts and 'again', got {a.experts!r}")
    if min(experts) < AGAIN or a.calls < 1 or a.tokens < 1 or a.flush_gb <= 0:
        p.error("--experts >= 0 or 'again', --calls >= 1, --tokens >= 1 and --flush-gb > 0")
    return PrefetchConfig(
        a.threads, a.shape, a.fmt, a.tokens, experts, a.calls, a.cold, a.flush_gb, a.seed
    )


def main() -> None:
    cfg = parse()
    report(cfg, *run(cfg))


if __name__ == "__main__":
    main()
