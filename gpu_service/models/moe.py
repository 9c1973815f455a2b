"""MoE layers: a router on the model device, the routed experts through `RoutedExperts`, and an
optional shared expert (DeepSeek: always added; Qwen2-MoE: scaled by sigmoid(shared_expert_gate)).

Routers return (ids [T, k] int32 global expert ids, weights [T, k] float32 final multipliers,
routed_scaling_factor included), matching transformers 5's routers:
  GroupedSigmoidRouter  DeepSeek-V3: sigmoid scores, + e_score_correction_bias for choosing only,
                        top-2-sum group scores, topk_group groups, top-k, norm_topk_prob, scaling.
  SoftmaxRouter         DeepSeek-V2 (greedy / group_limited_greedy, float32 logits), Qwen-MoE and
                        Mixtral (logits in the model dtype, softmax in float32, top-k, renorm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_service.models.experts import RoutedExperts
from gpu_service.models.layers import DenseMLP, Linear


class GroupedSigmoidRouter(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        scaling: float,
    ) -> None:
        super().__init__()
        num_experts = weight.shape[0]
        if num_experts % num_groups or not 0 < topk_groups <= num_groups:
            raise ValueError(
                f"{num_experts} experts cannot be split into n_group={num_groups} groups with "
                f"topk_group={topk_groups}"
            )
        self.register_buffer("weight", weight.float())  # [E, H]
        self.register_buffer("bias", bias.float())  # [E]
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E]
        choice = scores + self.bias  # [T, E]
        t, e = choice.shape
        grouped = choice.view(t, self.num_groups, e // self.num_groups)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = group_scores.topk(self.topk_groups, dim=-1, sorted=False)[1]  # [T, g]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        score_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e).bool()  # [T, E]
        choice = choice.masked_fill(~score_mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids.to(torch.int32), weights * self.scaling


class SoftmaxRouter(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        top_k: int,
        *,
        norm_topk_prob: bool,
        scaling: float = 1.0,
        logits_fp32: bool = False,
        round_to_model_dtype: bool = False,
        num_groups: int | None = None,
        topk_groups: int | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.float() if logits_fp32 else weight)  # [E, H]
        self.top_k, self.norm_topk_prob, self.scaling = top_k, norm_topk_prob, scaling
        self.logits_fp32, self.round_to_model_dtype = logits_fp32, round_to_model_dtype
        self.num_groups, self.topk_groups = num_groups, topk_groups

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float() if self.logits_fp32 else x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        if self.num_groups is not None and self.topk_groups is not None:
            t, e = probs.shape
            grouped = probs.view(t, self.num_groups, e // self.num_groups)  # [T, G, E/G]
            group_idx = grouped.max(dim=-1).values.topk(self.topk_groups, dim=-1)[1]  # [T, g]
            group_mask = torch.zeros(t, self.num_groups, device=x.device).scatter_(1, group_idx, 1)
            score_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e).bool()
            probs = probs.masked_fill(~score_mask, 0.0)
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_to_model_dtype:
            weights = weights.to(logits.dtype).float()
        return ids.to(torch.int32), weights * self.scaling


class MoE(nn.Module):
    def __init__(
        self,
        layer: int,
        router: nn.Module,
        experts: RoutedExperts,
        shared: DenseMLP | None = None,
        shared_gate: Linear | None = None,
    ) -> None:
        super().__init__()
        self.layer, self.router, self.shared, self.shared_gate = layer, router, shared, shared_gate
        self.experts = experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts each token goes to: ids [T, k] int32, weights [T, k] float32."""
        return self.router(x)

    def shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output [T, H] (gated where the family gates it), or None."""
        if self.shared is None:
            return None
        shared = self.shared(x)  # [T, H]
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return shared

    def combine(self, routed: torch.Tensor, shared: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """The layer's output [T, H] in `dtype` (x's) from the experts' reply and shared_out."""
        routed = routed.to(dtype)
        return routed if shared is None else routed + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        pending = self.experts.submit(self.layer, x, ids, weights)
        # NOTE: the shared expert runs between submit and wait, while the experts compute
        shared = self.shared_out(x)
        return self.combine(pending.wait(), shared, x.dtype)
