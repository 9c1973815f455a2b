"""The whole two-process path against transformers: GPU service (this process) + `ktserve expert`
(a subprocess) over ktshm, for each family."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch

from gpu_service.experts.gpu_experts import worker_activation_counts
from tests.support.checkpoint_fixtures import one_per_family
from tests.support.checkpoints import load_reference_model
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401 - autouse
from tests.support.parity import (
    BOUNDS,
    FAMILIES,
    clear_routing_prompts,
    greedy_together,
    grouped_choice_margin,
    last_logits,
    prompts,
    reference_greedy_check,
    relative_error,
)
from tests.support.worker_services import DEVICE, worker_service

CHECKPOINTS = one_per_family(FAMILIES)


def routing_margin(reference, prompt: list[int]) -> float:
    """Smallest gap, over tokens and MoE layers, between a chosen and a passed-over score in the
    reference's DeepSeek-V3 routing (group choice, then expert choice within chosen groups)."""
    logits = []
    routers = [m for m in reference.modules() if hasattr(m, "e_score_correction_bias")]
    hooks = [r.register_forward_hook(lambda r, _, out: logits.append((r, out[0]))) for r in routers]
    try:
        with torch.no_grad():
            reference(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()
    assert logits, "no DeepSeek-V3 router found in the reference model"
    return min(grouped_choice_margin(logits.sigmoid() + router.e_score_correction_bias,
                                     router.num_group, router.topk_group, router.top_k)
               for router, logits in logits)  # fmt: skip


def service_for(path, worker: ExpertProcess, dtype: str, wire_dtype: str, gpu_experts: int = 0):
    return worker_service(path, worker, wire_dtype=wire_dtype, dtype=dtype, kv_cache_tokens=1024,
                          gpu_experts=gpu_experts)  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_path_matches_transformers(family, checkpoints, seed):
    path = checkpoints[family]
    reference = load_reference_model(path)
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    service = None
    try:
        service = service_for(path, worker, "float32", "float32")
        if DEVICE == "cuda":  # the channel is registered as pinned memory: copies go straight
            assert service.experts._registered
        ps = prompts(seed)
        got = last_logits(service, ps).cpu()
        for i, prompt in enumerate(ps):
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0, -1]
            err = relative_error(got[i], want)
            print(f"{family}: prompt {i} last-position logits relative error {err:.2e}")
            assert err < BOUNDS[("float32", "bf16")]
        alone = greedy_together(service, ps[:1], 32)[0]
        together = greedy_together(service, ps, 32)
        assert together[0] == alone
        for prompt, tokens in zip(ps, together):
            assert len(tokens) == 32
            reference_greedy_check(reference, prompt, tokens)
    finally:
        if service is not None:
            service.close()
        worker.close()


@pytest.mark.parametrize("dtype, fmt", [("bfloat16", "bf16"), ("float32", "int8"),
                                        ("float32", "int4")])  # fmt: skip
def test_fast_paths_stay_within_stated_bounds(dtype, fmt, checkpoints, seed):
    path = checkpoints["deepseek_v3"]
    reference = load_reference_model(path)
    worker = ExpertProcess("--model", str(path), "--format", fmt)
    service = None
    try:
        service = service_for(path, worker, dtype, dtype)
        ps = clear_routing_prompts(partial(routing_margin, reference), seed + 1)
        got = last_logits(service, ps).cpu()
        errors = []
        for i, prompt in enumerate(ps):
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0, -1]
            errors.append(relative_error(got[i], want))
        print(f"{dtype} GPU part + wire, {fmt} experts: logits relative error {max(errors):.2e}")
        assert max(errors) < BOUNDS[(dtype, fmt)]
    finally:
        if service is not None:
            service.close()
        worker.close()


@pytest.mark.parametrize("gpu_experts", [3, 12])
def test_gpu_experts_split_gives_the_same_logits(gpu_experts, checkpoints, seed):
    """Hot experts on the GPU, the rest on the worker: the sum is the same model (12 = all)."""
    path = checkpoints["deepseek_v3"]
    reference = load_reference_model(path)
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    service = None
    try:
        service = service_for(path, worker, "float32", "float32", gpu_experts=gpu_experts)
        ps = prompts(seed + 2)
        got = last_logits(service, ps).cpu()
        for i, prompt in enumerate(ps):
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0, -1]
            assert relative_error(got[i], want) < BOUNDS[("float32", "bf16")]
    finally:
        if service is not None:
            service.close()
        worker.close()


def test_gpu_experts_follow_the_traffic(checkpoints, seed):
    """The GPU side counts every routed id; for the experts the worker computed its own counts
    (GetStats) agree. A refresh makes each layer's most used experts of the interval hot (ties
    keep the current ones), and after the swap it is still the same model."""
    path = checkpoints["deepseek_v3"]
    reference = load_reference_model(path)
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    service = None
    try:
        service = service_for(path, worker, "float32", "float32", gpu_experts=3)
        experts = service.refresher.experts
        before = {layer: experts.hot_ids(layer) for layer in experts.layers}
        ps = prompts(seed + 3, lengths=(9, 14, 5))
        # NOTE: the workers count every call since they started, the memory plan's profiling
        # forwards (on CUDA) included: this traffic's are the difference
        earlier = worker_activation_counts(service.experts)
        last_logits(service, ps)
        seen = {key: n - earlier.get(key, 0)
                for key, n in worker_activation_counts(service.experts).items()}  # fmt: skip
        top_k = experts.reader.spec.num_experts_per_tok
        for layer, hot in before.items():
            counts = experts.counts[layer].cpu().tolist()
            assert sum(counts) == sum(map(len, ps)) * top_k
            for e, n in enumerate(counts):
                if e not in hot:
                    assert n == seen.get((layer, e), 0), (layer, e)

        def beats(e: int, f: int, counts: list[int], hot: list[int]) -> bool:
            """Whether chosen e may stay while f is left out: more calls; on a tie, e is hot and
            f is not (ties keep the current ones); on a tie of both, the lower id."""
            if counts[e] != counts[f]:
                return counts[e] > counts[f]
            if (e in hot) != (f in hot):
                return e in hot
            return e < f

        def expected_hot(counts: list[int], hot: list[int]) -> list[int]:
            """By brute force: the one set of 3 whose every expert beats every one left out."""
            valid = [
                sorted(chosen)
                for chosen in itertools.combinations(range(len(counts)), 3)
                if all(beats(e, f, counts, hot)
                       for e in chosen for f in range(len(counts)) if f not in chosen)
            ]  # fmt: skip
            assert len(valid) == 1, (counts, hot, valid)
            return valid[0]

        expected = {
            layer: expected_hot(experts.counts[layer].cpu().tolist(), hot)
            for layer, hot in before.items()
        }
        changed = service.refresher.refresh()
        assert changed == {layer: ids for layer, ids in expected.items() if ids != before[layer]}
        assert changed, "random routing left every layer's hot set as it was"
        got = last_logits(service, ps).cpu()  # the first calls install the staged sets
        assert experts.swaps == len(changed)
        assert {layer: experts.hot_ids(layer) for layer in experts.layers} == expected
        for i, prompt in enumerate(ps):
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0, -1]
            assert relative_error(got[i], want) < BOUNDS[("float32", "bf16")]
        assert service.refresher.refresh() == {}  # the same traffic again: nothing to change
        # Tied intervals (the counts the refresher reads, raised by hand): all experts alike, then
        # two cold ones ahead and the rest alike (the third place goes to the lowest hot one).
        num_experts = experts.reader.spec.num_experts
        current = {layer: experts.hot_ids(layer) for layer in experts.layers}
        assert any(ids != [0, 1, 2] for ids in current.values()), "ties would not show"
        cold = {layer: [e for e in range(num_experts) if e not in ids][-2:]
                for layer, ids in current.items()}  # fmt: skip
        for interval in ("all alike", "two cold ahead"):
            want = {}
            for layer, counts in experts.counts.items():
                delta = [1] * num_experts
                if interval == "two cold ahead":
                    delta[cold[layer][0]] = delta[cold[layer][1]] = 2
                counts += torch.tensor(delta, dtype=counts.dtype, device=counts.device)
                want[layer] = expected_hot(delta, current[layer])
            if interval == "all alike":
                assert want == current
            else:
                assert all(set(cold[layer]) < set(want[layer]) for layer in want)
            changed = service.refresher.refresh()
            assert changed == {layer: ids for layer, ids in want.items() if ids != current[layer]}
            assert {layer: experts.hot_ids(layer) for layer in experts.layers} == want
            current = want
    finally:
        if service is not None:
            service.close()
        worker.close()
