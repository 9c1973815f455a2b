"""The default context: the model's own maximum (YaRN's extension included, as the model cards
state it), bounded by the KV cache; and the KV cache's storage dtype."""

from __future__ import annotations

import pytest
import torch

from gpu_service.config import GPUServiceConfig
from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.models.config import model_max_len
from gpu_service.service import context_length, kv_cache_dtype
from ktserve.checkpoint import HFConfig

DEEPSEEK_V3 = {  # the released config.json's fields that matter here
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },  # fmt: skip
}
QWEN3_YARN = {  # Qwen3's model card: YaRN factor 4 over 32,768 native tokens = 131,072
    "max_position_embeddings": 40960,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}


@pytest.mark.parametrize(
    "data, expected",
    [
        (DEEPSEEK_V3, 163840),
        (QWEN3_YARN, 131072),
        ({"max_position_embeddings": 40960}, 40960),  # Qwen3 as released: no rope_scaling
        (
            {
                "max_position_embeddings": 2048,
                "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
            },
            2048,
        ),  # fmt: skip
        (
            {
                "max_position_embeddings": 8192,  # transformers 5's key, original at the top level
                "original_max_position_embeddings": 1024,
                "rope_parameters": {"rope_type": "yarn", "factor": 16.0},
            },
            16384,
        ),  # fmt: skip
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 4096),
    ],
)
def test_model_max_len(data, expected) -> None:
    assert model_max_len(HFConfig(data, "config.json")) == expected


def test_context_is_bounded_by_the_kv_cache() -> None:
    assert context_length(None, 163840, 50000) == 50000
    assert context_length(None, 2048, 32768) == 2048
    assert context_length(1000, 2048, 32768) == 1000
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        context_length(40000, 163840, 32768)


def test_kv_cache_dtype() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        GPUServiceConfig(model_dir="unused", kv_cache_dtype="fp16")


def test_fp8_cache_takes_one_byte_per_element() -> None:
    config = KVCacheConfig(3, ((4, 8), (4, 8)), 64)
    assert config.bytes_per_token(torch.float8_e4m3fn) == 3 * 2 * 4 * 8
    assert config.bytes_per_token(torch.bfloat16) == 2 * config.bytes_per_token(torch.float8_e4m3fn)
