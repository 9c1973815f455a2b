"""Benchmarks, each run as `python bench/NAME.py` from the repo root; they print one table each.
common.py holds what they share, peers/ the peers they run beside us."""
