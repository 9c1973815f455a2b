"""Does DeepSeek-V3's GPU part, quantized, fit a 24 GB card with a 32k-token context? (GPU host)

Builds the real shapes (61 layers, hidden 7168, 128 heads, MLA q_lora 1536 / kv_lora 512 / rope 64 /
nope 128 / v 128, 3 dense layers of 18432, a 2048-wide shared expert per MoE layer, vocab 129280)
with every layer's GPU part present, from random weights generated on the GPU and quantized there
as they are made (writing a checkpoint of ~17B parameters first would only test the disk). The
routed experts are never on the GPU: a reduced set (--cpu-experts per layer, shared by all MoE
layers) computes on the CPU in this process, each token's routed ids taken modulo that set.
The process is capped at --cap-gib with torch.cuda.set_per_process_memory_fraction before
anything is allocated; then the memory plan (gpu_service/memory_plan.py) is made with a KV cache
of --context tokens, the cache is built, and the last prefill chunk of a --context-token prompt
(--chunk tokens attending to all of it) and one decode step at its end run. Prints the weights
by kind, the plan, and each phase's peak against the cap; exit status 1 when something did not
fit (CUDA out of memory).

    python tools/gpu_memory_fit.py [--format fp8|int4] [--cap-gib 24] [--context 32768]
                                   [--chunk 32] [--quantize-lm-head] [--weights-only]

--weights-only builds the model on torch's meta device (no memory, no GPU needed) and prints
the weights' bytes by kind and the KV cache's, nothing measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import Column, print_table  # noqa: E402
from bench.real_checkpoint import SHAPES, config_json  # noqa: E402
from gpu_service.experts.routed import ReadyExperts  # noqa: E402
from gpu_service.kvcache.manager import KVCacheManager  # noqa: E402
from gpu_service.layers.sharding import SINGLE, Shard  # noqa: E402
from gpu_service.layers.weight_formats import LinearQuantConfig  # noqa: E402
from gpu_service.memory_plan import GIB, cuda_plan  # noqa: E402
from gpu_service.models import (  # noqa: E402
    Batch,
    KVCacheTensors,
    SeqInput,
    deepseek,  # noqa: E402
)
from gpu_service.models.registry import choose_attention  # noqa: E402
from ktserve.checkpoint import HFConfig, ModelSpec  # noqa: E402

NORM_SUFFIXES = ("layernorm.weight", "norm.weight")


class RandomWeights:
    """A WeightLoader of random tensors made on the device (std 0.02; norms 1, biases 0)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, quant: LinearQuantConfig,
                 seed: int) -> None:  # fmt: skip
        self.device, self.dtype, self.linear_quant = device, dtype, quant
        self.fp8_block = (128, 128)
        self.tp = SINGLE  # one GPU: every layer whole
        self.gen = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)

    def has(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
            shard: Shard | None = None):  # fmt: skip
        if shard is not None:
            raise ValueError(f"{name}: RandomWeights makes whole tensors, not shards")
        dtype = dtype or self.dtype
        if name.endswith(NORM_SUFFIXES):
            return torch.ones(shape, dtype=dtype, device=self.device)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, dtype=dtype, device=self.device)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        return out if self.gen is None else out.normal_(0.0, 0.02, generator=self.gen)


class ReducedCPUExperts:
    """`num` routed experts on the CPU (bf16, computed in float32), shared by every MoE layer;
    expert e of any layer is expert e % num here."""

    def __init__(self, num: int, hidden: int, inter: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num = num
        self.gate_up = (torch.randn(num, 2 * inter, hidden, generator=gen) * 0.02).bfloat16()
        self.down = (torch.randn(num, hidden, inter, generator=gen) * 0.02).bfloat16()

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        xf, ids, weights = x.float().cpu(), ids.cpu() % self.num, weights.float().cpu()
        out = torch.zeros_like(xf)  # [T, H]
        for e in range(self.num):
            token, slot = torch.where(ids == e)
            if token.numel():
                gate, up = (xf[token] @ self.gate_up[e].float().T).chunk(2, dim=-1)
                y = (F.silu(gate) * up) @ self.down[e].float().T  # [n, H]
                out.index_add_(0, token, y * weights[token, slot, None])
        return ReadyExperts(out.to(x.device, x.dtype))


def weights_by_kind(model: torch.nn.Module) -> dict[str, int]:
    kinds: dict[str, int] = defaultdict(int)
    for name, buf in model.named_buffers():
        if name == "embed":
            kind = "embedding (bf16)"
        elif name.startswith("lm_head"):
            kind = "lm_head"
        elif name.endswith(("w_uk", "w_uv")):
            kind = "MLA kv_b (bf16)"
        elif "norm" in name or ".router." in name:
            kind = "norms, routers"
        else:
            kind = "linears (the format)"
        kinds[kind] += buf.nbytes
    return dict(kinds)


def weights_only(fmt: str, context: int, quantize_lm_head: bool) -> None:
    shape = SHAPES["deepseek"]
    hf = HFConfig(config_json(shape, shape.full_layers, shape.dense_layers, fp8=True), "V3 shapes")
    spec = ModelSpec.from_hf(hf)
    loader = RandomWeights(torch.device("meta"), torch.bfloat16,
                           LinearQuantConfig(fmt, quantize_lm_head), 0)  # fmt: skip
    attention = choose_attention(hf, loader.device, torch.bfloat16, torch.bfloat16)
    model = deepseek.build(hf, spec, loader, ReducedCPUExperts(1, 8, 8, 0), 16, 16, attention)
    kinds = weights_by_kind(model)
    kv = model.kv_cache.config.bytes_per_token(torch.bfloat16) * context
    print(f"DeepSeek-V3 shapes, linears in {fmt}{' (lm_head too)' if quantize_lm_head else ''}: "
          "bytes of the GPU part (meta device: counted, not allocated)")  # fmt: skip
    rows = [[k, f"{v / GIB:.3f}"] for k, v in sorted(kinds.items())]
    rows += [["all weights", f"{sum(kinds.values()) / GIB:.3f}"],
             [f"KV cache, {context} tokens", f"{kv / GIB:.3f}"],
             ["weights + KV cache", f"{(sum(kinds.values()) + kv) / GIB:.3f}"]]  # fmt: skip
    print_table([Column("part", 24, "<"), Column("GiB", 7)], rows)


def phase(name: str, fn, device: torch.device, rows: list, cap: int) -> bool:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize(device)
        ok = True
    except torch.OutOfMemoryError as exc:
        print(f"{name}: CUDA out of memory: {str(exc).splitlines()[0]}")
        ok = False
    peak = torch.cuda.max_memory_allocated(device)
    seconds = time.perf_counter() - start
    rows.append([name, f"{peak / GIB:.2f}", f"{cap / GIB:.2f}", f"{seconds:.2f}",
                 "fits" if ok else "OUT OF MEMORY"])  # fmt: skip
    return ok


def run(fmt: str, cap_gib: float, context: int, chunk: int, quantize_lm_head: bool,
        cpu_experts: int, seed: int) -> bool:  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device())  # the cap needs an index
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(cap_gib * GIB)
    torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), device)
    shape = SHAPES["deepseek"]
    hf = HFConfig(config_json(shape, shape.full_layers, shape.dense_layers, fp8=True), "V3 shapes")
    spec = ModelSpec.from_hf(hf)
    quant = LinearQuantConfig(fmt, quantize_lm_head)
    loader = RandomWeights(device, torch.bfloat16, quant, seed)
    experts = ReducedCPUExperts(cpu_experts, shape.hidden, shape.moe_inter, seed)
    rows: list = []
    holder: dict = {}

    def build() -> None:
        attention = choose_attention(hf, device, torch.bfloat16, torch.bfloat16)
        holder["model"] = deepseek.build(hf, spec, loader, experts, 16, 16, attention).eval()

    if not phase("build the GPU part", build, device, rows, cap):
        print_table(COLUMNS, rows)
        return False
    model = holder["model"]
    print(f"GPU part of DeepSeek-V3 shapes, linears in {fmt}"
          f"{' (lm_head too)' if quantize_lm_head else ''}, on {torch.cuda.get_device_name()}, "
          f"capped at {cap_gib} GiB of {total / GIB:.1f}")  # fmt: skip
    print_table(
        [Column("weights", 22, "<"), Column("GiB", 7)],
        [[k, f"{v / GIB:.3f}"] for k, v in sorted(weights_by_kind(model).items())],
    )
    plan = cuda_plan(model, torch.bfloat16, min(cap / total, 1.0), chunk, 1, kv_tokens=context)
    print(plan.table())
    cache_config = replace(model.kv_cache.config, max_num_tokens=context)
    ok = phase("KV cache",
               lambda: holder.update(kv=KVCacheTensors(cache_config, torch.bfloat16, device)),
               device, rows, cap)  # fmt: skip
    if ok:
        model.kv_cache = holder["kv"]
        seq = KVCacheManager(cache_config).allocate(context)
        seq.num_tokens = context - 1 - chunk  # the prompt's earlier chunks (random K/V stand in)
        vocab = shape.vocab
        prompt = [(i * 7919) % vocab for i in range(chunk)]

        def prefill() -> None:
            model.forward(Batch((SeqInput(prompt, seq, context - 1 - chunk),)))

        def decode() -> None:
            model.forward(Batch((SeqInput([1], seq, context - 1),)))

        ok = phase(f"prefill chunk of {chunk} at {context}", prefill, device, rows, cap)
        ok = phase(f"decode step at {context}", decode, device, rows, cap) and ok
    print_table(COLUMNS, rows)
    print("fits" if ok else "DOES NOT FIT")
    return ok


COLUMNS = [Column("phase", 30, "<"), Column("peak GiB", 8), Column("cap GiB", 7), Column("s", 6),
           Column("", 13, "<")]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="fp8", choices=("fp8", "int8", "int4", "bf16"))
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=32,
                        help="prefill chunk tokens (today's padded attention makes a [128, "
                        "chunk, context] scores tensor)")  # fmt: skip
    parser.add_argument("--quantize-lm-head", action="store_true")
    parser.add_argument("--cpu-experts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights-only", action="store_true")
    args = parser.parse_args()
    if args.weights_only:
        weights_only(args.format, args.context, args.quantize_lm_head)
        return
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (run it on the GPU host)")
    print(f"seed {args.seed}")
    ok = run(args.format, args.cap_gib, args.context, args.chunk, args.quantize_lm_head,
             args.cpu_experts, args.seed)  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
