"""GGUF checkpoints served through both processes (GPU service here, `ktserve expert --model
FILE.gguf` a subprocess) against transformers run on the weights the GGUF holds (dequantized by
the gguf package, saved as a Hugging Face checkpoint), for each family."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.support.checkpoints import load_reference_model, make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401 - autouse
from tests.support.gguf_checkpoints import (
    GGUF_OVERRIDES,
    float_types,
    mixed_types,
    save_reference,
    write_gguf,
)
from tests.support.parity import (
    BOUNDS,
    greedy_together,
    last_logits,
    prompts,
    reference_greedy_check,
    relative_error,
)
from tests.support.worker_services import worker_service

FAMILIES = tuple(GGUF_OVERRIDES)


def gpu_part_mixed(name: str, shape: tuple[int, ...]) -> T:
    """mixed_types for the GPU part (Q8_0 attention, F16 embeddings and head, F32 norms), the
    routed experts BF16: a worker packing bf16 holds them exactly."""
    return T.BF16 if "_exps" in name else mixed_types(name, shape)


def served(path, worker_format: str = "bf16"):
    worker = ExpertProcess("--model", str(path), "--format", worker_format)
    try:
        return worker, worker_service(path, worker, dtype="float32", kv_cache_tokens=1024)
    except BaseException:
        worker.close()
        raise


def gguf_and_reference(family: str, tmp_path, seed: int, types, *, experts_as_bf16=False):
    """experts_as_bf16: the reference's routed experts rounded to bf16, as a worker packing bf16
    holds experts dequantized from another type."""
    checkpoint = make_tiny_checkpoint(family, tmp_path / "ckpt", seed=seed,
                                      **GGUF_OVERRIDES[family])  # fmt: skip
    first, weights = write_gguf(checkpoint, tmp_path / f"{family}.gguf", types, seed=seed)
    if experts_as_bf16:
        weights = {name: w.bfloat16().float() if ".experts." in name else w
                   for name, w in weights.items()}  # fmt: skip
    reference = load_reference_model(save_reference(checkpoint, weights, tmp_path / "reference"))
    return checkpoint, first, reference


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_gpu_part_matches_transformers(family, tmp_path, seed):
    """Q8_0 / F16 / BF16 / F32 tensors dequantized at load into the GPU part: the served logits
    are transformers' on those weights, and the greedy tokens its argmax."""
    _, first, reference = gguf_and_reference(family, tmp_path, seed, gpu_part_mixed)
    worker, service = served(first)
    try:
        ps = prompts(seed)
        got = last_logits(service, ps).cpu()
        for i, prompt in enumerate(ps):
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0, -1]
            err = relative_error(got[i], want)
            print(f"{family}: prompt {i} last-position logits relative error {err:.2e}")
            assert err < BOUNDS[("float32", "bf16")]
        for prompt, tokens in zip(ps, greedy_together(service, ps, 16)):
            reference_greedy_check(reference, prompt, tokens)
    finally:
        service.close()
        worker.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_k_quant_experts_are_the_dequantized_weights_in_bf16(family, tmp_path, seed):
    """Routed experts stored Q4_K (gate, up) and Q6_K (down), the GPU part mixed: the worker
    packs the dequantized experts as bf16, so the served model is transformers' on the
    dequantized weights with the experts rounded to bf16 (nothing else changes them)."""
    _, first, reference = gguf_and_reference(family, tmp_path, seed + 1, mixed_types,
                                             experts_as_bf16=True)  # fmt: skip
    worker, service = served(first)
    try:
        ps = prompts(seed + 1)
        got = last_logits(service, ps).cpu()
        for i, prompt in enumerate(ps):
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0, -1]
            err = relative_error(got[i], want)
            print(f"{family}: K-quant experts, prompt {i} logits relative error {err:.2e}")
            assert err < BOUNDS[("float32", "bf16")]
        for prompt, tokens in zip(ps, greedy_together(service, ps, 16)):
            reference_greedy_check(reference, prompt, tokens)
    finally:
        service.close()
        worker.close()


def test_bf16_gguf_serves_the_tokens_of_its_safetensors_checkpoint(tmp_path, seed):
    """The checkpoint's own bf16 weights as a GGUF (F32 norms): the same model, so the same
    logits and greedy tokens as serving the Hugging Face directory."""
    checkpoint = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=seed)
    first, _ = write_gguf(checkpoint, tmp_path / "mixtral.gguf", float_types)
    ps = prompts(seed + 2)
    results = []
    for path in (checkpoint, first):
        worker, service = served(path)
        try:
            results.append((last_logits(service, ps).cpu(), greedy_together(service, ps, 24)))
        finally:
            service.close()
            worker.close()
    (logits_st, tokens_st), (logits_gguf, tokens_gguf) = results
    assert torch.equal(logits_gguf, logits_st)
    assert tokens_gguf == tokens_st
