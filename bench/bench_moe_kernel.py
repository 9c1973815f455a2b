"""CPU MoE kernel benchmark: time per layer, effective weight bandwidth and TFLOPS per format.

Weights of `--layers` layers are rotated so that the packed bytes exceed the last-level cache
several times over (by default >= 8x LLC per shape and format). In the same run it measures the
DRAM read bandwidth at the same thread count two ways, torch.sum over a large buffer and a plain
streaming read on a kernel pool like the one timed (MoEKernel.stream_read), at the start, after
each shape and at the end, and gives % of DRAM against the higher of the two medians; and a plain
PyTorch bf16 loop over the selected experts at T=1 (the baseline). Prints one table.

    python bench/bench_moe_kernel.py [--threads 15] [--shapes qwen3,dsv3] [--formats int8,int4]
        [--repeats 3] [--peer kt-kernel] [--peer-formats int8,int4,int4g32]

--repeats N times every (shape, impl, T) N times, interleaved: round-robin over the token counts
and between ours and the peer, so that drift hits all alike (the PyTorch loop: N times in a row);
the table gives the median and the min-max. --peer kt-kernel adds kt-kernel's MoE
(bench/peers/kt_kernel.py) on the same shapes, routings, inputs and thread count, in the formats
--peer-formats names: int8 and int4 (AMX, one scale per row) from the same bf16 weights quantized
by its own loader, int4g32 (its RAWINT4 kernel, one scale per group of 32 as ours) from the same
bf16 weights quantized here into its layout; "ours/kt" = our time / its time for the same shape and
T, against our int8 for its int8 and our int4 for its int4 and int4g32. Where kt-kernel cannot be
imported, or lacks a format's class, one line says why and the run goes on without it.

--baseline-tree DIR adds another source tree's build of the kernel (its extensions built in
place; bench/baseline_kernel.py), loaded in this process beside ours and timed in turn with it on
the same packed weights, routings and inputs: rows "baseline <fmt>", "ours/them" = our time / its
time. DIR,DIR2,... times several (variants of one change): rows "baseline:<folder name> <fmt>".
Each one's output must agree with ours (same packed layout) or its rows are dropped. Two
processes of the same code time apart (expert_service/kernels/README.md); within one the kernels
alternate call batch by call batch.

--huge-pages also times ours on a copy of the packed weights in memory advised for transparent
huge pages (rows "<fmt> ... huge pages"; "ours/them" = time on 4 KiB pages / time on huge ones),
and says how much of the copy huge pages back.

--x-dtypes bf16,f32 also times fp32 activations (with bf16 weights: the exact fp32 path; int8/int4
quantize x per token whatever its dtype). --prefill-tokens 0 skips the prefill row.

Effective GB/s = bytes of the distinct experts a call touches (in each impl's own packed layout) /
time per call.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.baseline_kernel import load_kernel_ext
from bench.common import Column, DramMeter, llc_bytes, print_table, time_calls
from bench.huge_pages import huge_page_bytes, huge_page_empty
from bench.peers.kt_kernel import FORMATS as PEER_FORMATS
from bench.peers.kt_kernel import OURS as PEER_OURS
from bench.peers.kt_kernel import (
    KtLayer,
    KtPeer,
    build_layers,
    load_kt_kernel,
    rel_err,
    tiled_bf16,
)
from bench.peers.kt_kernel import expert_nbytes as peer_expert_nbytes
from expert_service.kernels import MoEKernel, PackedExperts, default_isa, pack_experts
from expert_service.kernels.kernel import MARKS
from tests.support.reference_moe import reference_moe


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
PEERS = ("none", "kt-kernel")
# Routings per token count: a prime, so a (layer, routing) pair comes back only after layers x 61
# calls. With 16 and 8 layers, the same experts came back every 16 calls, 16 x 20 MB at T=1 for
# Qwen3 int4: inside the 300 MB LLC, so that row read cached weights (125% of DRAM).
ROUTINGS = 61
SEED_EXPERTS = 4  # really quantized experts; the rest of a layer repeats their packed bytes
SETTLE_S = 0.1  # pause after each measurement: kt-kernel's pool threads spin 50 ms after a call
PEER_MAX_DIFF = 0.7  # relative difference from our output above which the peer's rows are dropped
# the baseline tree's kernel reads the same packed weights: its output differs from ours by
# rounding only (a changed h rounds a few int8 steps otherwise), so a layout change shows
BASELINE_MAX_DIFF = 1e-2


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
    repeats: int
    peer: str
    peer_formats: tuple[str, ...] = tuple(PEER_FORMATS)
    baseline_trees: tuple[str, ...] = ()  # other trees' kernel builds, timed beside ours here
    huge_pages: bool = False  # also ours on a copy of the weights in transparent huge pages

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        unknown = set(self.shapes) - set(SHAPES)
        if unknown:
            raise ValueError(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
        bad = set(self.x_dtypes) - set(X_DTYPES)
        if bad:
            raise ValueError(f"unknown x dtypes {sorted(bad)}; known: {sorted(X_DTYPES)}")
        if self.peer not in PEERS:
            raise ValueError(f"unknown peer {self.peer!r}; known: {PEERS}")
        bad = set(self.peer_formats) - set(PEER_FORMATS)
        if bad:
            raise ValueError(f"unknown peer formats {sorted(bad)}; known: {list(PEER_FORMATS)}")

    @property
    def tokens(self) -> tuple[int, ...]:
        return (*self.decode_tokens, *((self.prefill_tokens,) if self.prefill_tokens else ()))


def routing(rng: torch.Generator, T: int, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(T, shape.num_experts, generator=rng)
    w, ids = scores.topk(shape.top_k, dim=1)
    return ids.to(torch.int32).contiguous(), (w / w.sum(1, keepdim=True)).contiguous()


def in_huge_pages(packed: PackedExperts) -> PackedExperts:
    """A copy of packed in memory advised for transparent huge pages (huge_page_empty)."""
    tensors = {}
    for name, t in packed.tensors.items():
        tensors[name] = huge_page_empty(t.shape, t.dtype)
        torch.from_numpy(tensors[name]).copy_(torch.from_numpy(t))  # first touch on many cores
    return PackedExperts.from_tensors(
        packed.fmt, packed.num_experts, packed.hidden_size, packed.intermediate_size, tensors
    )


def seed_weights(rng: torch.Generator, shape: Shape) -> tuple[torch.Tensor, ...]:
    """(gate [S, I, H], up [S, I, H], down [S, H, I]) of the SEED_EXPERTS really quantized experts
    whose packed bytes a layer repeats (replicate), std 0.02."""
    H, I = shape.hidden_size, shape.intermediate_size  # noqa: E741
    dims = ((SEED_EXPERTS, I, H), (SEED_EXPERTS, I, H), (SEED_EXPERTS, H, I))
    return tuple(torch.randn(*d, generator=rng) * 0.02 for d in dims)


def layers_past_llc(seed: PackedExperts, num_experts: int, multiple: float, llc: int) -> int:
    """How many copies of a layer of num_experts experts (seed's packed size each) hold at least
    `multiple` times the last-level cache's `llc` bytes (at least one)."""
    return max(1, math.ceil(multiple * llc / (seed.expert_nbytes * num_experts)))


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


@dataclass(frozen=True)
class Series:
    """One (impl, T) measurement: its call and the seconds per call of every repeat."""

    impl: str
    fmt: str  # "torch" for the PyTorch loop; for a peer, our format it is compared with
    tokens: int
    x_dtype: str
    peer: bool
    bytes_per_call: float
    flops_per_call: float
    call: Callable[[int], object]
    seconds: list[float] = field(default_factory=list)
    kernel: MoEKernel | None = None  # ours: the kernel whose phase marks split a call


@dataclass(frozen=True)
class Row:
    shape: str
    impl: str
    fmt: str
    tokens: int
    x_dtype: str
    peer: bool
    us: float  # median over the repeats
    us_min: float
    us_max: float
    gbs: float
    tflops: float


def row_of(shape: str, s: Series) -> Row:
    sec = statistics.median(s.seconds)
    lo, hi = min(s.seconds) * 1e6, max(s.seconds) * 1e6
    gbs, tflops = s.bytes_per_call / sec / 1e9, s.flops_per_call / sec / 1e12
    return Row(shape, s.impl, s.fmt, s.tokens, s.x_dtype, s.peer, sec * 1e6, lo, hi, gbs, tflops)


def measure(cfg: BenchConfig, series: list[Series]) -> list[Series]:
    """cfg.repeats rounds; in each, token counts in order and every series of a count in turn.

    A series whose call raises is dropped (with the reason printed), never estimated.
    """
    alive = list(series)
    for _ in range(cfg.repeats):
        for T in cfg.tokens:
            for s in [s for s in alive if s.tokens == T]:
                try:
                    s.seconds.append(time_calls(s.call, cfg.min_seconds))
                except Exception as e:
                    print(f"{s.impl} T={T}: omitted: {type(e).__name__}: {e}")
                    alive.remove(s)
                time.sleep(SETTLE_S)
    return alive


def moe_flops(shape: Shape, T: int) -> float:
    return 2 * 3 * shape.hidden_size * shape.intermediate_size * T * shape.top_k


def bench_torch_loop(cfg: BenchConfig, shape: Shape, rng: torch.Generator) -> Row:
    """The reference MoE in bf16 (tests.support.reference_moe: a plain PyTorch loop over the
    selected experts) at T=1, cfg.repeats times."""
    torch.set_num_threads(cfg.threads)
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size  # noqa: E741
    layer_bytes = 3 * E * H * I * 2
    layers = cfg.layers or max(1, math.ceil(cfg.min_llc_multiple * cfg.llc_bytes / layer_bytes))
    seeds = [torch.randn(SEED_EXPERTS, *dims, generator=rng).mul_(0.02).bfloat16()
             for dims in ((I, H), (I, H), (H, I))]  # fmt: skip
    weights = [[tiled_bf16(s, E) for s in seeds] for _ in range(layers)]  # gate, up, down
    routes = [routing(rng, 1, shape) for _ in range(64)]
    x = torch.randn(1, H, generator=rng).bfloat16()

    def call(i: int) -> torch.Tensor:
        ids, w = routes[i % len(routes)]
        return reference_moe(x, ids, w, *weights[i % layers], dtype=torch.bfloat16)

    nbytes = shape.top_k * 3 * H * I * 2
    s = Series("torch bf16 loop", "torch", 1, "bf16", False, nbytes, moe_flops(shape, 1), call)
    for _ in range(cfg.repeats):
        s.seconds.append(time_calls(call, cfg.min_seconds))
        time.sleep(SETTLE_S)
    return row_of(shape.name, s)


def peer_formats_for(cfg: BenchConfig, peer: KtPeer | None, fmt: str) -> list[str]:
    """The peer formats run beside our format fmt."""
    if peer is None:
        return []
    return [f for f in cfg.peer_formats if PEER_OURS[f] == fmt and f in peer.formats]


def peer_layers(
    peer: KtPeer,
    cfg: BenchConfig,
    shape: Shape,
    fmt: str,
    seeds: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ours_layers: int,
) -> list[KtLayer]:
    """kt-kernel's layers for (shape, fmt), as many as ours where memory allows; [] on failure."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size  # noqa: E741
    what = f"kt-kernel {fmt} {shape.name}"
    try:
        layers, note = build_layers(peer, fmt, seeds, E, shape.top_k, ours_layers, max(cfg.tokens))
    except Exception as e:
        print(f"{what}: omitted: {type(e).__name__}: {e}")
        return []
    if not layers:
        print(f"{what}: omitted: {note}")
        return []
    multiple = len(layers) * E * peer_expert_nbytes(fmt, H, I) / cfg.llc_bytes
    short = f" instead of ours' {ours_layers}: {note}" if note else ""
    print(f"{what}: {len(layers)} layer(s), {multiple:.1f}x LLC{short}", flush=True)
    return layers


def peer_agrees(
    peer: KtPeer,
    layer: KtLayer,
    kern: MoEKernel,
    packed: PackedExperts,
    x: torch.Tensor,
    route: tuple[torch.Tensor, torch.Tensor],
    what: str,
) -> bool:
    """kt-kernel's output against ours on one call: a wrong call shows as a large difference."""
    ids, w = route
    inp = peer.inputs(x, ids, w)
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16)
    try:
        peer.forward(layer, inp)
        kern.forward(packed, inp.x, ids, w, out)
    except Exception as e:
        print(f"{what}: omitted: {type(e).__name__}: {e}")
        return False
    return outputs_agree(inp.out.float(), out.float(), PEER_MAX_DIFF, what, "its output is wrong")


def outputs_agree(theirs: torch.Tensor, ours: torch.Tensor, limit: float, what: str,
                  why: str) -> bool:  # fmt: skip
    """Whether another kernel's output [T, H] is finite and within `limit` (relative) of ours;
    prints the difference, and `why` its rows are omitted where not."""
    diff = rel_err(theirs, ours)
    ok = bool(torch.isfinite(theirs).all()) and diff < limit
    verdict = "" if ok else f": omitted (over {limit}: {why})"
    print(f"{what}: output vs ours at T={ours.shape[0]}: relative difference {diff:.2e}{verdict}")
    return ok


def baseline_agrees(
    base: MoEKernel, kern: MoEKernel, packed: PackedExperts, x: torch.Tensor,
    route: tuple[torch.Tensor, torch.Tensor], what: str,
) -> bool:  # fmt: skip
    """The baseline tree's output against ours on one call (the same packed weights)."""
    ids, w = route
    theirs = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
    ours = torch.empty_like(theirs)
    base.forward(packed, x, ids, w, theirs)
    kern.forward(packed, x, ids, w, ours)
    return outputs_agree(theirs, ours, BASELINE_MAX_DIFF, what, "another packed layout?")


def baseline_exts(trees: Sequence[str]) -> list[tuple[str, object]]:
    """Each baseline tree's kernel extension with its rows' label: "baseline" for one tree,
    "baseline:<folder name>" for each of several."""
    labels = ["baseline"] if len(trees) == 1 else [f"baseline:{Path(t).name}" for t in trees]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"baseline trees need distinct folder names: {', '.join(trees)}")
    return [(label, load_kernel_ext(Path(t), i)) for i, (label, t) in enumerate(zip(labels, trees))]


def bench_format(
    cfg: BenchConfig,
    shape: Shape,
    fmt: str,
    rng: torch.Generator,
    peer: KtPeer | None,
    base_exts: Sequence[tuple[str, object]] = (),
) -> list[Row]:
    """Rows for one (shape, format): ours, then each baseline (label, extension) and the peer's."""
    E, H = shape.num_experts, shape.hidden_size
    g, u, d = seed_weights(rng, shape)
    seed_packed = pack_experts(g, u, d, fmt)
    layers = cfg.layers or layers_past_llc(seed_packed, E, cfg.min_llc_multiple, cfg.llc_bytes)
    theirs: dict[str, list[KtLayer]] = {}  # peer format -> its layers
    for pf in peer_formats_for(cfg, peer, fmt):  # before ours: its build needs the most memory
        assert peer is not None
        theirs[pf] = peer_layers(peer, cfg, shape, pf, (g, u, d), layers)
    del g, u, d
    packed = [replicate(seed_packed, E) for _ in range(layers)]
    huge = [in_huge_pages(p) for p in packed] if cfg.huge_pages else []
    if huge:
        covered = sum(huge_page_bytes(t) for p in huge for t in p.tensors.values())
        total = sum(p.nbytes for p in huge)
        print(f"{fmt} {shape.name}: a copy in huge pages, {100 * covered / total:.0f}% of it "
              f"backed by them ({covered / 2**30:.1f} of {total / 2**30:.1f} GiB)")  # fmt: skip
    inputs = {}
    for xd in cfg.x_dtypes:
        for T in cfg.tokens:
            routes = [routing(rng, T, shape) for _ in range(ROUTINGS)]
            inputs[xd, T] = (routes, torch.randn(T, H, generator=rng).to(X_DTYPES[xd]))
    peer_xd = "bf16" if "bf16" in cfg.x_dtypes else cfg.x_dtypes[0]
    with contextlib.ExitStack() as stack:
        kern = stack.enter_context(MoEKernel(cfg.threads, pin=cfg.pin))
        bases = []  # (label, kernel)
        for label, ext in base_exts:
            base = stack.enter_context(MoEKernel(cfg.threads, pin=cfg.pin, ext=ext))
            routes, x = inputs[peer_xd, cfg.tokens[-1]]
            if baseline_agrees(base, kern, packed[0], x, routes[0], f"{label} {fmt} {shape.name}"):
                bases.append((label, base))
        for pf, their in list(theirs.items()):
            assert peer is not None
            routes, x = inputs[peer_xd, cfg.tokens[0]]
            what = f"kt-kernel {pf} {shape.name}"
            if not their or not peer_agrees(peer, their[0], kern, packed[0], x, routes[0], what):
                del theirs[pf]
        series = []
        for T in cfg.tokens:
            for xd in cfg.x_dtypes:
                routes, x = inputs[xd, T]
                series.append(ours_series(kern, packed, seed_packed, xd, routes, x, shape))
                if huge:
                    s = ours_series(kern, huge, seed_packed, xd, routes, x, shape)
                    series.append(replace(s, impl=f"{s.impl} huge pages", peer=True))
                for label, base in bases:
                    s = ours_series(base, packed, seed_packed, xd, routes, x, shape)
                    series.append(replace(s, impl=f"{label} {s.impl}", peer=True))
            for pf, their in theirs.items():
                assert peer is not None
                routes, x = inputs[peer_xd, T]
                series.append(peer_series(peer, their, pf, routes, x, shape))
        series = measure(cfg, series)
        print_phases(shape.name, series)
    return [row_of(shape.name, s) for s in series]


def touched_experts(routes: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return float(np.mean([len(torch.unique(ids)) for ids, _ in routes]))


def ours_series(
    kern: MoEKernel,
    packed: list[PackedExperts],
    seed: PackedExperts,
    xd: str,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    shape: Shape,
) -> Series:
    T = x.shape[0]
    out = torch.empty(T, shape.hidden_size, dtype=torch.bfloat16)

    def call(i: int) -> None:
        ids, w = routes[i % len(routes)]
        kern.forward(packed[i % len(packed)], x, ids, w, out)

    impl = f"{seed.fmt} x{len(packed)}L" + ("" if xd == "bf16" else f" x={xd}")
    nbytes = touched_experts(routes) * seed.expert_nbytes
    return Series(impl, seed.fmt, T, xd, False, nbytes, moe_flops(shape, T), call, kernel=kern)


PHASE_CALLS = 21  # calls whose marks are split, per series
PHASE_COLUMNS = [
    Column("shape", 14, "<"), Column("impl", 22, "<"), Column("T", 4), Column("all in", 7),
    Column("prepared", 8), Column("gathered", 8), Column("gate/up done", 16),
    Column("down done", 18), Column("ended", 18), Column("returned", 9),
]  # fmt: skip


def phase_cells(shape: str, s: Series) -> tuple[list[str], np.ndarray]:
    """Where a call of s goes: microseconds from its start (medians over PHASE_CALLS calls) at
    which the last pool thread began, the activations were prepared and gathered, the first and
    the last thread were done with gate/up and with down work and ended, and the call returned;
    and each thread's own medians ([threads, len(MARKS)] us), to tell which thread ends late."""
    assert s.kernel is not None
    samples, per_thread = [], []  # [call][column], [call][thread][mark]
    for i in range(PHASE_CALLS):
        s.call(i)
        m = s.kernel.last_marks() / 1e3
        per_thread.append(m)
        start, end, _ = s.kernel.last_forward()
        col = {name: m[:, j] for j, name in enumerate(MARKS)}
        samples.append([col["started"].max(), col["prepared"].max(), col["gathered"].max(),
                        col["gate_up_done"].min(), col["gate_up_done"].max(),
                        col["down_done"].min(), col["down_done"].max(),
                        col["ended"].min(), col["ended"].max(), (end - start) / 1e3])  # fmt: skip
    med = np.median(np.array(samples), axis=0)
    span = [f"{med[a]:.1f}-{med[b]:.1f}" for a, b in ((3, 4), (5, 6), (7, 8))]
    cells = [shape, s.impl, str(s.tokens), *(f"{v:.1f}" for v in med[:3]), *span, f"{med[9]:.1f}"]
    return cells, np.median(np.array(per_thread), axis=0)


def thread_line(s: Series, per_thread: np.ndarray) -> str:
    """Each pool thread's median gate/up-done and down-done times (us), and which thread ends
    its down work last, by how much past the median thread."""
    gate = per_thread[:, MARKS.index("gate_up_done")]
    down = per_thread[:, MARKS.index("down_done")]
    late = int(np.argmax(down))
    cells = " ".join(f"{t}:{g:.0f}/{d:.0f}" for t, (g, d) in enumerate(zip(gate, down)))
    return (
        f"  {s.impl} T={s.tokens} per thread, gate/up done/down done: {cells}; last: "
        f"thread {late}, {down[late] - np.median(down):.1f} us past the median thread"
    )


def print_phases(shape: str, series: Sequence[Series]) -> None:
    """The phase split of each of our series (phase_cells), one table per (shape, format), then
    each series' per-thread line (thread_line)."""
    cells, lines = [], []
    for s in series:
        if s.kernel is None:
            continue
        try:
            row, per_thread = phase_cells(shape, s)
        except AttributeError:  # a baseline tree's kernel from before the marks
            print(f"{s.impl}: no phase marks in that build")
            continue
        cells.append(row)
        lines.append(thread_line(s, per_thread))
    if not cells:
        return
    print(f"Where a call goes, {shape}: us from its start, medians of {PHASE_CALLS} calls; "
          "spans: the first-last pool thread")  # fmt: skip
    print_table(PHASE_COLUMNS, cells, sep=" ")
    print("\n".join(lines))


def peer_series(
    peer: KtPeer,
    layers: list[KtLayer],
    fmt: str,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    shape: Shape,
) -> Series:
    T = x.shape[0]
    inputs = [peer.inputs(x, ids, w) for ids, w in routes]

    def call(i: int) -> None:
        peer.forward(layers[i % len(layers)], inputs[i % len(inputs)])

    impl = f"kt-kernel {fmt} x{len(layers)}L"
    H, I = shape.hidden_size, shape.intermediate_size  # noqa: E741
    nbytes = touched_experts(routes) * peer_expert_nbytes(fmt, H, I)
    return Series(impl, PEER_OURS[fmt], T, "bf16", True, nbytes, moe_flops(shape, T), call)


def load_peer(cfg: BenchConfig) -> KtPeer | None:
    if cfg.peer != "kt-kernel":
        return None
    kt, why = load_kt_kernel()
    if kt is None:
        print(f"peer kt-kernel: skipped: {why}")
        return None
    for pf in cfg.peer_formats:
        if kt.skip_line(pf):
            print(kt.skip_line(pf))
    try:
        peer = KtPeer(kt, cfg.threads)
    except Exception as e:
        print(f"peer kt-kernel: skipped: its thread pool failed: {type(e).__name__}: {e}")
        return None
    formats = [pf for f in cfg.formats for pf in peer_formats_for(cfg, peer, f)]
    print(
        f"peer kt-kernel: {kt.how}; one subpool of {cfg.threads} threads (kt-kernel pins them to "
        f"cores 0..{cfg.threads - 1}); formats {formats or 'none of those asked for'}"
    )
    return peer


def print_results(rows: list[Row], dram: float) -> None:
    with_peer = any(r.peer for r in rows)
    columns = [Column("shape", 14, "<"), Column("impl", 22, "<"), Column("T", 4),
               Column("us/layer", 10), Column("min-max us", 19), Column("GB/s", 7),
               Column("%DRAM", 6), Column("TFLOPS", 7), Column("vs torch", 8),
               *([Column("ours/them", 9)] if with_peer else [])]  # fmt: skip
    base_us = {r.shape: r.us for r in rows if r.fmt == "torch"}
    ours = {(r.shape, r.fmt, r.tokens, r.x_dtype): r.us for r in rows if not r.peer}
    cells = []
    for r in rows:
        speedup = base_us.get(r.shape, 0) / r.us if r.tokens == 1 and r.shape in base_us else 0
        mine = ours.get((r.shape, r.fmt, r.tokens, r.x_dtype)) if r.peer else None
        cells.append([r.shape, r.impl, str(r.tokens), f"{r.us:.1f}",
                      f"{r.us_min:.1f}-{r.us_max:.1f}", f"{r.gbs:.1f}",
                      f"{100 * r.gbs / dram:.0f}%", f"{r.tflops:.2f}",
                      f"{speedup:.2f}x" if speedup else "",
                      *([f"{mine / r.us:.2f}" if mine else ""] if with_peer else [])])  # fmt: skip
    print_table(columns, cells, sep=" ")
    if with_peer:
        print(
            "ours/them = our median time / the row's, same shape, T and activations: kt-kernel's "
            "(against our int8 for its int8, our int4 for its int4 and int4g32) or the baseline "
            "tree's (the same format) (< 1: ours faster); for 'huge pages' rows, ours on 4 KiB "
            "pages against ours on huge pages"
        )


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
    p.add_argument("--repeats", type=int, default=3, help="interleaved measurements per row")
    p.add_argument("--peer", choices=PEERS, default="none", help="kt-kernel: time it alongside")
    p.add_argument(
        "--peer-formats",
        default=",".join(PEER_FORMATS),
        help="the peer's formats: int8, int4 (per-row scales), int4g32 (per group of 32)",
    )
    p.add_argument(
        "--baseline-tree",
        default="",
        help="other source trees, comma-separated (extensions built in place there): their "
        "kernels timed beside ours",
    )
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="also time ours on a copy of the weights in transparent huge pages (2 MiB)",
    )
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
        repeats=a.repeats,
        peer=a.peer,
        peer_formats=tuple(f for f in a.peer_formats.split(",") if f),
        baseline_trees=tuple(t for t in a.baseline_tree.split(",") if t),
        huge_pages=a.huge_pages,
    )
    rng = torch.Generator().manual_seed(cfg.seed)
    print(
        f"seed={cfg.seed} threads={cfg.threads} isa={default_isa()} cpus={cpus} "
        f"LLC={cfg.llc_bytes / 2**20:.0f} MiB repeats={cfg.repeats}",
        flush=True,
    )
    dram = DramMeter(cfg.threads, cfg.dram_gb, cfg.pin)
    dram.sample("start")
    peer = load_peer(cfg)
    base_exts = baseline_exts(cfg.baseline_trees)
    for label, ext in base_exts:
        print(f"{label}: {ext.__file__}, timed in turn with ours", flush=True)
    rows: list[Row] = []
    for key in cfg.shapes:
        shape = SHAPES[key]
        if cfg.torch_baseline:
            rows.append(bench_torch_loop(cfg, shape, rng))
        for fmt in cfg.formats:
            rows.extend(bench_format(cfg, shape, fmt, rng, peer, base_exts))
        dram.sample(f"after {shape.name}")
    dram.sample("end")
    print(dram.summary())
    print_results(rows, dram.gbs)


if __name__ == "__main__":
    main()
