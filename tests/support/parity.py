"""The two-process path's parity helpers: prompts whose routing is clear, served logits and
greedy tokens, and the bounds they are held to."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from gpu_service.engine import FinishReason, SamplingParams
from gpu_service.layers.moe import GroupedSigmoidRouter
from gpu_service.models import Batch, SeqInput
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401 - autouse

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "glm4_moe")


# Last-position logits, max|a - b| / max|b|, against transformers' fp32 forward. Exact path:
# bf16 experts, fp32 on the wire and in the GPU part. Fast paths: measured, bounds stated here
# (bf16 rounding of the GPU part and the wire ~2^-8 relative per operand; int8/int4 weights).
BOUNDS = {
    ("float32", "bf16"): 1e-3,
    ("bfloat16", "bf16"): 2e-2,
    ("float32", "int8"): 2e-2,
    ("float32", "int4"): 3e-1,
}


def prompts(seed: int, vocab: int = 101, lengths=(6, 13, 3)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# DeepSeek-V3 routing is a discrete top-k: where a token's k-th and (k+1)-th expert (or group)
# scores are within rounding of each other, bf16 or quantized weights may pick the other expert,
# and the logits move by a routing change, not by rounding (transformers' own bf16 forward moves
# 0.075 on such a prompt). The fast paths' bounds hold for prompts whose routing margin, in the
# fp32 reference, is at least this (measured: transformers bf16 within 0.0085 on 150 of them).
CLEAR_ROUTING_MARGIN = 1e-3


def grouped_choice_margin(scores: torch.Tensor, groups: int, topk_groups: int, top_k: int) -> float:
    """scores [T, E] (sigmoid + correction bias) -> the smallest gap between the last chosen and
    the first passed-over group score, and the same for experts within the chosen groups."""
    tokens, experts = scores.shape
    per_group = experts // groups
    group_scores = scores.view(tokens, groups, per_group).topk(2, dim=-1)[0].sum(-1)
    ranked_groups = group_scores.sort(dim=-1, descending=True)[0]
    margin = float((ranked_groups[:, topk_groups - 1] - ranked_groups[:, topk_groups]).min())
    chosen = group_scores.topk(topk_groups, dim=-1)[1]
    in_chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    eligible = scores.masked_fill(~in_chosen.repeat_interleave(per_group, 1), float("-inf"))
    ranked = eligible.sort(dim=-1, descending=True)[0]
    return min(margin, float((ranked[:, top_k - 1] - ranked[:, top_k]).min()))


def clear_routing_prompts(margin_of, seed: int, lengths=(6, 13, 3)) -> list[list[int]]:
    """prompts(seed)-like prompts whose routing margin (margin_of(prompt): routing_margin of a
    reference, or served_routing_margin) is at least CLEAR_ROUTING_MARGIN. Grown a token at a
    time, each drawn until the whole prompt so far routes clearly: attention is causal, so a token
    leaves the earlier positions' routing as it was, and a long prompt costs a few draws a token
    (whole random prompts of 34 tokens were all unclear in 1000 draws for seed 720902128)."""
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for n in lengths:
        prompt: list[int] = []
        while len(prompt) < n:
            for _ in range(1000):
                candidate = prompt + [int(torch.randint(0, 101, (1,), generator=g))]
                if margin_of(candidate) >= CLEAR_ROUTING_MARGIN:
                    prompt = candidate
                    break
            else:
                raise AssertionError(f"no token after {prompt} routes clearly in 1000 draws")
        chosen.append(prompt)
    return chosen


def served_routing_margin(service, prompt: list[int]) -> float:
    """routing_margin, of the served model's own DeepSeek-V3 routers (one prefill: with tensor
    parallelism rank 0's, which routes for all)."""
    inputs = []
    routers = [m for m in service.engine.model.modules() if isinstance(m, GroupedSigmoidRouter)]
    hooks = [r.register_forward_hook(lambda r, args, _: inputs.append((r, args[0])))
             for r in routers]  # fmt: skip
    try:
        with torch.no_grad():
            last_logits(service, [prompt])
    finally:
        for hook in hooks:
            hook.remove()
    assert inputs, "no DeepSeek-V3 router ran in the served model"
    return min(grouped_choice_margin(F.linear(x.float(), r.weight).sigmoid() + r.bias,
                                     r.num_groups, r.topk_groups, r.top_k)
               for r, x in inputs)  # fmt: skip


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def last_logits(service, batch_prompts: list[list[int]]) -> torch.Tensor:
    """One prefill of all prompts together through the model (GPU part + expert worker)."""
    model, kv = service.engine.model, service.engine.scheduler.kv_manager
    caches = [kv.allocate(len(p)) for p in batch_prompts]
    try:
        batch = Batch(tuple(SeqInput(p, c, 0) for p, c in zip(batch_prompts, caches)))
        return model.forward(batch)  # [B, V]
    finally:
        for c in caches:
            kv.free(c)


def greedy_together(service, batch_prompts, n: int) -> list[list[int]]:
    engine = service.engine
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outputs = [[] for _ in batch_prompts]
    done = threading.Semaphore(0)
    for i, prompt in enumerate(batch_prompts):

        def on_event(event, i=i):
            outputs[i].extend(t.token_id for t in event.tokens)
            if event.finish_reason is not None:
                assert event.finish_reason == FinishReason.LENGTH, event.error
                done.release()

        engine.add_request(prompt, params, on_event)
    for _ in batch_prompts:
        assert done.acquire(timeout=300)
    return outputs


def reference_greedy_check(model, prompt: list[int], tokens: list[int]) -> None:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]  # [L, V]
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        assert row[token] >= row.max() - 1e-5, f"token {i}: {token} vs argmax {int(row.argmax())}"
