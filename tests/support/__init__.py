"""What the tests and benchmarks share: tiny checkpoints, real subprocesses and their clients, and
the one reference MoE."""
