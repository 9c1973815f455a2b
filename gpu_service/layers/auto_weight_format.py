"""`--gpu-weight-format auto`: the GPU part's linear layers unquantized where they fit, FP8 where
they would crowd out the KV cache.

bf16 where it fits: it is the checkpoint's own precision (no quantization error), and on the
GPU host it decoded at least as fast as fp8 (docs/quantization.md). So FP8 is chosen for
memory: where the unquantized GPU part would take more than BF16_MAX_SHARE of the memory budget
(DeepSeek-V3's on a 24-32 GB card) and the GPU has FP8 matrix units (FP8 checkpoints are
dequantized to bf16 otherwise, as before).
"""

from __future__ import annotations

from dataclasses import dataclass

BF16_MAX_SHARE = 0.5  # of the memory budget; the rest for the KV cache, activations, graphs


@dataclass(frozen=True)
class AutoFormat:
    format: str  # "bf16" or "fp8"
    reason: str  # for the start-up log


def choose_auto_format(bf16_bytes: int, budget_bytes: int | None, fp8_units: bool) -> AutoFormat:
    """bf16_bytes: the GPU part unquantized (per GPU); budget_bytes: what the memory plan may use
    on each GPU (None: not a CUDA device, no budget)."""
    gib = 2**30
    if budget_bytes is None:
        return AutoFormat("bf16", "not a CUDA device")
    size = (
        f"the unquantized GPU part is {bf16_bytes / gib:.1f} GiB of a "
        f"{budget_bytes / gib:.1f} GiB budget"
    )
    if bf16_bytes <= BF16_MAX_SHARE * budget_bytes:
        return AutoFormat("bf16", f"{size}: it fits (unquantized)")
    if not fp8_units:
        return AutoFormat("bf16", f"{size}, but this GPU has no FP8 matrix units")
    return AutoFormat("fp8", f"{size}, over {BF16_MAX_SHARE:.0%}: fp8 halves it")
