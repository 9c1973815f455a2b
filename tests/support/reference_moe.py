"""The one plain torch MoE the kernel tests, the checkpoint tests and the benchmarks compare with.

DESIGN's MoE call: y[t] = sum_j w[t,j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t,j];
an id of -1 is not this call's (skipped). Written from that formula alone, nothing shared with
expert_service, so a kernel test checks the kernel against it and not against itself.
"""

from __future__ import annotations

import torch


def reference_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """y [T, H] in `dtype` for x [T, H], ids [T, k] (-1 = skip), weights [T, k], gate and up
    [E, I, H], down [E, H, I] (as checkpoints store them: y = W @ x).

    Everything is computed and accumulated in `dtype`: x, the weights of each expert used (bf16
    widens to fp32 exactly) and the routing weights are converted to it, h stays in it, y sums in
    it. float32 is the tests' oracle; bfloat16 is the benchmarks' plain bf16 baseline. One loop over
    the experts the call uses, each reading its weights once.
    """
    num_tokens, hidden = x.shape
    xs, ws = x.to(dtype), weights.to(dtype)
    y = torch.zeros(num_tokens, hidden, dtype=dtype)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)  # the (token, slot) pairs on e
        xe = xs[tok]  # [P, H]
        h = torch.nn.functional.silu(xe @ gate[e].to(dtype).T) * (xe @ up[e].to(dtype).T)  # [P, I]
        y.index_add_(0, tok, (h @ down[e].to(dtype).T) * ws[tok, slot, None])
    return y
