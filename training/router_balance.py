"""DeepSeek-V3's auxiliary-loss-free load balancing: after each optimizer step, every MoE layer's
e_score_correction_bias moves by `rate` toward the experts that got fewer tokens than average
(the bias only steers expert choice; gating weights come from the unbiased scores)."""

from __future__ import annotations

import torch
from torch import nn


class RouterBalancer:
    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = [torch.zeros_like(r.e_score_correction_bias) for r in self.routers]
        for router, counts in zip(self.routers, self.counts):
            router.register_forward_hook(self._hook(counts))
        self.last_imbalance = torch.ones(())

    @staticmethod
    def _hook(counts: torch.Tensor):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            if module.training:
                topk_indices = output[2]  # [T, k]
                counts.add_(torch.bincount(topk_indices.flatten(), minlength=counts.numel()))

        return hook

    @torch.no_grad()
    def update(self) -> None:
        """Apply the bias step from the loads seen since the last call. Sets last_imbalance: the
        worst layer's max-load / mean-load ratio (1.0 = balanced), a tensor, so no device sync."""
        ratios = []
        for router, counts in zip(self.routers, self.counts):
            mean = counts.mean().clamp_min(1.0)
            router.e_score_correction_bias += self.rate * torch.sign(mean - counts)
            ratios.append(counts.max() / mean)
            counts.zero_()
        self.last_imbalance = torch.stack(ratios).max()
