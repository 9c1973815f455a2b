"""What expert quantization and an FP8 KV cache cost: held-out perplexity of a model served by
ktserve with CPU experts in bf16, int8 and int4 (and the KV cache in the model's dtype or FP8),
next to transformers' own perplexity on the same text, one run.

The path measured is the serving one: the GPU part (this process) + a `ktserve expert` worker
subprocess over ktshm, fp32 on the wire and in the GPU part, so the only differences between rows
are the experts' weight format and the KV cache's dtype. An FP8 row is also compared with the
same experts' row with the cache in the model's dtype. Perplexity as training/perplexity.py
defines it (same windows).

    python bench/bench_quality.py [--model demo_model] [--text training/heldout_sample.txt]
        [--formats bf16,int8,int4] [--kv-cache-dtypes auto,fp8]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import DEMO_MODEL, REPO, Column, default_device, print_table
from bench.worker_process import expert_worker
from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig
from gpu_service.models import Batch, SeqInput
from gpu_service.service import build_gpu_service
from training.perplexity import tokenize_file, transformers_perplexity, windows

TARGETS = {"bf16": 0.001, "int8": 0.005, "int4": 0.03}
FP8_KV_TARGET = 0.005  # vs the same experts with the cache in the model's dtype


def served_perplexity(model: Path, address: str, ids: list[int], seq_len: int, device: str,
                      deferred: int = 0, kv_cache_dtype: str = "auto") -> float:  # fmt: skip
    """Perplexity of the GPU service on the worker at `address`, `deferred` experts per token
    deferred (--max-deferred-experts-per-token), its KV cache in kv_cache_dtype."""
    config = GPUServiceConfig(
        model_dir=str(model), device=device, dtype="float32", kv_cache_tokens=seq_len + 16,
        max_deferred_experts_per_token=deferred, kv_cache_dtype=kv_cache_dtype,
        scheduler=SchedulerConfig(max_num_batched_tokens=seq_len, max_model_len=seq_len + 1),
        experts=ExpertClientConfig((address,), wire_dtype="float32"),
    )  # fmt: skip
    service = build_gpu_service(config)
    try:
        service.engine.stop()  # this benchmark drives the model directly, one window at a time
        net = service.engine.model
        total, count = 0.0, 0
        for window in windows(ids, seq_len):
            cache = net.kv_cache.allocate(len(window))
            try:
                logits = net.forward(Batch((SeqInput(window, cache, 0),)), all_positions=True)
            finally:
                net.kv_cache.free(cache)
            logp = torch.log_softmax(logits[:-1].float().cpu(), dim=-1)  # [n-1, V]
            target = torch.tensor(window[1:])
            total -= logp.gather(1, target[:, None]).sum().item()
            count += target.numel()
        return math.exp(total / count)
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--text", default=str(REPO / "training" / "heldout_sample.txt"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1, help="expert worker threads")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--formats", default="bf16,int8,int4", help="experts' weight formats")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="KV cache dtypes, per format: auto, fp8, auto,fp8")  # fmt: skip
    args = parser.parse_args()
    model = Path(args.model)
    kv_dtypes = args.kv_cache_dtypes.split(",")
    ids = tokenize_file(model, args.text, args.max_tokens)
    start = time.perf_counter()
    reference = transformers_perplexity(model, args.text, args.seq_len, args.max_tokens)
    rows = [("transformers fp32", reference, None, None, time.perf_counter() - start)]
    for fmt in args.formats.split(","):
        with expert_worker(model, fmt, args.threads) as address:
            auto = None
            for kv_dtype in kv_dtypes:
                start = time.perf_counter()
                ppl = served_perplexity(model, address, ids, args.seq_len, args.device,
                                        kv_cache_dtype=kv_dtype)  # fmt: skip
                auto = ppl if kv_dtype == "auto" else auto
                name = f"ktserve {fmt} experts" + ("" if kv_dtype == "auto" else f", {kv_dtype} KV")
                vs_auto = ppl / auto - 1 if kv_dtype != "auto" and auto is not None else None
                rows.append((name, ppl, fmt if kv_dtype == "auto" else None, vs_auto,
                             time.perf_counter() - start))  # fmt: skip

    print(f"held-out perplexity: {model.name}, {len(ids)} tokens of {Path(args.text).name}, "
          f"windows of {args.seq_len}, GPU part on {args.device}")  # fmt: skip
    columns = [Column("path", 30, "<"), Column("perplexity", 10), Column("vs transformers", 15),
               Column("vs auto KV", 10), Column("target", 7), Column("s", 5),
               Column("", 6, "<")]  # fmt: skip
    cells = []
    for name, ppl, fmt, vs_auto, seconds in rows:
        delta = ppl / reference - 1
        target, off = (TARGETS[fmt], delta) if fmt else (FP8_KV_TARGET, vs_auto)
        verdict = "" if off is None else ("ok" if abs(off) <= target else "MISSED")
        vs_auto_cell = "" if vs_auto is None else f"{vs_auto:+.3%}"
        target_cell = "" if off is None else f"{target:.1%}"
        cells.append([name, f"{ppl:.4f}", f"{delta:+.3%}", vs_auto_cell, target_cell,
                      f"{seconds:.1f}", verdict])  # fmt: skip
    print_table(columns, cells)


if __name__ == "__main__":
    main()
