"""What quantization costs: held-out perplexity of a model served by ktserve with CPU experts in
bf16, int8 and int4 (axis "experts", GPU part in the model dtype), with the GPU part's linear
layers in fp8, int8 and int4 (axis "gpu-weights", bf16 experts; --gpu-weight-format), and with
the KV cache in FP8 (axis "kv-cache", bf16 experts; --kv-cache-dtype fp8), next to transformers'
own perplexity on the same text, one run.

The path measured is the serving one: the GPU part (this process) + a `ktserve expert` worker
subprocess over ktshm, fp32 on the wire and the model dtype float32, so the only difference between
rows of an axis is one weight format. An experts row is compared with transformers; a GPU-weights
or FP8 KV row with the row whose GPU part is unquantized (same bf16 experts, cache in the model's
dtype). Perplexity as
training/perplexity.py defines it (same windows).

    python bench/bench_quality.py [--model demo_model] [--text training/heldout_sample.txt]
                                  [--axes experts,gpu-weights,kv-cache] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import DEMO_MODEL, REPO, Column, default_device, print_table
from bench.worker_process import expert_worker
from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig
from gpu_service.layers.linear import FP8Linear
from gpu_service.models import Batch, SeqInput
from gpu_service.service import build_gpu_service
from training.perplexity import tokenize_file, transformers_perplexity, window_nll, windows

TARGETS = {"bf16": 0.001, "fp8": 0.005, "int8": 0.005, "int4": 0.03}
AXES = ("experts", "gpu-weights", "kv-cache")


def ktserve_perplexity(model: Path, ids: list[int], seq_len: int, fmt: str, threads: int,
                       device: str) -> float:  # fmt: skip
    with expert_worker(model, fmt, threads) as address:
        return served_perplexity(model, address, ids, seq_len, device)


def served_perplexity(model: Path, address: str, ids: list[int], seq_len: int, device: str,
                      deferred: int = 0, gpu_weight_format: str = "bf16",
                      scaled_mm: bool = False, kv_cache_dtype: str = "auto") -> float:  # fmt: skip
    """Perplexity of the GPU service on the worker at `address`, `deferred` experts per token
    deferred (KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN), the GPU part's linears in gpu_weight_format;
    scaled_mm: fp8 runs torch._scaled_mm (the CUDA path's math: e4m3 activations, bf16 out)
    even on the CPU, where the server upcasts the weights instead."""
    config = GPUServiceConfig(
        model_dir=str(model), device=device, dtype="float32", kv_cache_tokens=seq_len + 16,
        max_deferred_experts_per_token=deferred, gpu_weight_format=gpu_weight_format,
        kv_cache_dtype=kv_cache_dtype,
        scheduler=SchedulerConfig(max_num_batched_tokens=seq_len, max_model_len=seq_len + 1),
        experts=ExpertClientConfig((address,), wire_dtype="float32"),
    )  # fmt: skip
    service = build_gpu_service(config)
    try:
        service.engine.stop()  # this benchmark drives the model directly, one window at a time
        net = service.engine.model
        for module in net.modules():
            if scaled_mm and isinstance(module, FP8Linear):
                module.scaled_mm = True
        kv = service.engine.scheduler.kv_manager
        total, count = 0.0, 0
        for window in windows(ids, seq_len):
            cache = kv.allocate(len(window))
            try:
                logits = net.forward(Batch((SeqInput(window, cache, 0),)), all_positions=True)
            finally:
                kv.free(cache)
            total += window_nll(logits, window)  # [n, V]: the same definition as transformers'
            count += len(window) - 1
        return math.exp(total / count)
    finally:
        service.close()


def add_perplexity_args(parser: argparse.ArgumentParser) -> None:
    """The served-perplexity measurement's flags (this benchmark's and tools/bench_deferral.py's):
    the model, the held-out text, its windows, the worker's threads and the GPU part's device."""
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--text", default=str(REPO / "training" / "heldout_sample.txt"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1, help="expert worker threads")
    parser.add_argument("--device", default=default_device())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_perplexity_args(parser)
    parser.add_argument("--axes", default=",".join(AXES),
                        help=f"comma-separated, of {', '.join(AXES)} (default: all)")  # fmt: skip
    parser.add_argument("--gpu-formats", default="fp8,int8,int4",
                        help="the gpu-weights axis' formats (default: all); on the CPU fp8 adds "
                        "a row with the CUDA path's _scaled_mm math")  # fmt: skip
    args = parser.parse_args()
    axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    if not axes or set(axes) - set(AXES):
        parser.error(f"--axes takes {', '.join(AXES)}, got {args.axes!r}")
    model = Path(args.model)
    ids = tokenize_file(model, args.text, args.max_tokens)
    start = time.perf_counter()
    reference = transformers_perplexity(model, args.text, args.seq_len, args.max_tokens)
    # (path, perplexity, format, baseline perplexity, seconds)
    rows = [("transformers fp32", reference, None, reference, time.perf_counter() - start)]
    if "experts" in axes:
        for fmt in ("bf16", "int8", "int4"):
            start = time.perf_counter()
            ppl = ktserve_perplexity(model, ids, args.seq_len, fmt, args.threads, args.device)
            rows.append((f"{fmt} experts", ppl, fmt, reference, time.perf_counter() - start))
    if "gpu-weights" in axes or "kv-cache" in axes:
        # (name, GPU weight format, _scaled_mm math, KV cache dtype)
        runs = [("GPU part fp32", "bf16", False, "auto")]
        if "gpu-weights" in axes:
            for fmt in [f.strip() for f in args.gpu_formats.split(",") if f.strip()]:
                runs.append((f"GPU part {fmt}", fmt, False, "auto"))
                if fmt == "fp8" and args.device == "cpu":
                    runs.append(("  (_scaled_mm math)", fmt, True, "auto"))
        if "kv-cache" in axes:
            runs.append(("KV cache fp8", "bf16", False, "fp8"))
        with expert_worker(model, "bf16", args.threads) as address:
            unquantized = None
            for name, fmt, scaled_mm, kv_dtype in runs:
                start = time.perf_counter()
                ppl = served_perplexity(model, address, ids, args.seq_len, args.device,
                                        gpu_weight_format=fmt, scaled_mm=scaled_mm,
                                        kv_cache_dtype=kv_dtype)  # fmt: skip
                unquantized = unquantized or ppl
                quantized = "fp8" if kv_dtype == "fp8" else (fmt if fmt != "bf16" else None)
                rows.append((name, ppl, quantized, unquantized if quantized else reference,
                             time.perf_counter() - start))  # fmt: skip

    print(f"held-out perplexity: {model.name}, {len(ids)} tokens of {Path(args.text).name}, "
          f"windows of {args.seq_len}, GPU part on {args.device}; experts rows and the GPU part "
          "fp32 row vs transformers, the other GPU part rows vs the GPU part fp32 row")  # fmt: skip
    columns = [Column("path", 20, "<"), Column("perplexity", 10), Column("change", 8),
               Column("target", 7), Column("s", 6), Column("", 6, "<")]  # fmt: skip
    cells = []
    for name, ppl, fmt, baseline, seconds in rows:
        delta = ppl / baseline - 1
        verdict = "" if fmt is None else ("ok" if abs(delta) <= TARGETS[fmt] else "MISSED")
        cells.append([name, f"{ppl:.4f}", f"{delta:+.3%}", f"{TARGETS[fmt]:.1%}" if fmt else "",
                      f"{seconds:.1f}", verdict])  # fmt: skip
    print_table(columns, cells)


if __name__ == "__main__":
    main()
