"""The plan of real models' published configs (tests/fixtures/configs): the GPU part's and the
routed experts' parameters against counts written out here from each architecture, tensor by
tensor (not by calling the code under test), to 0.1%; the totals the model cards publish; the
KV bytes per token; the decode bound; what fits and what is suggested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_service.plan.decode import distinct_experts
from gpu_service.plan.memory import PlanInputs
from gpu_service.plan.model_plan import make_plan, read_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
GIB = 2**30


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def mla_counts(c: dict) -> tuple[int, int]:
    """(GPU part, routed experts) of a DeepSeek-V3 layout (Kimi-K2 is one)."""
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    q_lora, rank, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    attention = (
        h * q_lora + q_lora  # q_a_proj, q_a_layernorm
        + q_lora * heads * (nope + rope)  # q_b_proj
        + h * (rank + rope) + rank  # kv_a_proj_with_mqa, kv_a_layernorm
        + rank * heads * (nope + v)  # kv_b_proj
        + heads * v * h  # o_proj
        + 2 * h  # input and post-attention norms
    )  # fmt: skip
    layers_dense, dense = c["first_k_dense_replace"], 3 * h * c["intermediate_size"]
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    moe_gpu = experts * h + experts + 3 * h * inter * c["n_shared_experts"]  # router, bias, shared
    moe_layers = layers - layers_dense
    gpu = layers * attention + layers_dense * dense + moe_layers * moe_gpu
    gpu += 2 * c["vocab_size"] * h + h  # embedding, head, final norm
    return gpu, moe_layers * experts * 3 * h * inter


def glm_counts(c: dict) -> tuple[int, int]:
    h, heads, kv, d = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                       c["head_dim"])  # fmt: skip
    layers, dense_layers = c["num_hidden_layers"], c["first_k_dense_replace"]
    attention = (
        h * heads * d + heads * d  # q_proj and its bias
        + 2 * (h * kv * d + kv * d)  # k_proj, v_proj and their biases
        + heads * d * h  # o_proj
        + 2 * d  # q_norm, k_norm
        + 2 * h
    )  # fmt: skip
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    moe_gpu = experts * h + experts + 3 * h * inter * c["n_shared_experts"]
    moe_layers = layers - dense_layers  # NOTE: the MTP layer (num_nextn_predict_layers) unloaded
    gpu = layers * attention + dense_layers * 3 * h * c["intermediate_size"] + moe_layers * moe_gpu
    gpu += 2 * c["vocab_size"] * h + h
    return gpu, moe_layers * experts * 3 * h * inter


def qwen3_counts(c: dict) -> tuple[int, int]:
    h, heads, kv, d = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                       c["head_dim"])  # fmt: skip
    layers, experts, inter = c["num_hidden_layers"], c["num_experts"], c["moe_intermediate_size"]
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d + 2 * h
    gpu = layers * (attention + experts * h) + 2 * c["vocab_size"] * h + h
    return gpu, layers * experts * 3 * h * inter


# name -> (the counts written out, the total parameters its model card publishes, or None)
MODELS = {
    "DeepSeek-V3": (mla_counts, 671e9),
    "Kimi-K2": (mla_counts, None),
    "GLM-4.5": (glm_counts, 355e9),  # NOTE: with its MTP layer (about 2.6 B), which we leave out
    "Qwen3-235B-A22B": (qwen3_counts, 235e9),
}
# KV bytes per token, bf16: MLA one latent (512 + 64) a layer; GQA a key and a value a layer
KV_BYTES = {
    "DeepSeek-V3": 61 * (512 + 64) * 2,
    "Kimi-K2": 61 * (512 + 64) * 2,
    "GLM-4.5": 92 * 2 * 8 * 128 * 2,
    "Qwen3-235B-A22B": 94 * 2 * 4 * 128 * 2,
}


def plan_of(name: str, **inputs):
    hf = read_model_config(CONFIGS / f"{name}.json")
    return make_plan(hf, PlanInputs(**inputs), dram_gbs=200.0, dram_measured=False)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameter_counts_match_the_architecture_written_out(name):
    counts, published = MODELS[name]
    gpu, routed = counts(config(name))
    plan = plan_of(name)
    print(f"{name}: GPU part {plan.gpu_params} (expected {gpu}), routed {plan.routed_params} "
          f"(expected {routed})")  # fmt: skip
    assert plan.gpu_params == pytest.approx(gpu, rel=1e-3)
    assert plan.routed_params == pytest.approx(routed, rel=1e-3)
    if published is not None:
        assert plan.gpu_params + plan.routed_params == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kv_bytes_per_token_and_the_bf16_weights(name):
    plan = plan_of(name, gpu_memory=80 * GIB)
    assert plan.memory.kv_bytes_per_token == KV_BYTES[name]
    c = config(name)
    bf16 = 2 * MODELS[name][0](c)[0]
    if name != "Qwen3-235B-A22B":  # NOTE: DeepSeek's and GLM's routers stay float32: 2 B more
        moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
        bf16 += 2 * moe_layers * (c["n_routed_experts"] * c["hidden_size"] + c["n_routed_experts"])
    assert plan.memory.gpu_parts["weights"] == pytest.approx(bf16, rel=1e-3)
    fp8 = plan_of(name, gpu_memory=80 * GIB, kv_cache_dtype="fp8")
    assert fp8.memory.kv_bytes_per_token == KV_BYTES[name] // 2


def test_fp8_weights_halve_the_linear_layers_and_int4_experts_take_a_quarter_of_bf16():
    bf16, fp8 = plan_of("DeepSeek-V3"), plan_of("DeepSeek-V3", gpu_weight_format="fp8")
    ratio = fp8.memory.gpu_parts["weights"] / bf16.memory.gpu_parts["weights"]
    print(f"fp8 / bf16 GPU weights: {ratio:.3f}")
    assert 0.5 < ratio < 0.75  # the embedding, head and kv_b_proj stay bf16
    # DeepSeek-V3's H = 7168 and I = 2048 are multiples of 64: no padding
    h, i = 7168, 2048
    assert plan_of("DeepSeek-V3", expert_format="bf16").memory.expert_bytes == 3 * h * i * 2
    int4 = plan_of("DeepSeek-V3", expert_format="int4").memory.expert_bytes
    assert int4 == 3 * h * i // 2 + 3 * h * i // 32 * 2  # packed nibbles, a bf16 scale per 32


def test_decode_bound_is_the_dram_rate_over_the_routed_bytes():
    plan = plan_of("Qwen3-235B-A22B", expert_format="int4")
    one = plan.memory.expert_bytes
    batch1, batch16 = plan.decode
    assert batch1.routed_bytes_per_token == 8 * one * 94
    assert batch1.bound_tok_s == pytest.approx(200e9 / (8 * one * 94))
    touched = 128 * (1 - (1 - 8 / 128) ** 16)
    assert distinct_experts(128, 8, 16) == pytest.approx(touched)
    assert batch16.bound_tok_s == pytest.approx(16 * 200e9 / (touched * one * 94))
    assert batch16.bound_tok_s > batch1.bound_tok_s
    assert batch1.predicted_tok_s == pytest.approx(batch1.share_of_bound * batch1.bound_tok_s)


def test_experts_split_over_workers_add_up_and_ram_is_checked():
    plan = plan_of("Kimi-K2", expert_format="int4", expert_workers=5, ram=256 * GIB)
    per_worker = plan.memory.worker_expert_bytes
    assert len(per_worker) == 5 and sum(per_worker) == 384 * plan.memory.expert_bytes * 60
    assert per_worker[0] == 77 * plan.memory.expert_bytes * 60  # 384 = 4 x 77 + 76
    assert plan.memory.host_fits is False


def test_what_does_not_fit_gets_flags_that_make_it_fit():
    plan = plan_of("Qwen3-235B-A22B", gpu_memory=24 * GIB, ram=192 * GIB)
    print(plan.suggestions)
    assert plan.memory.gpu_fits is False and plan.memory.host_fits is False
    assert "--expert-format int4" in plan.suggestions
    first = plan.suggestions[0].split()
    changes = {"--gpu-weight-format": "gpu_weight_format", "--kv-cache-dtype": "kv_cache_dtype"}
    fixed = {changes[flag]: value for flag, value in zip(first[::2], first[1::2], strict=True)}
    assert plan_of("Qwen3-235B-A22B", gpu_memory=24 * GIB, **fixed).memory.gpu_fits
    roomy = plan_of("Qwen3-235B-A22B", gpu_memory=80 * GIB, ram=512 * GIB)
    assert roomy.memory.gpu_fits and roomy.memory.host_fits and not roomy.suggestions
    assert roomy.memory.largest_context == roomy.model_max_len


def test_the_largest_context_is_what_the_budget_leaves_the_kv_cache():
    plan = plan_of("GLM-4.5", gpu_memory=48 * GIB, gpu_weight_format="fp8", max_model_len=4096)
    mem = plan.memory
    fixed = mem.gpu_total - mem.gpu_parts["kv_cache"]
    assert mem.largest_context == (mem.gpu_budget - fixed) // mem.kv_bytes_per_token
    at_largest = plan_of("GLM-4.5", gpu_memory=48 * GIB, gpu_weight_format="fp8",
                         max_model_len=mem.largest_context)  # fmt: skip
    assert at_largest.memory.gpu_fits
    past = plan_of("GLM-4.5", gpu_memory=48 * GIB, gpu_weight_format="fp8",
                   max_model_len=mem.largest_context + 1)  # fmt: skip
    assert past.memory.gpu_fits is False


def test_one_worker_a_numa_node_is_checked_against_its_node():
    """--numa auto's layout: worker i on node i; the total fits the RAM, one node does not."""
    int8 = plan_of("GLM-4.5", expert_workers=2).memory.worker_expert_bytes
    nodes = (int8[0] + GIB, int8[1] - GIB)
    plan = plan_of("GLM-4.5", expert_workers=2, ram=sum(nodes), node_memory=nodes)
    assert plan.memory.host_fits is True and plan.memory.nodes_fit is False
    assert "--expert-format int4" in plan.suggestions
    roomy = plan_of("GLM-4.5", expert_workers=2, node_memory=(int8[0], int8[1]))
    assert roomy.memory.nodes_fit is True
    assert plan_of("GLM-4.5", expert_workers=3, node_memory=nodes).memory.nodes_fit is None
