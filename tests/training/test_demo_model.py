"""The committed demo model (demo_model/) against transformers: it loads unchanged, its tokenizer
round-trips text and renders the ChatML template, it writes text, it is the DeepSeek-V3 MoE that
training/README.md describes, it fits the size budget, and its held-out perplexity holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from training.perplexity import perplexity_of_ids, transformers_perplexity, windows

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "demo_model"
HELDOUT_SAMPLE = REPO / "training" / "heldout_sample.txt"
MAX_BYTES = 25 * 1000 * 1000
# Measured after training (training/README.md): held-out perplexity of the committed files on
# HELDOUT_SAMPLE with seq_len 512, float32 on CPU, measured 24.60; the bound leaves a ~10% margin.
HELDOUT_PPL_BOUND = 27.0
SEED = 1234


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return m.eval()


def test_config_is_small_deepseek_v3_moe(model: PreTrainedModel) -> None:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["n_routed_experts"], cfg["n_shared_experts"], cfg["num_experts_per_tok"]) == (
        32,
        1,
        4,
    )
    assert (cfg["n_group"], cfg["topk_group"], cfg["first_k_dense_replace"]) == (4, 2, 1)
    assert cfg["q_lora_rank"] and cfg["kv_lora_rank"] and cfg["qk_rope_head_dim"]
    assert cfg["hidden_size"] % 64 == 0 and cfg["moe_intermediate_size"] % 64 == 0
    num_params = sum(p.numel() for p in model.parameters())
    assert 10e6 <= num_params <= 30e6, num_params


def test_checkpoint_layout_and_size() -> None:
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= MAX_BYTES, total
    with safe_open(MODEL_DIR / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.1.mlp.experts.31.down_proj.weight").get_dtype() == "BF16"
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.dtype == torch.float32 and bias.shape == (32,)
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # the dense first layer
    assert "model.layers.4.mlp.shared_experts.up_proj.weight" in keys
    assert not any(".experts.gate_up_proj" in k for k in keys)  # per-expert tensors, HF layout


@pytest.mark.parametrize(
    "text",
    [
        "The Python interpreter reads a line, then evaluates it.",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "unicode — “quotes”, café, 数字, emoji 🐍",
        "def f(x):\n    return x ** 2  # square",
    ],
)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids and tokenizer.decode(ids) == text


def test_chat_template_renders_chatml(tokenizer) -> None:
    messages = [{"role": "user", "content": "What is a list?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1
    assert tokenizer.eos_token == "<|endoftext|>"


def _generate(model, tokenizer, prompt: str, **kwargs) -> str:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=24, pad_token_id=tokenizer.eos_token_id, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_generates_words(model, tokenizer) -> None:
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    greedy = _generate(model, tokenizer, "The Python interpreter", do_sample=False)
    sampled = _generate(model, tokenizer, "A list is", do_sample=True, top_p=0.9, temperature=0.8)
    for text in (greedy, sampled):
        assert sum(c.isalpha() for c in text) >= 10, text


def test_chat_reply_is_words(model, tokenizer) -> None:
    messages = [{"role": "user", "content": "Tell me about the json module."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    reply = _generate(model, tokenizer, prompt, do_sample=False)
    assert sum(c.isalpha() for c in reply) >= 10, reply


def test_windows_are_non_overlapping() -> None:
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]  # a 1-token tail predicts nothing
    assert windows(list(range(8)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        windows([1, 2], 1)


def test_heldout_perplexity_below_measured_bound(model, tokenizer) -> None:
    ppl = transformers_perplexity(MODEL_DIR, HELDOUT_SAMPLE, seq_len=512, max_tokens=16384)
    print(f"held-out perplexity {ppl:.3f} (bound {HELDOUT_PPL_BOUND})")
    assert ppl < HELDOUT_PPL_BOUND
    # The helper is the same computation as on a loaded model (what training reports).
    ids = tokenizer(HELDOUT_SAMPLE.read_text(), add_special_tokens=False)["input_ids"][:16384]
    assert perplexity_of_ids(model, ids, 512) == pytest.approx(ppl, rel=1e-6)


def test_chat_template_is_trainings_and_writes_tools_as_hermes(tokenizer) -> None:
    """The committed template is the one training writes (tokenizer_config.json's copy too), and
    it renders tools and tool calls in the Hermes format ktserve reads (`make serve` shows it)."""
    from training.train_tokenizer import CHAT_TEMPLATE

    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert (MODEL_DIR / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert config["chat_template"] == CHAT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>" in text
