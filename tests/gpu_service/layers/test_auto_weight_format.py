"""--gpu-weight-format auto: the GPU part's size read from the safetensors headers (against
transformers' parameter count), and the bf16 / fp8 choice from it."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gpu_service.layers.auto_weight_format import BF16_MAX_SHARE, choose_auto_format
from ktserve.checkpoint import InvalidConfig, ModelSpec, SafetensorsNotFound, non_expert_params
from tests.support.checkpoints import (
    available_families,
    make_tiny_checkpoint,
    quantize_fp8_blocks,
)

GIB = 2**30
SEED = 5150
PROJECTION = re.compile(r"^model\.layers\.\d+\.self_attn\.\w+_proj\.weight$")


@pytest.mark.parametrize("family", available_families())
def test_non_expert_params_is_transformers_count_less_the_experts(tmp_path, family) -> None:
    print(f"seed {SEED}")
    path = make_tiny_checkpoint(family, tmp_path / family, seed=SEED)
    spec = ModelSpec.from_checkpoint(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    experts = len(spec.moe_layers) * spec.num_experts * spec.expert_num_params
    # the state dict: parameters and persistent buffers (DeepSeek-V3's e_score_correction_bias)
    stored = sum(t.numel() for t in model.state_dict().values())
    assert not model.config.tie_word_embeddings
    assert non_expert_params(path) == stored - experts


@pytest.mark.skipif("deepseek_v3" not in available_families(), reason="no DeepseekV3Config")
def test_non_expert_params_leaves_fp8_scales_out(tmp_path) -> None:
    """The count stays when the projections become FP8 with block scales (DeepSeek-V3's own
    checkpoint: each weight an element a byte, `<name>_scale_inv` beside it)."""
    print(f"seed {SEED}")
    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "fp8", seed=SEED, fp8=True)
    before = non_expert_params(path)
    scales = 0
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        for name in [n for n in tensors if PROJECTION.match(n)]:
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(tensors[name])
            scales += 1
        save_file(tensors, file, metadata={"format": "pt"})
    assert scales > 0
    assert non_expert_params(path) == before


def test_headers_of_a_directory_without_safetensors(tmp_path) -> None:
    with pytest.raises(SafetensorsNotFound):
        non_expert_params(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(InvalidConfig, match="header length"):
        non_expert_params(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{nope")
    with pytest.raises(InvalidConfig, match="unreadable"):
        non_expert_params(tmp_path)


@pytest.mark.parametrize(
    ("part_gib", "budget_gib", "fp8_units", "want"),
    [
        (17.0, 126.0, True, "bf16"),  # Qwen3-30B-A3B-size GPU part on an H200: fits
        (34.0, 126.0, True, "bf16"),  # DeepSeek-V3's on an H200
        (34.0, 21.6, True, "fp8"),  # DeepSeek-V3's on a 24 GB card
        (34.0, 21.6, False, "bf16"),  # ... without FP8 units: nothing to gain from fp8
        (10.0, 20.0, True, "bf16"),  # exactly the share
        (10.01, 20.0, True, "fp8"),  # just over it
    ],
)
def test_auto_keeps_bf16_where_it_fits(part_gib, budget_gib, fp8_units, want) -> None:
    assert BF16_MAX_SHARE == 0.5  # the cases' boundary
    choice = choose_auto_format(int(part_gib * GIB), int(budget_gib * GIB), fp8_units)
    assert choice.format == want
    assert f"{part_gib:.1f} GiB" in choice.reason


def test_auto_off_cuda_is_bf16() -> None:
    assert choose_auto_format(100 * GIB, None, True).format == "bf16"


@pytest.mark.skipif("qwen3_moe" not in available_families(), reason="no Qwen3MoeConfig")
def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path) -> None:
    """Shards listed in model.safetensors.index.json count; a stray file beside them does not
    (the loaders read the index's files only)."""
    print(f"seed {SEED}")
    whole = make_tiny_checkpoint("qwen3_moe", tmp_path / "whole", seed=SEED)
    sharded = make_tiny_checkpoint("qwen3_moe", tmp_path / "sharded", seed=SEED,
                                   max_shard_size="20KB")  # fmt: skip
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    assert non_expert_params(sharded) == non_expert_params(whole)
    save_file({"stray.weight": torch.zeros(1000)}, sharded / "stray.safetensors")
    assert non_expert_params(sharded) == non_expert_params(whole)
