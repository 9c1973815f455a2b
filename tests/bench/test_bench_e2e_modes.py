"""bench_e2e's modes name the GPU part's linear format: bf16 in every mode but graph-fp8 and
graph-int8, never `auto`, whose choice depends on the GPU (until 2026-12-03 it picked FP8 for an
FP8 checkpoint on an FP8-capable GPU: the 48-layer runs measured FP8 linear layers where the
header said bf16)."""

from __future__ import annotations

from pathlib import Path

from bench.bench_e2e import MODES, linear_formats, service_config


def format_of(mode: str) -> str:
    return service_config(mode, Path("unused"), "cpu", "127.0.0.1:1", 4, 128).gpu_weight_format


def test_every_mode_names_its_linear_format():
    for mode in MODES:
        want = {"graph-fp8": "fp8", "graph-int8": "int8"}.get(mode, "bf16")
        assert format_of(mode) == want, mode
    assert format_of("graph@2") == "bf16"
    assert linear_formats(["graph", "graph@2"]) == "bf16"
    assert linear_formats(["graph", "graph-fp8"]) == "graph bf16, graph-fp8 fp8"
