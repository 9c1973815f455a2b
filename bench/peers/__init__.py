"""Peers the benchmarks run beside ktserve on the same shapes and inputs (kt-kernel)."""
