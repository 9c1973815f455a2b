"""CPU MoE kernel benchmark: time per layer, effective weight bandwidth and TFLOPS per format.

Weights of `--layers` layers are rotated so that the packed bytes exceed the last-level cache
several times over (by default >= 8x LLC per shape and format). In the same run it measures the
DRAM read bandwidth (torch.sum over a large buffer at the same thread count) and a plain PyTorch
bf16 loop over the selected experts at T=1 (the baseline). Prints one table.

    python bench/bench_moe_kernel.py [--threads 15] [--shapes qwen3,dsv3] [--formats int8,int4]

--x-dtypes bf16,f32 also times fp32 activations (with bf16 weights: the exact fp32 path; int8/int4
quantize x per token whatever its dtype). --prefill-tokens 0 skips the prefill row.

Effective GB/s = bytes of the distinct experts a call touches / time per call.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from expert_service.kernels import MoEKernel, PackedExperts, default_isa, pack_experts


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int


SHAPES = {
    "qwen3": Shape("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "dsv3": Shape("DeepSeek-V3", 256, 8, 7168, 2048),
}
X_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
SEED_EXPERTS = 4  # really quantized experts; the rest of a layer repeats their packed bytes


@dataclass(frozen=True)
class BenchConfig:
    threads: int
    shapes: tuple[str, ...]
    formats: tuple[str, ...]
    decode_tokens: tuple[int, ...]
    prefill_tokens: int  # 0: none
    x_dtypes: tuple[str, ...]
    layers: int  # 0: enough for min_llc_multiple x LLC
    min_llc_multiple: float
    llc_bytes: int
    seed: int
    min_seconds: float
    dram_gb: float
    pin: bool
    torch_baseline: bool

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        unknown = set(self.shapes) - set(SHAPES)
        if unknown:
            raise ValueError(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
        bad = set(self.x_dtypes) - set(X_DTYPES)
        if bad:
            raise ValueError(f"unknown x dtypes {sorted(bad)}; known: {sorted(X_DTYPES)}")


def llc_bytes() -> int:
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for entry in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


def dram_read_gbs(threads: int, gb: float) -> float:
    """Best of 3 torch.sum passes over a buffer of `gb` GB at `threads` torch threads."""
    torch.set_num_threads(threads)
    buf = torch.ones(int(gb * 1e9) // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(4):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def routing(rng: torch.Generator, T: int, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(T, shape.num_experts, generator=rng)
    w, ids = scores.topk(shape.top_k, dim=1)
    return ids.to(torch.int32).contiguous(), (w / w.sum(1, keepdim=True)).contiguous()


def replicate(seed: PackedExperts, num_experts: int) -> PackedExperts:
    """num_experts experts whose packed bytes repeat the seed experts (in distinct memory)."""
    tensors = {}
    for name, t in seed.tensors.items():
        dst = np.empty((num_experts, t.shape[1]), t.dtype)
        reps = math.ceil(num_experts / t.shape[0])
        src = torch.from_numpy(t).repeat(reps, 1)[:num_experts]
        torch.from_numpy(dst).copy_(src)  # multithreaded copy: first touch on many cores
        tensors[name] = dst
    return PackedExperts.from_tensors(
        seed.fmt, num_experts, seed.hidden_size, seed.intermediate_size, tensors
    )


def time_calls(fn, min_seconds: float, min_calls: int = 8) -> float:
    """Mean seconds per call over at least min_calls calls and min_seconds (after 2 warm-ups)."""
    fn(0)
    fn(1)
    calls, t0 = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - t0 < min_seconds:
        fn(calls)
        calls += 1
    return (time.perf_counter() - t0) / calls


def bench_torch_loop(cfg: BenchConfig, shape: Shape, rng: torch.Generator) -> tuple[float, float]:
    """Plain PyTorch bf16 loop over the selected experts at T=1: (seconds, GB/s)."""
    torch.set_num_threads(cfg.threads)
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size  # noqa: E741
    layer_bytes = 3 * E * H * I * 2
    layers = cfg.layers or max(1, math.ceil(cfg.min_llc_multiple * cfg.llc_bytes / layer_bytes))
    seed_w = torch.randn(SEED_EXPERTS, 3, I, H, generator=rng).mul_(0.02).bfloat16()
    weights = []
    for _ in range(layers):
        w = torch.empty(E, 3, I, H, dtype=torch.bfloat16)
        w.copy_(seed_w.repeat(math.ceil(E / SEED_EXPERTS), 1, 1, 1)[:E])
        weights.append(w)
    routes = [routing(rng, 1, shape) for _ in range(64)]
    x = torch.randn(1, H, generator=rng).bfloat16()

    def call(i: int) -> None:
        ids, w = routes[i % len(routes)]
        layer = weights[i % layers]
        y = torch.zeros(1, H, dtype=torch.bfloat16)
        for j in range(shape.top_k):
            gu = layer[int(ids[0, j])]
            h = torch.nn.functional.silu(x @ gu[0].T) * (x @ gu[1].T)
            y += w[0, j] * (h @ gu[2])  # down stored transposed: [I, H]
        return y

    sec = time_calls(call, cfg.min_seconds)
    return sec, shape.top_k * 3 * H * I * 2 / sec / 1e9


@dataclass(frozen=True)
class Row:
    shape: str
    impl: str
    tokens: int
    us: float
    gbs: float
    tflops: float


def bench_format(cfg: BenchConfig, shape: Shape, fmt: str, rng: torch.Generator) -> list[Row]:
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size  # noqa: E741
    g = torch.randn(SEED_EXPERTS, I, H, generator=rng) * 0.02
    u = torch.randn(SEED_EXPERTS, I, H, generator=rng) * 0.02
    d = torch.randn(SEED_EXPERTS, H, I, generator=rng) * 0.02
    seed_packed = pack_experts(g, u, d, fmt)
    del g, u, d
    layer_bytes = seed_packed.expert_nbytes * E
    layers = cfg.layers or max(1, math.ceil(cfg.min_llc_multiple * cfg.llc_bytes / layer_bytes))
    packed = [replicate(seed_packed, E) for _ in range(layers)]
    rows = []
    tokens = (*cfg.decode_tokens, *((cfg.prefill_tokens,) if cfg.prefill_tokens else ()))
    with MoEKernel(cfg.threads, pin=cfg.pin) as kern:
        for xd in cfg.x_dtypes:
            for T in tokens:
                routes = [routing(rng, T, shape) for _ in range(16)]
                x = torch.randn(T, H, generator=rng).to(X_DTYPES[xd])
                out = torch.empty(T, H, dtype=torch.bfloat16)
                touched = [len(torch.unique(r[0])) for r in routes]

                def call(i: int, routes=routes, x=x, out=out) -> None:
                    ids, w = routes[i % len(routes)]
                    kern.forward(packed[i % layers], x, ids, w, out)

                sec = time_calls(call, cfg.min_seconds)
                gbs = np.mean(touched) * seed_packed.expert_nbytes / sec / 1e9
                tflops = 2 * 3 * H * I * T * shape.top_k / sec / 1e12
                impl = f"{fmt} x{layers}L" + ("" if xd == "bf16" else f" x={xd}")
                rows.append(Row(shape.name, impl, T, sec * 1e6, gbs, tflops))
    return rows


def main() -> None:
    cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=max(1, cpus - 1))
    p.add_argument("--shapes", default="qwen3,dsv3")
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--tokens", default="1,4,16", help="decode token counts")
    p.add_argument("--prefill-tokens", type=int, default=512, help="0: no prefill row")
    p.add_argument("--x-dtypes", default="bf16", help="activation dtypes: bf16,f32")
    p.add_argument("--layers", type=int, default=0, help="0: enough for --llc-multiple x LLC")
    p.add_argument("--llc-multiple", type=float, default=8.0)
    p.add_argument("--llc-mb", type=float, default=0, help="0: read from sysfs")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--min-seconds", type=float, default=0.5, help="per measurement")
    p.add_argument("--dram-gb", type=float, default=4.0)
    p.add_argument("--pin", action="store_true")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch loop baseline")
    a = p.parse_args()
    cfg = BenchConfig(
        threads=a.threads,
        shapes=tuple(a.shapes.split(",")),
        formats=tuple(a.formats.split(",")),
        decode_tokens=tuple(int(t) for t in a.tokens.split(",")),
        prefill_tokens=a.prefill_tokens,
        x_dtypes=tuple(a.x_dtypes.split(",")),
        layers=a.layers,
        min_llc_multiple=a.llc_multiple,
        llc_bytes=int(a.llc_mb * (1 << 20)) or llc_bytes(),
        seed=a.seed,
        min_seconds=a.min_seconds,
        dram_gb=a.dram_gb,
        pin=a.pin,
        torch_baseline=not a.no_torch,
    )
    rng = torch.Generator().manual_seed(cfg.seed)
    dram = dram_read_gbs(cfg.threads, cfg.dram_gb)
    print(
        f"seed={cfg.seed} threads={cfg.threads} isa={default_isa()} cpus={cpus} "
        f"LLC={cfg.llc_bytes / 2**20:.0f} MiB DRAM read={dram:.1f} GB/s "
        f"(torch.sum over {cfg.dram_gb:g} GB, {cfg.threads} threads)"
    )
    rows: list[Row] = []
    base_us: dict[str, float] = {}
    for key in cfg.shapes:
        shape = SHAPES[key]
        if cfg.torch_baseline:
            sec, gbs = bench_torch_loop(cfg, shape, rng)
            base_us[shape.name] = sec * 1e6
            tflops = 2 * 3 * shape.hidden_size * shape.intermediate_size * shape.top_k / sec / 1e12
            rows.append(Row(shape.name, "torch bf16 loop", 1, sec * 1e6, gbs, tflops))
        for fmt in cfg.formats:
            rows.extend(bench_format(cfg, shape, fmt, rng))
    head = (
        f"{'shape':<14} {'impl':<22} {'T':>4} {'us/layer':>10} {'GB/s':>7} {'%DRAM':>6} "
        f"{'TFLOPS':>7} {'vs torch':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        speedup = base_us.get(r.shape, 0) / r.us if r.tokens == 1 and r.shape in base_us else 0
        print(
            f"{r.shape:<14} {r.impl:<22} {r.tokens:>4} {r.us:>10.1f} {r.gbs:>7.1f} "
            f"{100 * r.gbs / dram:>5.0f}% {r.tflops:>7.2f} "
            + (f"{speedup:>7.2f}x" if speedup else f"{'':>8}")
        )


if __name__ == "__main__":
    main()
