"""What is kept beside the packages and the durable benchmarks (bench/): generators
(serving_flags: docs/serving.md's flags), the GPU host's drivers (gpu_host_*.sh, sourcing
gpu_host_env.sh; parity_on_gpu_host.py), and the studies whose findings are recorded in
docs/results/ or docs/ (probe_*, profile_decode_step.py, and the one-question benchmarks and A/B
scripts bench_* and gpu_memory_fit.py). Run from the repo root."""
