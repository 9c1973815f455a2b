"""What expert deferral costs: held-out perplexity of the demo model served by ktserve with
KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN D = 0 .. top_k - 1, one run, against D = 0.

The path measured is bench_quality's serving one: the GPU part (this process, fp32) + one
`ktserve expert` worker subprocess (bf16 experts, the checkpoint's own weights) over ktshm, fp32
on the wire; the rows differ only in D. Perplexity as training/perplexity.py defines it (same
windows). Deferral moves each token's D lowest-weight routed experts of every MoE layer but the
last to the next MoE layer's output (gpu_service/layers/moe.py).

    python tools/bench_deferral.py [--model demo_model] [--text training/heldout_sample.txt]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.bench_quality import add_perplexity_args, served_perplexity
from bench.common import Column, print_table
from bench.worker_process import expert_worker
from ktserve.checkpoint import HFConfig, ModelSpec
from training.perplexity import tokenize_file

TARGET = 0.005  # issue 13: deferral may cost at most 0.5% of held-out perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_perplexity_args(parser)
    args = parser.parse_args()
    model = Path(args.model)
    spec = ModelSpec.from_hf(HFConfig.from_checkpoint(model))
    top_k = spec.num_experts_per_tok
    ids = tokenize_file(model, args.text, args.max_tokens)
    rows = []
    with expert_worker(model, "bf16", args.threads) as address:
        for deferred in range(top_k):
            start = time.perf_counter()
            ppl = served_perplexity(model, address, ids, args.seq_len, args.device, deferred)
            rows.append((deferred, ppl, time.perf_counter() - start))

    print(
        f"held-out perplexity with expert deferral: {model.name} (top_k {top_k}, "
        f"{len(spec.moe_layers)} MoE layers, the last never defers), {len(ids)} tokens of "
        f"{Path(args.text).name}, windows of {args.seq_len}, GPU part on {args.device}"
    )
    columns = [Column("deferred D", 10), Column("immediate", 9), Column("perplexity", 10),
               Column("vs D=0", 8), Column("target", 7), Column("s", 5),
               Column("", 6, "<")]  # fmt: skip
    base = rows[0][1]
    cells = []
    for deferred, ppl, seconds in rows:
        delta = ppl / base - 1
        verdict = "" if not deferred else ("ok" if delta <= TARGET else "MISSED")
        cells.append([str(deferred), str(top_k - deferred), f"{ppl:.4f}", f"{delta:+.3%}",
                      f"{TARGET:.1%}" if deferred else "", f"{seconds:.1f}", verdict])  # fmt: skip
    print_table(columns, cells)


if __name__ == "__main__":
    main()
