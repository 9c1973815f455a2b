"""Triton paged attention at real shapes on CUDA, next to the bound of reading the cache.

Shapes: DeepSeek-V3's MLA (128 query heads over one 576-wide latent kv head, the value its first
512 columns, absorbed) and Qwen3-30B-A3B's GQA (32 query heads, 4 kv heads of 128); batch 1 and
16; contexts 4k, 32k and 128k (a size that does not fit the GPU's free memory is skipped); a bf16
cache in blocks of --block-size tokens, handed out in shuffled order.

Per decode step (one query per sequence at the end of its context) and per 1k prefill tokens (a
1,024-token chunk at the end of each sequence's context; the step's time divided by the batch):
- triton: the median of CUDA-event timings, the L2 cache flushed before each call; a decode step
  captured in a CUDA graph and replayed, as a server runs it, and beside it (eager) called from
  Python, host launch overhead included;
- HBM bound: bytes of cache read (each sequence's keys and values once) / 4.8 TB/s, and / the
  device-to-device copy bandwidth measured in this run (bytes read + written / time);
- FLOP bound: the attention's matmul FLOPs / the bf16 matmul rate measured in this run (MLA at 128
  heads does ~240 FLOPs per cache byte: past the H200's ridge point, so compute bounds it first);
- torch: the plain torch reference (the cache gathered and padded, matmul, float32 softmax) where it
  fits in memory, and the largest absolute difference between the two outputs.

    python bench/bench_attention.py [--contexts 4096,32768,131072] [--batches 1,16] [--sweep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

import torch

from bench.common import Column, print_table

SPEC_HBM_BYTES_PER_S = 4.8e12
PREFILL_CHUNK = 1024


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_dim: int
    mla: bool  # v is a view of the first v_dim columns of the key cache

    @property
    def cache_bytes_per_token(self) -> int:  # bf16
        per_head = self.head_dim if self.mla else self.head_dim + self.v_dim
        return 2 * self.num_kv_heads * per_head

    def flops(self, num_queries: int, visible_keys: float) -> float:
        return 2.0 * self.num_heads * (self.head_dim + self.v_dim) * num_queries * visible_keys


SHAPES = (
    Shape("DeepSeek-V3 MLA", 128, 1, 576, 512, mla=True),
    Shape("Qwen3-30B-A3B GQA", 32, 4, 128, 128, mla=False),
)


@dataclass
class Case:
    """One batch of sequences, each `context` tokens long, over a freshly filled cache."""

    shape: Shape
    batch: int
    context: int
    block_size: int
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        s, dev = self.shape, self.device
        blocks = self.batch * -(-self.context // self.block_size)
        self.k_cache, self.v_cache = self.fresh_cache(blocks * self.block_size)
        order = torch.randperm(blocks, device=dev, dtype=torch.int64).to(torch.int32)
        self.block_table = order.view(self.batch, -1)
        self.kv_len = torch.full((self.batch,), self.context, dtype=torch.int32, device=dev)
        self.scale = (192 if s.mla else s.head_dim) ** -0.5

    def fresh_cache(self, slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random keys and values of `slots` rows (default: this case's); MLA's values are the
        keys' first v_dim columns."""
        s, dev = self.shape, self.device
        slots = self.k_cache.shape[0] if slots is None else slots
        k = torch.randn(slots, s.num_kv_heads, s.head_dim, device=dev).to(self.dtype)
        if s.mla:
            return k, k[..., : s.v_dim]
        return k, torch.randn(slots, s.num_kv_heads, s.v_dim, device=dev).to(self.dtype)

    def queries(self, per_seq: int) -> torch.Tensor:
        s = self.shape
        shape = (self.batch * per_seq, s.num_heads, s.head_dim)
        return torch.randn(shape, device=self.device).to(self.dtype)

    def cu_seqlens(self, per_seq: int) -> torch.Tensor:
        return torch.arange(self.batch + 1, dtype=torch.int32, device=self.device) * per_seq


def torch_attention(case: Case, q: torch.Tensor, per_seq: int) -> torch.Tensor:
    """The plain torch reference: each sequence's cache gathered (padded to the context), scores
    in q's dtype, the causal mask, softmax in float32, cast back, times v -> [T, Hq, Dv]."""
    s, b, n = case.shape, case.batch, case.context
    pos = torch.arange(n, device=case.device)
    block = case.block_table.long()[:, pos // case.block_size]  # [B, K]
    slots = block * case.block_size + pos % case.block_size
    keys = case.k_cache[slots].permute(0, 2, 3, 1)  # [B, Hkv, D, K]
    values = case.v_cache[slots].permute(0, 2, 1, 3)  # [B, Hkv, K, Dv]
    group = s.num_heads // s.num_kv_heads
    qg = q.view(b, per_seq, s.num_kv_heads, group, s.head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(b, s.num_kv_heads, group * per_seq, s.head_dim)  # [B, Hkv, G*Q, D]
    scores = torch.matmul(qg, keys) * case.scale  # [B, Hkv, G*Q, K]
    query_pos = (n - per_seq + torch.arange(per_seq, device=case.device)).repeat(group)
    scores.masked_fill_(pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values).view(b, s.num_kv_heads, group, per_seq, s.v_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(b * per_seq, s.num_heads, s.v_dim)


def torch_attention_bytes(case: Case, per_seq: int) -> int:
    """What torch_attention allocates at its peak, about: the gathered cache and the scores."""
    s = case.shape
    gathered = case.batch * case.context * case.shape.cache_bytes_per_token
    scores = case.batch * s.num_heads * per_seq * case.context * (4 + 4 + 2)
    return 2 * gathered + scores


class Timer:
    """Median CUDA-event time of a call, the L2 cache flushed before each one."""

    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")

    def median_s(self, fn: Callable[[], object], max_seconds: float = 2.0) -> float:
        fn()  # compiles
        torch.cuda.synchronize()
        first = self._timed(fn)
        reps = max(3, min(self.reps, int(max_seconds / max(first, 1e-6))))
        return statistics.median(self._timed_all(fn, reps))

    def median_graph_s(self, fn: Callable[[], object], max_seconds: float = 2.0) -> float:
        """median_s of fn captured in a CUDA graph (as a served decode step runs it): the GPU's
        time without the host's launch overhead."""
        fn()  # compiles
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # NOTE: torch's warm-up on a side stream before capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.median_s(graph.replay, max_seconds)

    def _timed(self, fn: Callable[[], object]) -> float:
        return self._timed_all(fn, 1)[0]

    def _timed_all(self, fn: Callable[[], object], reps: int) -> list[float]:
        events = []
        for _ in range(reps):
            self.flush.zero_()  # NOTE: also gives the CPU time to queue the call's kernels
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in events]


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = timer.median_s(lambda: dst.copy_(src))
    return 2 * src.numel() / seconds


def matmul_flops(timer: Timer) -> float:
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    return 2 * 8192**3 / timer.median_s(lambda: a @ b)


def fits(nbytes: int, share: float = 0.8) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < share * free


def us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.1f}"


def pct(bound: float, seconds: float) -> str:
    return f"{100 * bound / seconds:.0f}%"


PARTIAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def kernel_spec(spec: str) -> tuple[str, torch.dtype]:
    """'hopper+bf16' -> ("hopper", torch.bfloat16): the decode kernel (decoder's) and the dtype
    of its splits' partial outputs (default fp32; auto and flashmla keep theirs)."""
    name, _, partials = spec.partition("+")
    if partials and partials not in PARTIAL_DTYPES:
        raise SystemExit(f"{spec!r}: partials must be one of {sorted(PARTIAL_DTYPES)}")
    if partials and name in ("auto", "flashmla"):
        raise SystemExit(f"{spec!r}: {name} chooses its own partial outputs")
    return name, PARTIAL_DTYPES[partials or "fp32"]


def decoder(case: Case, kernel: str) -> Callable:
    """decode(q, k_cache, v_cache, plans=None) over the case's block table through one kernel
    (--mla-kernels' names): auto = the AttentionBackend a model of these shapes gets
    (gpu_service/attention/backend.py), triton / hopper = attention_triton's split kernels,
    flashmla = FlashMLA's (a ValueError where it does not serve)."""
    from gpu_service.attention import attention_triton as at
    from gpu_service.attention import mla_decode_flashmla
    from gpu_service.attention.backend import AttentionBackend

    name, partials = kernel_spec(kernel)
    rest = (case.block_table, case.kv_len, case.block_size, case.scale)
    if name == "auto":
        latent = case.shape.head_dim if case.shape.mla else 0
        backend = AttentionBackend.choose(case.k_cache.device, case.k_cache.dtype,
                                          case.k_cache.dtype, latent)  # fmt: skip
        return lambda q, k, v, plans=None: backend.gpu_decode(q, k, v, *rest, plans=plans)
    if name == "flashmla":
        return lambda q, k, v, plans=None: mla_decode_flashmla.decode_checked(
            q, k, v, *rest, plans=plans
        )
    if name not in ("triton", "hopper"):
        raise SystemExit(f"{kernel!r}: the kernels are auto, triton, hopper and flashmla")
    return lambda q, k, v, plans=None: at.decode_with(
        q, k, v, *rest, hopper=name == "hopper", partial_dtype=partials
    )


def layered_decode_s(case: Case, q: torch.Tensor, timer: Timer, layers: int,
                     kernel: str = "auto", shared_plans: bool = True) -> float | None:  # fmt: skip
    """Seconds a decode call takes inside one CUDA graph of `layers` calls, each over a cache of
    its own (as a served step runs a model's layers): the graph's start is paid once, not per
    call. shared_plans: the calls share one plans dict, as a step's layers share their group's
    (FlashMLA's split schedule made once); else each call plans alone. None where the caches do
    not fit."""
    decode = decoder(case, kernel)
    if layers < 2 or not fits(
        (layers - 1) * case.batch * case.context * case.shape.cache_bytes_per_token, 0.5
    ):
        return None
    caches = [(case.k_cache, case.v_cache)] + [case.fresh_cache() for _ in range(layers - 1)]

    def run_all():
        plans = {}  # NOTE: made per run, as a step's metadata is (so the capture plans inside)
        for k, v in caches:
            decode(q, k, v, plans=plans if shared_plans else None)

    try:
        return timer.median_graph_s(run_all) / layers
    finally:
        caches.clear()
        torch.cuda.empty_cache()


def measure(case: Case, step: str, timer: Timer, copy_bw: float, flops_rate: float, reference,
            layers: int = 0, kernel: str = "auto", shared_plans: bool = True):  # fmt: skip
    """One table row: times and bounds per decode step or per 1k prefill tokens; with layers, a
    decode call's time inside a graph of that many calls too. kernel: decoder's."""
    from gpu_service.attention import attention_triton as at

    s, b, n = case.shape, case.batch, case.context
    per_seq = 1 if step == "decode" else PREFILL_CHUNK
    q = case.queries(per_seq)
    args = (case.k_cache, case.v_cache, case.block_table)
    if step == "decode":
        decode = decoder(case, kernel)

        def run():
            return decode(q, case.k_cache, case.v_cache)

        visible = float(n)
    else:
        cu = case.cu_seqlens(per_seq)

        def run():
            return at.paged_prefill(q, *args, cu, case.kv_len, case.block_size, case.scale)

        visible = (n - per_seq) + (per_seq + 1) / 2
    layered_s = None
    if step == "decode":
        seconds, eager_s = timer.median_graph_s(run), timer.median_s(run)
        layered_s = layered_decode_s(case, q, timer, layers, kernel, shared_plans)
    else:
        seconds, eager_s = timer.median_s(run) / b, None
    per = 1 if step == "decode" else b  # prefill: per sequence's 1k-token chunk
    cache_bytes = b * n * s.cache_bytes_per_token / per
    hbm_spec, hbm_copy = cache_bytes / SPEC_HBM_BYTES_PER_S, cache_bytes / copy_bw
    flop_bound = s.flops(b * per_seq, visible) / per / flops_rate
    ref_s, diff = None, "-"
    if fits(torch_attention_bytes(case, per_seq)):
        try:
            want = reference(case, q, per_seq)
            diff = f"{(run().float() - want.float()).abs().max().item():.1e}"
            del want
            ref_s = timer.median_s(lambda: reference(case, q, per_seq)) / per
        except torch.OutOfMemoryError:
            diff = "oom"
        torch.cuda.empty_cache()
    bound = max(hbm_spec, flop_bound)
    label = step if kernel == "auto" else f"{step}:{kernel}"
    return (
        s.name, str(b), f"{n // 1024}k", label, us(seconds), us(eager_s),
        us(hbm_spec), pct(hbm_spec, seconds), us(hbm_copy), pct(hbm_copy, seconds),
        us(flop_bound), pct(flop_bound, seconds), pct(bound, seconds), us(layered_s),
        pct(hbm_spec, layered_s) if layered_s else "-", us(ref_s), diff,
    )  # fmt: skip


def parse_tiles(text: str) -> list[tuple[int, ...]]:
    """'h,n,w,s[,dv];...' -> [(heads, keys, warps, stages, value columns)] (--tiles)."""
    shapes = []
    for item in filter(None, text.split(";")):
        values = [int(v) for v in item.split(",")]
        if len(values) not in (4, 5):
            raise SystemExit(f"--tiles: {item!r} is not h,n,w,s[,dv]")
        shapes.append((*values, 0)[:5])
    return shapes


def sweep(case: Case, timer: Timer, copy_bw: float, only: list[tuple[int, ...]] | None) -> None:
    """Decode at a few launch shapes (or `only` those), to pick decode_tiles' defaults on this
    GPU."""
    from gpu_service.attention import attention_triton as at

    q = case.queries(1)
    args = (q, case.k_cache, case.v_cache, case.block_table, case.kv_len, case.block_size)
    # (heads, keys, warps, stages, value columns per program: 0 all)
    mla_shapes = [(64, 16, 8, 2, 0), (64, 16, 8, 3, 0), (64, 16, 8, 4, 0), (64, 32, 8, 2, 0),
                  (64, 32, 8, 1, 0), (64, 32, 8, 3, 0), (64, 32, 8, 4, 0), (64, 64, 8, 1, 0),
                  (32, 32, 8, 2, 0), (16, 32, 4, 2, 0), (64, 32, 16, 2, 0), (64, 64, 16, 2, 0),
                  (64, 32, 8, 3, 256), (64, 64, 8, 2, 256), (64, 64, 8, 3, 128),
                  (64, 64, 4, 3, 128)]  # fmt: skip
    gqa_shapes = [(16, 64, 4, 2, 0), (16, 64, 4, 3, 0), (16, 64, 4, 4, 0), (16, 32, 4, 3, 0),
                  (16, 32, 4, 4, 0), (16, 128, 4, 2, 0), (16, 64, 8, 2, 0)]  # fmt: skip
    # the Hopper MLA kernel (mla_decode_hopper): 64 heads on 8 warps, keys a step and stages
    hopper_shapes = [(64, 64, 8, 2, 0), (64, 32, 8, 3, 0), (64, 32, 8, 4, 0), (64, 32, 8, 2, 0)]
    mla = case.shape.head_dim > 256
    shapes = [("triton", *t) for t in only or (mla_shapes if mla else gqa_shapes)]
    if mla and at.mla_decode_hopper is not None and at.mla_decode_hopper.supported_device(q.device):
        shapes += [(k, *t) for k in ("hopper", "hopper+bf16") for t in only or hopper_shapes]
    hbm = case.batch * case.context * case.shape.cache_bytes_per_token / copy_bw
    rows = []
    for kernel, block_h, block_n, warps, stages, block_dv in shapes:
        tiles = at.Tiles(block_h, block_n, warps, stages, block_dv=block_dv)
        name = f"{kernel} h{block_h} n{block_n} w{warps} s{stages}" + (
            f" v{block_dv}" if block_dv else ""
        )
        kernel_name, partials = kernel_spec(kernel)
        for splits in (None, 16, 32, 64, 128, 256):
            try:  # NOTE: a shape compiles at its first call, before the capture
                seconds = timer.median_graph_s(
                    lambda t=tiles, n=splits, k=kernel_name, p=partials: at.decode_with(
                        *args,
                        case.scale,
                        tiles=t,
                        num_splits=n,
                        hopper=k == "hopper",
                        partial_dtype=p,
                    )
                )
            except Exception as exc:  # a launch shape this GPU cannot run: say so, go on
                rows.append((name, str(splits or "auto"), type(exc).__name__, "-"))
                continue
            rows.append((name, str(splits or "auto"), us(seconds), pct(hbm, seconds)))
    print(f"\nsweep: {case.shape.name} decode, batch {case.batch}, context {case.context}")
    cols = [Column("tiles", 29, "<"), Column("splits", 6), Column("us", 9), Column("%copy", 6)]
    print_table(cols, rows)


def paged_reference():
    """The torch paged attention of gpu_service.attention.paged_attention where this tree has it
    (same signatures), else the gathering reference above."""
    try:
        from gpu_service.attention import paged_attention as pa
    except ImportError:
        return torch_attention, "torch gather+matmul (bench)"

    def reference(case: Case, q: torch.Tensor, per_seq: int) -> torch.Tensor:
        args = (q, case.k_cache, case.v_cache, case.block_table)
        if per_seq == 1:
            return pa.paged_decode(*args, case.kv_len, case.block_size, case.scale)
        cu = case.cu_seqlens(per_seq)
        return pa.paged_prefill(*args, cu, case.kv_len, case.block_size, case.scale)

    return reference, "gpu_service.attention.paged_attention"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768,131072", help="tokens per sequence")
    parser.add_argument("--batches", default="1,16", help="sequences per step")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per cell (at most)")
    parser.add_argument("--no-prefill", action="store_true", help="time decode steps only")
    parser.add_argument("--sweep", action="store_true", help="also decode launch shapes at 32k")
    parser.add_argument(
        "--tiles",
        default="",
        help="the sweep's launch shapes instead of its "
        "own: 'heads,keys,warps,stages[,value columns];...'",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="also time a decode call inside one CUDA graph of this many calls, each over a "
        "cache of its own, as a served step runs a model's layers (0: off)",
    )
    parser.add_argument(
        "--own-plans",
        action="store_true",
        help="with --layers: each call plans its own splits (FlashMLA's schedule) instead of "
        "the layers sharing one, as a served step's do",
    )
    parser.add_argument(
        "--mla-kernels",
        default="auto",
        help="MLA decode's kernels to time, a row each (comma-separated: auto = what a "
        "model's AttentionBackend runs, triton = attention_triton's, hopper = mla_decode_hopper's, "
        "flashmla = FlashMLA's where sgl-flash-mla is installed (64-token blocks); "
        "+bf16 or +fp16 after one: its splits' partial outputs in that dtype, not fp32)",
    )
    parser.add_argument(
        "--shapes",
        default="",
        help="model shapes to time, by name prefix (comma-separated; default all)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU (the kernels are Triton's CUDA kernels)")
    timer = Timer(args.reps)
    copy_bw, flops_rate = copy_bandwidth(timer), matmul_flops(timer)
    reference, ref_name = paged_reference()
    print(
        f"{torch.cuda.get_device_name()}: device copy {copy_bw / 1e12:.2f} TB/s (read + written),"
        f" bf16 matmul 8192^3 {flops_rate / 1e12:.0f} TFLOP/s; HBM bound also at "
        f"{SPEC_HBM_BYTES_PER_S / 1e12:.1f} TB/s; torch reference: {ref_name}",
        flush=True,
    )
    steps = ["decode"] + ([] if args.no_prefill else ["prefill"])
    rows = []
    wanted = [w for w in args.shapes.split(",") if w]
    for shape in SHAPES:
        if wanted and not any(shape.name.startswith(w) for w in wanted):
            continue
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                cache_bytes = batch * context * shape.cache_bytes_per_token
                if not fits(cache_bytes, 0.5):
                    skipped = (shape.name, str(batch), f"{context // 1024}k", "no room")
                    rows.append((*skipped, *["-"] * 13))
                    continue
                case = Case(shape, batch, context, args.block_size)
                for step in steps:
                    kernels = ["auto"]
                    if step == "decode" and shape.mla:
                        kernels = [k for k in args.mla_kernels.split(",") if k]
                    for kernel in kernels:
                        try:
                            rows.append(measure(case, step, timer, copy_bw, flops_rate,
                                                reference, args.layers, kernel,
                                                not args.own_plans))  # fmt: skip
                        except Exception as exc:  # a kernel this GPU cannot run: say so, go on
                            failed = (shape.name, str(batch), f"{context // 1024}k",
                                      f"{step}:{kernel}", type(exc).__name__)  # fmt: skip
                            rows.append((*failed, *["-"] * 12))
                            print(f"{failed}: {exc}", file=sys.stderr, flush=True)
                            continue
                        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
                if args.sweep and context == 32768:
                    sweep(case, timer, copy_bw, parse_tiles(args.tiles) or None)
                del case
                torch.cuda.empty_cache()
    print("\ntimes in us: per decode step (triton: CUDA-graph replay; eager: launched from "
          "Python), or per sequence's 1k-token prefill chunk; % = bound / triton's time; "
          "roofline = the larger bound; layered: a decode call inside one graph of --layers "
          "calls over caches of their own, and its % of the HBM bound at 4.8 TB/s")  # fmt: skip
    cols = [
        Column("shape", 17, "<"), Column("B", 2), Column("ctx", 4), Column("step", 14, "<"),
        Column("triton", 10), Column("eager", 10), Column("HBM 4.8T", 9), Column("%", 4),
        Column("HBM copy", 9), Column("%", 4), Column("FLOP bnd", 9), Column("%", 4),
        Column("%roof", 5), Column("layered", 9), Column("%", 4), Column("torch", 11),
        Column("max|diff|", 9),
    ]  # fmt: skip
    print_table(cols, rows)


if __name__ == "__main__":
    main()
