"""A decode step's host inputs (DecodeGraphs' bucket fill: tokens, positions, slots and the block
table) at long contexts, as the steps of a running batch fill them (each row the same sequence as
the step before, one token further) against a fill that writes every row's blocks anew (a row
new to its place: what every step wrote before rows kept what they held). Medians of --steps.

    python tools/bench_step_inputs.py [--batch 1,4,16] [--context 4096,20000,100000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

import torch  # noqa: E402

from bench.common import Column, print_table  # noqa: E402
from gpu_service.attention.batch import Batch, SeqInput  # noqa: E402
from gpu_service.engine.decode_graphs import Bucket, DecodeGraphConfig  # noqa: E402
from gpu_service.kvcache.sequence import SeqCache  # noqa: E402

BLOCK = 16


def fill_seconds(batch: int, context: int, steps: int, anew: bool) -> float:
    """Median seconds of one fill over `steps` decode steps from `context` tokens on."""
    blocks = -(-(context + steps) // BLOCK)
    kv_pad = DecodeGraphConfig().kv_bucket(context + steps, BLOCK)
    bucket = Bucket(batch, kv_pad, BLOCK, 8, torch.device("cpu"))
    caches = [SeqCache(i, BLOCK, list(range(i * blocks, (i + 1) * blocks)), context)
              for i in range(batch)]  # fmt: skip
    times = []
    for step in range(steps + 1):
        pos = context + step - 1
        for cache in caches:
            cache.num_tokens = pos
        inputs = Batch(tuple(SeqInput([1], cache, pos) for cache in caches))
        if anew:
            bucket._table_rows = [None] * batch
        start = time.perf_counter()
        bucket.fill(inputs, 0)
        if step:  # the first fill writes every row whatever
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,4,16")
    parser.add_argument("--context", default="4096,20000,100000")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            kept = fill_seconds(batch, context, args.steps, anew=False)
            anew = fill_seconds(batch, context, args.steps, anew=True)
            rows.append((str(batch), str(context), f"{kept * 1e6:.1f}", f"{anew * 1e6:.1f}",
                         f"{anew / kept:.1f}x"))  # fmt: skip
    print_table([Column("batch", 5), Column("context", 7), Column("kept us", 8),
                 Column("anew us", 8), Column("anew/kept", 9)], rows)  # fmt: skip


if __name__ == "__main__":
    main()
