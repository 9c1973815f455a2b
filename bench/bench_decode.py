"""End-to-end generation speed through the serving path, with the per-step time breakdown.

The GPU service (this process; KV cache sized by the service itself) + `ktserve expert` workers
(subprocesses) on a checkpoint (the demo model by default): N concurrent greedy requests of M new
tokens each. Prints one table per batch size: tokens/s, mean step time, and how a step splits
into GPU compute, transfers to and from the expert channels, and waiting for the CPU experts.
On CUDA it runs every batch size with the decode step's CUDA graphs on and off, in the same run
(one service after the other, the same worker), and prints the speed-up.

    python bench/bench_decode.py [--model demo_model] [--batch 1,8] [--tokens 128] [--graphs on,off]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import DEMO_MODEL, Column, default_device, print_table
from bench.worker_process import expert_worker
from gpu_service.config import ExpertClientConfig, GPUServiceConfig
from gpu_service.engine import SamplingParams
from gpu_service.service import build_gpu_service


def histogram_sum(metric, **labels) -> tuple[float, float]:
    """(sum, count) of a prometheus Histogram child."""
    child = metric.labels(**labels) if labels else metric
    samples = {s.name: s.value for m in child.collect() for s in m.samples}
    name = next(n for n in samples if n.endswith("_sum"))
    return samples[name], samples[name.replace("_sum", "_count")]


def run_batch(service, batch: int, tokens: int, after_prefill=None) -> dict[str, float]:
    """`batch` greedy requests of 16-token prompts, `tokens` new tokens each. Decode is timed
    from the moment every request has its first token (the prefill's) to the last one's end:
    tok/s = batch * (tokens - 1) / that time, the step split per decode step alike (a 16-token
    prefill reads many more experts a layer than a decode step: docs/decode-graphs.md).
    after_prefill: called then, in this thread (a caller's snapshot of its own counters)."""
    if tokens < 2:
        raise ValueError("decode needs at least 2 tokens a request (the first is the prefill's)")
    metrics = service.metrics
    phases = ("gpu", "transfer", "expert_wait")
    first, done = threading.Semaphore(0), threading.Semaphore(0)
    first_at: list[float] = []

    def watch():
        seen = False

        def on_event(event) -> None:
            nonlocal seen
            if event.tokens and not seen:
                seen = True
                first_at.append(time.perf_counter())
                first.release()
            if event.finish_reason is not None:
                done.release()

        return on_event

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 200 + 3 for j in range(16)]
        service.engine.add_request(prompt, params, watch())
    for waited in range(batch):
        if not first.acquire(timeout=600):
            raise SystemExit(f"decode batch {batch}: {waited} first tokens in 600 s")
    before = {p: histogram_sum(metrics.step_seconds, phase=p) for p in phases}
    if after_prefill is not None:
        after_prefill()
    for finished in range(batch):
        if not done.acquire(timeout=600):
            raise SystemExit(f"decode batch {batch}: {finished} requests finished in 600 s")
    seconds = time.perf_counter() - max(first_at)
    after = {p: histogram_sum(metrics.step_seconds, phase=p) for p in before}
    steps = after["gpu"][1] - before["gpu"][1]
    split = {p: (after[p][0] - before[p][0]) / max(steps, 1) * 1e3 for p in before}
    return {"tok/s": batch * (tokens - 1) / seconds, "steps": steps, **split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--format", default="int8")
    parser.add_argument("--threads", type=int, default=1, help="expert worker threads")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--graphs", default="on,off", help="CUDA graphs settings to compare")
    parser.add_argument("--spin-us", default="",
                        help="worker spin settings to compare (channel thread and kernel pool), "
                        "e.g. 200,2000 (default: the worker's)")  # fmt: skip
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    on_cuda = args.device.startswith("cuda")
    modes = [m == "on" for m in args.graphs.split(",")] if on_cuda else [False]
    spins = [float(v) for v in args.spin_us.split(",")] if args.spin_us else [None]
    rows = []
    for spin in spins:
        with expert_worker(args.model, args.format, args.threads, spin) as address:
            for graphs in modes:
                service = build_gpu_service(GPUServiceConfig(
                    model_dir=args.model, device=args.device, dtype=args.dtype,
                    cuda_graphs=graphs, cuda_graph_max_batch=max(batches),
                    experts=ExpertClientConfig((address,), wire_dtype=args.dtype)))  # fmt: skip
                try:
                    cache = service.engine.model.kv_cache.config
                    run_batch(service, 1, 8)  # warm-up
                    for b in batches:
                        run_batch(service, b, 8)  # captures this batch size's graphs
                        rows.append((spin, graphs, b, run_batch(service, b, args.tokens)))
                    graph_steps = service.metrics.steps.labels(mode="graph")._value.get()
                    if graphs and not graph_steps:
                        raise SystemExit("CUDA graphs were asked for but no step ran as graphs")
                finally:
                    service.close()
    print(f"generation through ktserve: {Path(args.model).name}, GPU part {args.dtype} on "
          f"{args.device}, 1 expert worker ({args.format}, {args.threads} threads), "
          f"{args.tokens} new tokens per request, KV cache {cache.num_slots} tokens (sized by "
          f"the service)")  # fmt: skip
    columns = [Column("spin us", 7), Column("graphs", 6), Column("batch", 5), Column("tok/s", 8),
               Column("vs off", 6), Column("steps", 5), Column("ms/step", 8), Column("gpu ms", 7),
               Column("transfer ms", 11), Column("expert wait ms", 14)]  # fmt: skip
    eager = {(spin, b): r["tok/s"] for spin, graphs, b, r in rows if not graphs}
    cells = []
    for spin, graphs, batch, r in rows:
        total = r["gpu"] + r["transfer"] + r["expert_wait"]
        base = eager.get((spin, batch))
        cells.append([
            "default" if spin is None else f"{spin:.0f}", "on" if graphs else "off", str(batch),
            f"{r['tok/s']:.1f}", f"{r['tok/s'] / base:.2f}x" if base else "-",
            str(int(r["steps"])), f"{total:.2f}", f"{r['gpu']:.2f}", f"{r['transfer']:.2f}",
            f"{r['expert_wait']:.2f}",
        ])  # fmt: skip
    print_table(columns, cells, rule=False)


if __name__ == "__main__":
    main()
