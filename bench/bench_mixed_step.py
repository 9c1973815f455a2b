"""A long prompt joining running decodes: the prompt's time alone and joined, and the decodes'
inter-token latency (ITL) undisturbed and while it is prefilled, in one run.

An in-process GPU service (the model's GPU part, its engine and scheduler as `ktserve serve`
builds them) on one `ktserve expert` worker subprocess, prefix caching off and every prompt fresh
random tokens. Per pair of --max-num-batched-tokens and --max-decode-stall-ms values (a service
each, on the same worker; none: the default policy, chunks sized by the step cost models), --repeats
times:
  1. the prompt alone: seconds to its first token (its whole prefill, chunked as the scheduler
     chunks it);
  2. --decodes requests decoding (greedy, ignore_eos): their ITL over --window tokens each;
  3. a prompt of the same length submitted while they decode: its seconds to first token, and
     the decodes' ITL over the gaps that overlap it.
--warm-up-repeats (default 1 on CUDA) measurements come first and are not recorded: a fresh
service's first mixed step on CUDA compiles kernels.
The table shows each value's median over the repeats (the ratios: medians of each repeat's);
steps: the decodes' tokens while the prompt was prefilled, per decode (the steps it took); lost:
what each decode lost to the prompt (its gaps while the prompt was prefilled, less as many
undisturbed median gaps). Targets (issue 45): joined <= 1.5x alone; lost <= alone (the decodes
lose no more than the prompt's own compute time).

    python bench/bench_mixed_step.py [--model demo_model] [--prompt-tokens 2000] [--decodes 8]
        [--max-num-batched-tokens 2048] [--max-decode-stall-ms none,50] [--repeats 3]
        [--label NAME]
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

import numpy as np
import torch

from bench.common import DEMO_MODEL, Column, default_device, print_table
from bench.worker_process import expert_worker
from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig
from gpu_service.engine import SamplingParams
from gpu_service.service import build_gpu_service

TIMEOUT_S = 900.0
JOINED_TARGET = 1.5


class Arrivals:
    """Token arrival times per request, fed by the engine thread's callbacks."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.events: queue.Queue = queue.Queue()

    def callback(self, key: str):
        self.times[key] = []

        def on_event(event) -> None:
            now = time.perf_counter()
            if event.error is not None:
                self.events.put(("error", key, str(event.error)))
                return
            self.times[key].extend([now] * len(event.tokens))
            self.events.put(("tokens", key, now))

        return on_event

    def wait_until(self, done) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not done():
            kind, key, what = self.events.get(timeout=max(deadline - time.monotonic(), 0.001))
            if kind == "error":
                raise SystemExit(f"request {key} failed: {what}")


def prompt_seconds(engine, arrivals: Arrivals, prompt: list[int], key: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params, arrivals.callback(key))
    arrivals.wait_until(lambda: arrivals.times[key])
    return arrivals.times[key][0] - start


def gaps(times: list[float], lo: float, hi: float) -> list[float]:
    """Inter-token gaps that overlap (lo, hi)."""
    return [b - a for a, b in zip(times, times[1:]) if b > lo and a < hi]


def measure(service, args, rng: random.Random) -> dict:
    engine, vocab = service.engine, service.engine.model.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    arrivals = Arrivals()
    prompt_seconds(engine, arrivals, tokens(64), "warm-up")
    alone = prompt_seconds(engine, arrivals, tokens(args.prompt_tokens), "alone")
    room = service.max_model_len - args.decode_prompt_tokens - 1
    params = SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)
    keys = [f"decode-{i}" for i in range(args.decodes)]
    ids = [engine.add_request(tokens(args.decode_prompt_tokens), params, arrivals.callback(k))
           for k in keys]  # fmt: skip
    warm = 4
    arrivals.wait_until(lambda: min(len(arrivals.times[k]) for k in keys) >= warm + args.window)
    submitted = time.perf_counter()
    joined = prompt_seconds(engine, arrivals, tokens(args.prompt_tokens), "joined")
    done = submitted + joined
    arrivals.wait_until(lambda: all(arrivals.times[k][-1] > done for k in keys))
    for request_id in ids:
        engine.abort(request_id)
    before = []  # gaps wholly before the prompt came
    for k in keys:
        before.extend(np.diff([t for t in arrivals.times[k][warm:] if t <= submitted]))
    during = [g for k in keys for g in gaps(arrivals.times[k], submitted, done)]
    return {
        "alone": alone,
        "joined": joined,
        "before": before,
        "during": during,
        "num_decodes": len(keys),
    }


def summary(runs: list[dict]) -> dict:
    """Medians over repeats: each run's times, percentiles and ratios."""
    per_run = []
    for m in runs:
        b50, b99 = np.percentile(m["before"], [50, 99]) * 1e3
        d50, d99 = np.percentile(m["during"], [50, 99]) * 1e3
        per_run.append(dict(alone=m["alone"], joined=m["joined"], slow=m["joined"] / m["alone"],
                            b50=b50, b99=b99, d50=d50, d99=d99, spike=d99 / b99,
                            steps=len(m["during"]) / m["num_decodes"],
                            lost=(sum(m["during"]) - len(m["during"]) * np.median(m["before"]))
                            / m["num_decodes"]))  # fmt: skip
    return {key: float(np.median([r[key] for r in per_run])) for key in per_run[0]}


def measure_service(address: str, args, budget: int, stall_ms: float | None,
                    rng: random.Random) -> list[dict]:  # fmt: skip
    """--repeats measurements on a service of this token budget and stall target."""
    scheduler = SchedulerConfig(max_num_seqs=args.decodes + 2, max_num_batched_tokens=budget,
                                max_decode_stall_ms=stall_ms,
                                min_prefill_chunk_tokens=args.min_prefill_chunk_tokens)  # fmt: skip
    config = GPUServiceConfig(model_dir=args.model, device=args.device, dtype=args.dtype,
                              prefix_caching=False, scheduler=scheduler,
                              experts=ExpertClientConfig((address,)))  # fmt: skip
    service = build_gpu_service(config)
    runs = []
    warm_up = args.warm_up_repeats
    if warm_up is None:
        warm_up = 1 if torch.device(args.device).type == "cuda" else 0
    try:
        for _ in range(warm_up):
            measure(service, args, rng)
        for repeat in range(args.repeats):
            m = measure(service, args, rng)
            runs.append(m)
            b99, d99 = (np.percentile(m[k], 99) * 1e3 for k in ("before", "during"))
            print(f"measured: {budget} batched tokens, {policy_name(stall_ms)}, repeat "
                  f"{repeat + 1}: alone {m['alone']:.2f} s, joined {m['joined']:.2f} s, ITL p99 "
                  f"{b99:.0f} -> {d99:.0f} ms", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        service.close()
    return runs


def policy_name(stall_ms: float | None) -> str:
    return "default" if stall_ms is None else f"{stall_ms:g} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--format", default="int8", help="the experts' weight format")
    parser.add_argument("--threads", type=int, default=1, help="expert worker threads")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--decode-prompt-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, default=40, help="undisturbed tokens per decode")
    parser.add_argument("--max-num-batched-tokens", default="2048",
                        help="comma-separated: a service per value (and stall target)")  # fmt: skip
    parser.add_argument("--max-decode-stall-ms", default="none",
                        help="comma-separated: a service per value (and token budget); none: no "
                        "target, the default")  # fmt: skip
    parser.add_argument("--min-prefill-chunk-tokens", type=int,
                        default=SchedulerConfig().min_prefill_chunk_tokens,
                        help="chunks beside decodes under a stall target: at least (default "
                        "%(default)s)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="measurements per service; the table shows medians")  # fmt: skip
    parser.add_argument("--warm-up-repeats", type=int, default=None,
                        help="unrecorded measurements first, per service (default: 1 on "
                        "CUDA, where a fresh service's first mixed step compiles kernels, else "
                        "0)")  # fmt: skip
    parser.add_argument("--label", default=Path(__file__).resolve().parent.parent.name,
                        help="this tree's name in the table (default: its directory)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="threads of this process's torch (the GPU part on the CPU); 0: "
                        "torch's default")  # fmt: skip
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    rng = random.Random(args.seed)
    budgets = [int(b) for b in args.max_num_batched_tokens.split(",")]
    targets = [None if t == "none" else float(t) for t in args.max_decode_stall_ms.split(",")]
    rows = []
    with expert_worker(args.model, args.format, args.threads) as address:
        for budget in budgets:
            for stall_ms in targets:
                runs = measure_service(address, args, budget, stall_ms, rng)
                rows.append((budget, stall_ms, summary(runs)))

    print(f"a {args.prompt_tokens}-token prompt joining {args.decodes} decodes: "
          f"{Path(args.model).name}, {args.format} experts, GPU part on {args.device} "
          f"({torch.get_num_threads()} torch threads), tree {args.label}, medians of "
          f"{args.repeats} repeat(s)")  # fmt: skip
    columns = [Column("tree", 12, "<"), Column("batched tokens", 14), Column("stall target", 12),
               Column("alone s", 8), Column("joined s", 8), Column("x", 5),
               Column("ITL p50 ms", 10), Column("p99 ms", 7), Column("during p50", 10),
               Column("p99 ms", 7), Column("x p99", 6), Column("steps", 5),
               Column("lost s", 7), Column("", 6, "<")]  # fmt: skip
    cells = []
    for budget, stall_ms, m in rows:
        ok = m["slow"] <= JOINED_TARGET and m["lost"] <= m["alone"]
        cells.append([args.label, budget, policy_name(stall_ms), f"{m['alone']:.2f}",
                      f"{m['joined']:.2f}", f"{m['slow']:.2f}", f"{m['b50']:.1f}",
                      f"{m['b99']:.1f}", f"{m['d50']:.1f}", f"{m['d99']:.1f}",
                      f"{m['spike']:.1f}", f"{m['steps']:.0f}", f"{m['lost']:.2f}",
                      "ok" if ok else "MISSED"])  # fmt: skip
    print_table(columns, cells)


if __name__ == "__main__":
    main()
