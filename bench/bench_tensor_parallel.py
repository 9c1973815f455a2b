"""Decode and prefill speed of the GPU part split over N GPUs (--tensor-parallel-size) against
one GPU, through the engine, with the same expert worker(s).

Per size: decode, `--batch` concurrent greedy requests of `--tokens` new tokens each (tok/s and
ms per step, as bench_decode.py), and prefill, one request of a `--prefill`-token prompt and one
new token (the time to its first token: the prefill step, in one chunk). Size 1 runs with the
decode CUDA graphs on and off (sizes > 1 run eagerly: graphs are off with tensor parallelism);
every row's speed-up is against size 1 with graphs on.

    python bench/bench_tensor_parallel.py --model DIR --sizes 1,2,4,8 [--batch 16]
        [--prefill 8192] [--format int8] [--threads 8]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.bench_decode import run_batch
from bench.common import DEMO_MODEL, Column, default_device, print_table
from bench.worker_process import expert_worker
from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig
from gpu_service.engine import SamplingParams
from gpu_service.service import build_gpu_service


def prefill_seconds(service, num_tokens: int, vocab: int) -> float:
    """Seconds from adding a num_tokens prompt to its first token."""
    done = threading.Event()
    first: list[float] = []
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = [(7919 * i) % (vocab - 3) + 3 for i in range(num_tokens)]

    def on_event(event) -> None:
        if event.tokens and not first:
            first.append(time.perf_counter())
        if event.finish_reason is not None:
            done.set()

    start = time.perf_counter()
    service.engine.add_request(prompt, params, on_event)
    if not done.wait(600):
        raise SystemExit("the prefill did not finish within 600 s")
    return first[0] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to compare")
    parser.add_argument("--format", default="int8", help="the experts' weight format")
    parser.add_argument("--threads", type=int, default=1, help="threads per expert worker")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=default_device())
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    on_cuda = args.device.startswith("cuda")
    runs = [(1, True)] if on_cuda and 1 in sizes else []
    runs += [(s, False) for s in sizes]
    rows = []
    with expert_worker(args.model, args.format, args.threads) as address:
        for size, graphs in runs:
            tokens = max(args.prefill, args.batch)
            service = build_gpu_service(GPUServiceConfig(
                model_dir=args.model, device=args.device, dtype=args.dtype,
                tensor_parallel_size=size, cuda_graphs=graphs,
                cuda_graph_max_batch=args.batch,
                scheduler=SchedulerConfig(max_num_seqs=args.batch,
                                          max_num_batched_tokens=tokens,
                                          max_model_len=args.prefill + 16),
                experts=ExpertClientConfig((address,), wire_dtype=args.dtype)))  # fmt: skip
            try:
                vocab = service.engine.model.config.vocab_size
                run_batch(service, args.batch, 8)  # warm-up (and graph capture)
                decode = run_batch(service, args.batch, args.tokens)
                prefill_seconds(service, min(args.prefill, 256), vocab)  # warm-up
                prefill = prefill_seconds(service, args.prefill, vocab)
                rows.append((size, graphs, decode, prefill))
            finally:
                service.close()
    print(f"tensor parallelism: {Path(args.model).name}, GPU part {args.dtype} on "
          f"{args.device}.., 1 expert worker ({args.format}, {args.threads} "
          f"threads), decode batch {args.batch} x {args.tokens} tokens, prefill "
          f"{args.prefill} tokens")  # fmt: skip
    base = next(((d, p) for s, g, d, p in rows if s == 1 and g == on_cuda), None)
    columns = [Column("TP", 3), Column("graphs", 6), Column("decode tok/s", 12),
               Column("ms/step", 8), Column("vs TP=1", 7), Column("prefill s", 9),
               Column("prefill tok/s", 13), Column("vs TP=1", 7)]  # fmt: skip
    cells = []
    for size, graphs, decode, prefill in rows:
        step_ms = decode["gpu"] + decode["transfer"] + decode["expert_wait"]
        cells.append([
            str(size), "on" if graphs else "off", f"{decode['tok/s']:.1f}", f"{step_ms:.2f}",
            f"{decode['tok/s'] / base[0]['tok/s']:.2f}x" if base else "-", f"{prefill:.3f}",
            f"{args.prefill / prefill:.0f}", f"{base[1] / prefill:.2f}x" if base else "-",
        ])  # fmt: skip
    print_table(columns, cells, rule=False)


if __name__ == "__main__":
    main()
