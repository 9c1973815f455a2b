"""Seeded random Hugging Face checkpoints at real model shapes, for the benchmarks.

The weights' values do not change the speed, so they are random (std 0.02, norms 1); every
tensor name, shape and dtype is the real model's, so ktserve and llama.cpp's converter read them
as they read the published checkpoints. Written one layer per safetensors file, from the GPU's
generator when there is one (tens of GB take seconds to make, the disk sets the pace). The
tokenizer is the demo model's (llama.cpp's converter pads the vocabulary to vocab_size).

    python bench/real_checkpoint.py OUT_DIR --shape qwen3|deepseek [--layers N]
                                   [--experts bf16|fp8] [--seed S]

--experts fp8: the routed experts as float8_e4m3fn with 128x128 block scales (the format of the
published DeepSeek-V3 and Qwen3-FP8 checkpoints), everything else bf16. --experts synthetic:
no routed experts on disk, and a marker from which workers make them in memory from the seed
(expert_service/synthetic_experts.py; loading it needs KTSERVE_BENCH_SYNTHETIC_EXPERTS=1): for
shapes whose experts the disk cannot hold (DeepSeek-V3's ~330 GB in int4).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import DEMO_MODEL  # noqa: E402

FP8_BLOCK = 128


@dataclass(frozen=True)
class Shape:
    """One model's geometry (its config.json, less what is the same for every layer)."""

    model_type: str
    hidden: int
    moe_inter: int
    dense_inter: int
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    full_layers: int
    dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek-V3: 3)
    shared_experts: int = 0


SHAPES = {
    "qwen3": Shape("qwen3_moe", hidden=2048, moe_inter=768, dense_inter=6144, experts=128,
                   top_k=8, heads=32, kv_heads=4, head_dim=128, vocab=151936, full_layers=48),
    "deepseek": Shape("deepseek_v3", hidden=7168, moe_inter=2048, dense_inter=18432,
                      experts=256, top_k=8, heads=128, kv_heads=128, head_dim=128, vocab=129280,
                      full_layers=61, dense_layers=3, shared_experts=1),
}  # fmt: skip


def config_json(shape: Shape, layers: int, dense_layers: int, fp8: bool) -> dict:
    common = {
        "model_type": shape.model_type, "hidden_size": shape.hidden,
        "num_hidden_layers": layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "intermediate_size": shape.dense_inter, "moe_intermediate_size": shape.moe_inter,
        "num_experts_per_tok": shape.top_k, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 0, "torch_dtype": "bfloat16",
    }  # fmt: skip
    if shape.model_type == "qwen3_moe":
        common.update({
            "architectures": ["Qwen3MoeForCausalLM"], "num_experts": shape.experts,
            "head_dim": shape.head_dim, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(dense_layers)), "rope_theta": 1000000.0,
            "attention_bias": False,
        })  # fmt: skip
    else:
        common.update({
            "architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": shape.experts,
            "n_shared_experts": shape.shared_experts, "first_k_dense_replace": dense_layers,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8, "topk_group": 4,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "rope_theta": 10000.0, "moe_layer_freq": 1,
        })  # fmt: skip
    if fp8:
        common["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }  # fmt: skip
    return common


class Tensors:
    """Random tensors from one seeded generator, on the GPU when there is one."""

    def __init__(self, seed: int) -> None:
        import torch

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.gen = torch.Generator(self.device).manual_seed(seed)

    def normal(self, *shape: int):
        t = self.torch.randn(*shape, generator=self.gen, device=self.device) * 0.02
        return t.to(self.torch.bfloat16).cpu()

    def ones(self, *shape: int):
        return self.torch.ones(*shape, dtype=self.torch.bfloat16)

    def fp8(self, rows: int, cols: int):
        """(float8_e4m3fn weight, float32 scale_inv [rows/128, cols/128])."""
        torch = self.torch
        w = torch.randn(rows, cols, generator=self.gen, device=self.device) * 0.02
        blocks = w.view(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).view(rows, cols).to(torch.float8_e4m3fn)
        return q.cpu(), scale.contiguous().cpu()


def layer_tensors(t: Tensors, shape: Shape, layer: int, dense: bool, fp8: bool,
                  routed: bool = True) -> dict:  # fmt: skip
    """One layer's tensors; without `routed`, none of its routed experts'."""
    p = f"model.layers.{layer}"
    h = shape.hidden
    out = {f"{p}.input_layernorm.weight": t.ones(h),
           f"{p}.post_attention_layernorm.weight": t.ones(h)}  # fmt: skip
    if shape.model_type == "qwen3_moe":
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        out.update({
            f"{p}.self_attn.q_proj.weight": t.normal(q, h),
            f"{p}.self_attn.k_proj.weight": t.normal(kv, h),
            f"{p}.self_attn.v_proj.weight": t.normal(kv, h),
            f"{p}.self_attn.o_proj.weight": t.normal(h, q),
            f"{p}.self_attn.q_norm.weight": t.ones(shape.head_dim),
            f"{p}.self_attn.k_norm.weight": t.ones(shape.head_dim),
        })  # fmt: skip
    else:
        heads, rope, nope, v = shape.heads, 64, 128, 128
        out.update({
            f"{p}.self_attn.q_a_proj.weight": t.normal(1536, h),
            f"{p}.self_attn.q_a_layernorm.weight": t.ones(1536),
            f"{p}.self_attn.q_b_proj.weight": t.normal(heads * (nope + rope), 1536),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": t.normal(512 + rope, h),
            f"{p}.self_attn.kv_a_layernorm.weight": t.ones(512),
            f"{p}.self_attn.kv_b_proj.weight": t.normal(heads * (nope + v), 512),
            f"{p}.self_attn.o_proj.weight": t.normal(h, heads * v),
        })  # fmt: skip
    if dense:
        i = shape.dense_inter
        out.update({f"{p}.mlp.gate_proj.weight": t.normal(i, h),
                    f"{p}.mlp.up_proj.weight": t.normal(i, h),
                    f"{p}.mlp.down_proj.weight": t.normal(h, i)})  # fmt: skip
        return out
    out[f"{p}.mlp.gate.weight"] = t.normal(shape.experts, h)
    if shape.model_type == "deepseek_v3":
        out[f"{p}.mlp.gate.e_score_correction_bias"] = t.torch.zeros(shape.experts)
        si = shape.moe_inter * shape.shared_experts
        out.update({f"{p}.mlp.shared_experts.gate_proj.weight": t.normal(si, h),
                    f"{p}.mlp.shared_experts.up_proj.weight": t.normal(si, h),
                    f"{p}.mlp.shared_experts.down_proj.weight": t.normal(h, si)})  # fmt: skip
    i = shape.moe_inter
    for e in range(shape.experts if routed else 0):
        for name, rows, cols in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
            key = f"{p}.mlp.experts.{e}.{name}.weight"
            if fp8:
                out[key], out[f"{key}_scale_inv"] = t.fp8(rows, cols)
            else:
                out[key] = t.normal(rows, cols)
    return out


def write(out: Path, shape: Shape, layers: int, experts: str = "bf16", seed: int = 0,
          dense_layers: int | None = None) -> dict:  # fmt: skip
    """Write the checkpoint; returns {"seconds", "bytes", "expert_bytes"}."""
    from safetensors.torch import save_file

    fp8, synthetic = experts == "fp8", experts == "synthetic"
    dense = min(shape.dense_layers, layers - 1) if dense_layers is None else dense_layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json(shape, layers, dense, fp8), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO_MODEL / name).exists():
            shutil.copy(DEMO_MODEL / name, out / name)
    start = time.perf_counter()
    t = Tensors(seed)
    total = expert_bytes = 0
    index: dict[str, str] = {}

    def save(tensors: dict, file: str) -> None:
        nonlocal total
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        index.update(dict.fromkeys(tensors, file))

    save(
        {
            "model.embed_tokens.weight": t.normal(shape.vocab, shape.hidden),
            "model.norm.weight": t.ones(shape.hidden),
            "lm_head.weight": t.normal(shape.vocab, shape.hidden),
        },
        "model-head.safetensors",
    )
    for layer in range(layers):
        tensors = layer_tensors(t, shape, layer, layer < dense, fp8, routed=not synthetic)
        expert_bytes += sum(v.numel() * v.element_size() for k, v in tensors.items()
                            if ".mlp.experts." in k)  # fmt: skip
        save(tensors, f"model-layer-{layer:03d}.safetensors")
        print(f"  layer {layer + 1}/{layers} written ({total / 1e9:.1f} GB, "
              f"{time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}))  # fmt: skip
    if synthetic:
        # NOTE: imported here: it needs the built kernel extension, which the GPU-host scripts
        # build while a bf16 or FP8 checkpoint is written
        from expert_service import synthetic_experts

        synthetic_experts.write_marker(out, seed)
    return {"seconds": time.perf_counter() - start, "bytes": total, "expert_bytes": expert_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3")
    parser.add_argument("--layers", type=int, help="default: the model's")
    parser.add_argument(
        "--experts",
        choices=("bf16", "fp8", "synthetic"),
        default="bf16",
        help="the routed experts' format on disk; synthetic: none on disk, the workers make "
        "them from the seed in memory (benchmarks only; see expert_service/synthetic_experts.py)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dense-layers",
        type=int,
        help="leading dense layers (default: the model's, at most layers - 1)",
    )
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    got = write(args.out, shape, args.layers or shape.full_layers, args.experts, args.seed,
                args.dense_layers)  # fmt: skip
    print(f"wrote {args.out}: {got['bytes'] / 1e9:.1f} GB ({got['expert_bytes'] / 1e9:.1f} GB "
          f"routed experts) in {got['seconds']:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
