"""The durable benchmarks (docs/benchmarks.md: what each measures, how to run it, its figures),
each run as `python bench/NAME.py` from the repo root; they print one table each. common.py and
worker_process.py hold what they share, real_checkpoint.py writes the checkpoints at real shapes
they run on, baseline_kernel.py and huge_pages.py serve bench_moe_kernel's options, peers/ the
peers they run beside us."""
