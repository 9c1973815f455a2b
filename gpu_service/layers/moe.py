"""MoE layers: a router on the model device, the routed experts through `RoutedExperts`, and an
optional shared expert (DeepSeek: always added; Qwen2-MoE: scaled by sigmoid(shared_expert_gate)).

Routers return (ids [T, k] int32 global expert ids, weights [T, k] float32 final multipliers,
routed_scaling_factor included), matching transformers 5's routers:
  GroupedSigmoidRouter  DeepSeek-V3: sigmoid scores, + e_score_correction_bias for choosing only,
                        top-2-sum group scores, topk_group groups, top-k, norm_topk_prob, scaling.
  SoftmaxRouter         DeepSeek-V2 (greedy / group_limited_greedy, float32 logits), Qwen-MoE and
                        Mixtral (logits in the model dtype, softmax in float32, top-k, renorm).

Expert deferral (MoE.num_deferred = D > 0, set by CausalLM.defer_experts): each token's D
lowest-weight routed experts of MoE layer l are a second call, submitted right behind the
immediate one (the k - D others) and waited for at the next MoE layer's combine, whose output
they join (the CPU computes them while the GPU runs on):

    out_l = shared_l(x_l) + immediate_l(x_l) + deferred_prev(x_prev)     (prev: the MoE layer
                                                                           before l, if it defers)
Each call holds all k columns, the other call's experts as ids -1 (weights 0). The last MoE
layer defers nothing, so every deferred output joins within the step.

Tensor parallelism (tp, parallel.py): only rank 0 routes and calls the experts, so the workers
see one call per layer and step whatever the group's size. Each rank's shared expert output is a
partial sum (its share of the intermediate columns); rank 0 adds the routed output to its own,
and one all-reduce gives every rank shared + routed. Without a shared expert rank 0 broadcasts
the routed output instead. Either way: one collective per MoE layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_service.experts.routed import PendingExperts, RoutedExperts, abandon
from gpu_service.layers import fused_ops
from gpu_service.layers.blocks import DenseMLP, Linear
from gpu_service.layers.sharding import SINGLE, TensorParallel


class GroupedSigmoidRouter(nn.Module):
    """fused_kernels: fused_ops' top-k where it applies (False: the torch code only)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        scaling: float,
        *,
        fused_kernels: bool = True,
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
        self.fused_kernels = fused_kernels

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.weight.shape[0]
        if (self.fused_kernels and fused_ops.supports(x)
                and fused_ops.grouped_topk_fits(e, self.num_groups)):  # fmt: skip
            logits = F.linear(x.float(), self.weight)  # [T, E]
            return fused_ops.grouped_sigmoid_topk(logits, self.bias, self.top_k, self.num_groups,
                                                  self.topk_groups, self.norm_topk_prob,
                                                  self.scaling)  # fmt: skip
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
    """fused_kernels: fused_ops' top-k where it applies (False: the torch code only)."""

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
        fused_kernels: bool = True,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.float() if logits_fp32 else weight)  # [E, H]
        self.top_k, self.norm_topk_prob, self.scaling = top_k, norm_topk_prob, scaling
        self.logits_fp32, self.round_to_model_dtype = logits_fp32, round_to_model_dtype
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.fused_kernels = fused_kernels

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float() if self.logits_fp32 else x, self.weight)  # [T, E]
        if self.fused_kernels and self.num_groups is None and fused_ops.supports(logits):
            return fused_ops.softmax_topk(logits, self.top_k, self.norm_topk_prob, self.scaling,
                                          self.round_to_model_dtype)  # fmt: skip
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
        tp: TensorParallel = SINGLE,
    ) -> None:
        """With tp sharded, `shared` must leave its output partial (DenseMLP reduce=False)."""
        super().__init__()
        self.layer, self.router, self.shared, self.shared_gate = layer, router, shared, shared_gate
        self.experts = experts
        self.tp = tp
        self.num_deferred = 0  # experts per token whose output joins at the next MoE layer

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

    def split(
        self, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """(ids, weights) [T, k] of the immediate call and, with num_deferred, of the deferred
        one (else None): each token's num_deferred lowest-weight experts are deferred (ties: the
        later column); each call's ids of the other's experts are -1, their weights 0."""
        if not self.num_deferred:
            return (ids, weights), None
        k = ids.shape[1]
        order = weights.argsort(dim=-1, descending=True, stable=True)  # [T, k]
        later = torch.zeros_like(ids, dtype=torch.bool)  # [T, k]
        later.scatter_(1, order[:, k - self.num_deferred :], True)
        now = (ids.masked_fill(later, -1), weights.masked_fill(later, 0.0))
        return now, (ids.masked_fill(~later, -1), weights.masked_fill(~later, 0.0))

    def combine(self, routed: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype,
                deferred: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The layer's output [T, H] in `dtype` (x's) from the experts' reply, shared_out and
        the previous MoE layer's deferred reply (None: it deferred nothing)."""
        routed = routed.to(dtype)
        out = routed if shared is None else routed + shared
        return out if deferred is None else out + deferred.to(dtype)

    def step(self, x: torch.Tensor, deferred: PendingExperts | None = None
             ) -> tuple[torch.Tensor, PendingExperts | None]:  # fmt: skip
        """The layer's output [T, H], the previous MoE layer's deferred call joined in, and this
        layer's own deferred call (None without deferral), for the next MoE layer to join."""
        if not self.tp.is_leader:
            return self._follower_step(x), None
        ids, weights = self.route(x)
        now, later = self.split(ids, weights)
        pending = self.experts.submit(self.layer, x, *now)
        # NOTE: the deferred call goes right behind the immediate one, and the shared expert
        # runs between submit and wait, while the experts compute
        pending_later = self.experts.submit(self.layer, x, *later) if later else None
        try:
            shared = self.shared_out(x)
            routed = pending.wait()
            joined = deferred.wait() if deferred is not None else None
        except BaseException:
            abandon(pending)  # NOTE: `deferred` stays the caller's to abandon
            abandon(pending_later)
            raise
        out = self.combine(routed, shared, x.dtype, joined)
        if self.tp.sharded:
            out = self.tp.all_reduce(out) if self.shared is not None else self.tp.broadcast(out)
        return out, pending_later

    def _follower_step(self, x: torch.Tensor) -> torch.Tensor:
        """A rank > 0's side of the layer's one collective (see the module docstring)."""
        shared = self.shared_out(x)
        if shared is None:
            return self.tp.broadcast(torch.empty_like(x))
        return self.tp.all_reduce(shared.to(x.dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.num_deferred:
            raise RuntimeError("a deferring MoE layer runs through step(), not forward()")
        return self.step(x)[0]
