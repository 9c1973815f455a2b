"""What is kept beside the packages and the durable benchmarks (bench/): generators
(serving_flags: docs/serving.md's flags), the GPU host's drivers (gpu_host_*.sh, sourcing
gpu_host_env.sh; parity_on_gpu_host.py), probes and profiles whose findings are recorded in
docs/results/ (probe_*, profile_decode_step.py). Run from the repo root."""
