"""The decode speed the host's DRAM rate bounds: every step reads each routed expert it touches
once from RAM, so tokens per second <= DRAM rate / routed bytes per token.

    batch 1:  k experts x bytes per expert x MoE layers per token
    batch B:  E (1 - (1 - k/E)^B) distinct experts a layer (uniform routing), shared by B tokens

The prediction is the bound times the share of it ktserve reaches today, from its own runs.
"""

from __future__ import annotations

from dataclasses import dataclass

# Measured shares of the DRAM bound, graph-mode decode, int4 experts, one worker: all 48 layers
# of Qwen3-30B-A3B ran at 70% (batch 1) and 89% (batch 16) of it, 16 layers at 76% / 103%
# (docs/benchmarks.md; docs/results/2026-12-02-chained-decode-steps.md;
# docs/gpu-host-verification.md: 73-75% at batch 1). Estimates for another model and host.
MEASURED_SHARE_OF_BOUND = {1: 0.75, 16: 0.89}


def distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts one layer reads for `batch` tokens of uniform routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class DecodePrediction:
    batch: int
    routed_bytes_per_token: float
    bound_tok_s: float  # the whole batch's tokens per second at the DRAM rate
    share_of_bound: float
    predicted_tok_s: float


def predict_decode(
    batch: int, num_experts: int, top_k: int, expert_bytes: int, num_moe_layers: int,
    dram_gbs: float,
) -> DecodePrediction:  # fmt: skip
    step_bytes = distinct_experts(num_experts, top_k, batch) * expert_bytes * num_moe_layers
    bound = batch * dram_gbs * 1e9 / step_bytes
    share = MEASURED_SHARE_OF_BOUND[batch]
    return DecodePrediction(batch, step_bytes / batch, bound, share, share * bound)
