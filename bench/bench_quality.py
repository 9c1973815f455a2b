"""What expert quantization costs: held-out perplexity of a model served by ktserve with CPU
experts in bf16, int8 and int4, next to transformers' own perplexity on the same text, one run.

The path measured is the serving one: the GPU part (this process) + a `ktserve expert` worker
subprocess over ktshm, fp32 on the wire and in the GPU part, so the only difference between rows
is the experts' weight format. Perplexity as training/perplexity.py defines it (same windows).

    python bench/bench_quality.py [--model demo_model] [--text training/heldout_sample.txt]
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
from gpu_service.models import Batch, SeqInput
from gpu_service.service import build_gpu_service
from training.perplexity import tokenize_file, transformers_perplexity, window_nll, windows

TARGETS = {"bf16": 0.001, "int8": 0.005, "int4": 0.03}


def ktserve_perplexity(model: Path, ids: list[int], seq_len: int, fmt: str, threads: int,
                       device: str) -> float:  # fmt: skip
    with expert_worker(model, fmt, threads) as address:
        return served_perplexity(model, address, ids, seq_len, device)


def served_perplexity(model: Path, address: str, ids: list[int], seq_len: int, device: str,
                      deferred: int = 0) -> float:  # fmt: skip
    """Perplexity of the GPU service on the worker at `address`, `deferred` experts per token
    deferred (--max-deferred-experts-per-token)."""
    config = GPUServiceConfig(
        model_dir=str(model), device=device, dtype="float32", kv_cache_tokens=seq_len + 16,
        max_deferred_experts_per_token=deferred,
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
            total += window_nll(logits, window)  # [n, V]: the same definition as transformers'
            count += len(window) - 1
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
    args = parser.parse_args()
    model = Path(args.model)
    ids = tokenize_file(model, args.text, args.max_tokens)
    start = time.perf_counter()
    reference = transformers_perplexity(model, args.text, args.seq_len, args.max_tokens)
    rows = [("transformers fp32", reference, None, time.perf_counter() - start)]
    for fmt in ("bf16", "int8", "int4"):
        start = time.perf_counter()
        ppl = ktserve_perplexity(model, ids, args.seq_len, fmt, args.threads, args.device)
        rows.append((f"ktserve {fmt} experts", ppl, fmt, time.perf_counter() - start))

    print(f"held-out perplexity: {model.name}, {len(ids)} tokens of {Path(args.text).name}, "
          f"windows of {args.seq_len}, GPU part on {args.device}")  # fmt: skip
    columns = [Column("path", 22, "<"), Column("perplexity", 10), Column("vs transformers", 15),
               Column("target", 7), Column("s", 5), Column("", 6, "<")]  # fmt: skip
    cells = []
    for name, ppl, fmt, seconds in rows:
        delta = ppl / reference - 1
        verdict = "" if fmt is None else ("ok" if abs(delta) <= TARGETS[fmt] else "MISSED")
        cells.append([name, f"{ppl:.4f}", f"{delta:+.3%}", f"{TARGETS[fmt]:.1%}" if fmt else "",
                      f"{seconds:.1f}", verdict])  # fmt: skip
    print_table(columns, cells)


if __name__ == "__main__":
    main()
