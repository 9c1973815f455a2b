"""The GPU part's weight formats' logits bounds and the modules each quantizes."""

from __future__ import annotations

from gpu_service.layers.linear import (
    FP8Linear,
    Int4Linear,
    Int8Linear,
)

MODULES = {"fp8": FP8Linear, "int8": Int8Linear, "int4": Int4Linear}


# Norm-relative error of the prefill logits against transformers (float32, bf16 checkpoint):
# measured up to 4.3e-2 (fp8), 1.5e-2 (int8), 1.3e-1 (int4: groups of 4-8 inputs at these tiny
# widths) over the four families; the exact path stays at 2.5e-7.
LOGITS_TOL = {"bf16": 1e-4, "fp8": 0.08, "int8": 0.03, "int4": 0.25}
