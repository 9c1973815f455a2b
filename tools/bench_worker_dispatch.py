"""The worker's own work per MoE call, without any wait: take a request already in the slot,
dispatch it, run the kernel, publish, count it. In one process (no scheduling between two),
so the figure is the worker's CPU time per call, which bench_worker_call's round trip holds
among wake-ups a loaded machine stretches.

Each source tree given (default: this one) runs in a subprocess of its own, in alternate rounds,
on the same tiny checkpoint (tests/support: Qwen3-MoE at test scale), one kernel thread.

    python tools/bench_worker_dispatch.py [--tree DIR ...] [--rounds 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--child" not in sys.argv:  # NOTE: a child imports the tree its PYTHONPATH names
    sys.path.insert(0, str(ROOT))


def measure(model: str, tokens: int, calls: int) -> list[int]:
    """In the tree this process imports: ns per call of recv_request + the worker's _execute."""
    import numpy as np

    import ktshm
    from expert_service.config import WorkerConfig
    from expert_service.worker import ExpertWorker
    from ktserve import wire
    from ktserve.checkpoint import ModelSpec

    spec = ModelSpec.from_checkpoint(model)
    worker = ExpertWorker(WorkerConfig(threads=1, share_experts=False))
    worker.load(model, None, "int4")
    producer = ktshm.Channel.create(ktshm.ChannelConfig(num_slots=8, region_bytes=1 << 16))
    consumer = ktshm.Channel.attach(producer.name)
    takes_serving = "serving" in inspect.signature(worker._execute).parameters
    serving = None
    if takes_serving:  # NOTE: this tree keeps per-channel state: made as attach() makes it
        from expert_service.worker import _Serving

        serving = _Serving(worker.metrics.new_call_counts(), None)
    rng = np.random.default_rng(0)
    k = spec.num_experts_per_tok
    x = rng.standard_normal((tokens, spec.hidden_size), dtype=np.float32)
    ids = np.stack([rng.permutation(spec.num_experts)[:k] for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, k), dtype=np.float32)
    out = []
    try:
        for i in range(calls):
            seq = producer.send(wire.KIND_MOE, spec.moe_layers[i % len(spec.moe_layers)],
                                [x, ids, w], num_tokens=tokens)  # fmt: skip
            t0 = time.perf_counter_ns()
            req = consumer.recv_request(timeout=5)
            if takes_serving:
                worker._execute(consumer, req, serving)
            else:
                worker._execute(consumer, req)
            out.append(time.perf_counter_ns() - t0)
            producer.recv(seq, timeout=5)
            producer.release(seq)
    finally:
        consumer.close()
        producer.close()
        worker.close()
    return out[calls // 10 :]  # NOTE: the first calls warm caches and allocators


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", help="a source tree, extensions built (repeatable)")
    p.add_argument("--tokens", default="1,4", help="tokens per call (default 1,4)")
    p.add_argument("--rounds", type=int, default=5, help="alternations (default 5)")
    p.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    from bench.common import Column, print_table
    from tests.support.checkpoints import make_tiny_checkpoint

    trees = [str(Path(t).resolve()) for t in (args.tree or [str(ROOT)])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_checkpoint("qwen3_moe", Path(tmp) / "q", seed=0))
        for tokens in (int(t) for t in args.tokens.split(",")):
            samples = {tree: [] for tree in trees}
            for _ in range(args.rounds):
                for tree in trees:
                    run = subprocess.run(
                        [sys.executable, "-P", __file__, "--child", model, str(tokens),
                         str(args.calls)],
                        env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"}, cwd=tree,
                        capture_output=True, text=True, check=True,
                    )  # fmt: skip
                    samples[tree] += json.loads(run.stdout.splitlines()[-1])
            for tree in trees:
                s = sorted(samples[tree])
                p10, p90 = s[len(s) // 10] / 1e3, s[len(s) * 9 // 10] / 1e3
                median = statistics.median(s) / 1e3
                rows.append([str(tokens), tree, f"{median:.1f}", f"{p10:.1f}", f"{p90:.1f}"])
    print(f"the worker's work per MoE call (recv_request of a waiting request + _execute), tiny "
          f"Qwen3-MoE, int4, 1 kernel thread, {args.rounds} x {args.calls} calls per "
          "tree")  # fmt: skip
    print_table([Column("tokens", 6), Column("tree", 40, "<"), Column("median us", 9),
                 Column("p10 us", 6), Column("p90 us", 6)], rows)  # fmt: skip


if __name__ == "__main__":
    main()
