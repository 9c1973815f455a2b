"""End-to-end generation speed through the serving path, with the per-step time breakdown.

The GPU service (this process; KV cache sized by the service itself) + `ktserve expert` workers
(subprocesses) on a checkpoint (the demo model by default): N concurrent greedy requests of M new
tokens each. Prints one table per batch size: tokens/s, mean step time, and how a step splits
into GPU compute, transfers to and from the expert channels, and waiting for the CPU experts.

    python bench/bench_decode.py [--model demo_model] [--batch 1,8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker_process import start_worker  # noqa: E402

from gpu_service.engine import SamplingParams  # noqa: E402
from gpu_service.service import GPUServiceConfig, build_gpu_service  # noqa: E402


def histogram_sum(metric, **labels) -> tuple[float, float]:
    """(sum, count) of a prometheus Histogram child."""
    child = metric.labels(**labels) if labels else metric
    samples = {s.name: s.value for m in child.collect() for s in m.samples}
    name = next(n for n in samples if n.endswith("_sum"))
    return samples[name], samples[name.replace("_sum", "_count")]


def run_batch(service, batch: int, tokens: int) -> dict[str, float]:
    metrics = service.metrics
    phases = ("gpu", "transfer", "expert_wait")
    before = {p: histogram_sum(metrics.step_seconds, phase=p) for p in phases}
    done = threading.Semaphore(0)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(batch):
        prompt = [(7 * i + j) % 200 + 3 for j in range(16)]
        service.engine.add_request(
            prompt, params, lambda e: done.release() if e.finish_reason is not None else None
        )
    for _ in range(batch):
        done.acquire(timeout=600)
    seconds = time.perf_counter() - start
    after = {p: histogram_sum(metrics.step_seconds, phase=p) for p in before}
    steps = after["gpu"][1] - before["gpu"][1]
    split = {p: (after[p][0] - before[p][0]) / steps * 1e3 for p in before}
    return {"tok/s": batch * tokens / seconds, "steps": steps, **split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "demo_model"))
    parser.add_argument("--format", default="int8")
    parser.add_argument("--threads", type=int, default=1, help="expert worker threads")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    proc, address = start_worker(Path(args.model), args.format, args.threads)
    service = None
    try:
        service = build_gpu_service(GPUServiceConfig(
            model_dir=args.model, workers=(address,), device=args.device, dtype=args.dtype,
            wire_dtype=args.dtype))  # fmt: skip
        cache = service.engine.model.kv_cache.config
        run_batch(service, 1, 8)  # warm-up
        rows = [(b, run_batch(service, b, args.tokens)) for b in map(int, args.batch.split(","))]
    finally:
        if service is not None:
            service.close()
        proc.terminate()
        proc.wait(30)
    print(f"generation through ktserve: {Path(args.model).name}, GPU part {args.dtype} on "
          f"{args.device}, 1 expert worker ({args.format}, {args.threads} threads), "
          f"{args.tokens} new tokens per request, KV cache {cache.num_slots} tokens (sized by "
          f"the service)")  # fmt: skip
    print(f"{'batch':>5} | {'tok/s':>8} | {'steps':>5} | {'ms/step':>8} | {'gpu ms':>7} | "
          f"{'transfer ms':>11} | {'expert wait ms':>14}")  # fmt: skip
    for batch, r in rows:
        total = r["gpu"] + r["transfer"] + r["expert_wait"]
        print(f"{batch:>5} | {r['tok/s']:>8.1f} | {int(r['steps']):>5} | {total:>8.2f} | "
              f"{r['gpu']:>7.2f} | {r['transfer']:>11.2f} | {r['expert_wait']:>14.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
