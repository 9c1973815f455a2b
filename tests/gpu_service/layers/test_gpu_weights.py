"""The GPU part's weight formats (fp8, int8, int4): every format's linear module against a float64
x @ W^T of its dequantized weight (the kernels compute exactly that, up to their rounding) and
against the original weight (within the format's error); tiny checkpoints of each family load,
match transformers within the format's error and generate; the memory plan and its gauges.
CUDA cases run on the GPU host and skip here. Every test prints its seed and errors."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from prometheus_client import generate_latest
from safetensors.torch import load_file, save_file

from gpu_service.config import GPUServiceConfig
from gpu_service.engine import EngineMetrics
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.layers.linear import (
    FP8Linear,
    Int4Linear,
    Int8Linear,
    Linear,
    fp8_scaled_mm,
    make_linear,
)
from gpu_service.layers.weight_formats import (
    LinearQuantConfig,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    int4_group_size,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from gpu_service.memory_plan import PARTS, cpu_plan, cuda_plan, profile_lengths, weight_bytes
from gpu_service.models import Batch, SeqInput, TorchExperts, load_model
from gpu_service.service import resolve_linear_quant
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoints import (
    available_families,
    dequantize_fp8_reference,
    load_reference_model,
    make_tiny_checkpoint,
    quantize_fp8_blocks,
)
from tests.support.gpu_weights import LOGITS_TOL, MODULES

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA"))]
FORMATS = ("fp8", "int8", "int4")
# (N outputs, K inputs): kernel shapes (multiples of 16 / 128) and the odd ones the tiny and demo
# models have, which take the fallbacks (int4 groups < 32, N not a multiple of 16).
SHAPES = [(256, 512), (384, 96), (80, 256), (36, 72), (101, 48)]
# Norm-relative error of y against x @ W^T with the original W (Gaussian weights): the weight's
# own quantization error, measured 2.4e-2 (fp8), 5.8e-3 (int8), 5.2e-2..9.5e-2 (int4, groups of
# 128 .. 4); bounds leave twice that.
ORIGINAL_TOL = {"fp8": 0.05, "int8": 0.012, "int4": 0.2}
# Against the dequantized weight: float32 accumulation on the CPU; on CUDA bfloat16 activations
# and output, and for fp8 the activations' own e4m3 quantization (~2.5e-2).
DEQUANT_TOL = {"cpu": 1e-5, "cuda": 1e-2, "cuda-fp8": 0.05}


def _norm_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _dequantized(fmt: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference dequantization of w in format fmt, from weight_formats.py alone."""
    if fmt == "fp8":
        return dequantize_fp8(*quantize_fp8(w))
    if fmt == "int8":
        return dequantize_int8(*quantize_int8(w, dtype))
    scale_dtype = torch.bfloat16 if w.device.type == "cuda" else dtype
    return dequantize_int4(quantize_int4(w, scale_dtype))


def _expected_kernel(fmt: str, device: str) -> str:
    if device == "cpu":
        return {"fp8": "upcast", "int8": "int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}[fmt]
    fp8_units = torch.cuda.get_device_capability() >= (8, 9)
    triton = importlib.util.find_spec("triton") is not None
    fp8 = "weight_only+scaled_mm" if triton else "scaled_mm"
    kernels = {"fp8": fp8 if fp8_units else "upcast",
               "int8": "triton" if triton else "dequantize",
               "int4": "_weight_int4pack_mm"}  # fmt: skip
    return kernels[fmt]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_matches_dequantized_weight(device: str, fmt: str, shape: tuple[int, int]) -> None:
    seed = 7 + SHAPES.index(shape)
    gen = torch.Generator().manual_seed(seed)
    n, k = shape
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
    bias = (torch.randn(n, generator=gen) * 0.01).to(device, dtype)
    module = make_linear(w, bias, fmt, dtype)
    assert isinstance(module, MODULES[fmt])
    deq = _dequantized(fmt, w, dtype).double()
    tol = DEQUANT_TOL["cuda-fp8" if device == "cuda" and fmt == "fp8" else device]
    if shape == (256, 512):  # kernel shapes: the maintained kernel runs, not a fallback
        assert module.kernel_name == _expected_kernel(fmt, device), module.kernel_name
    for m in (1, 5, 33, 200):
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        y = module(x)
        assert y.shape == (m, n) and y.dtype == dtype
        exact = x.double() @ deq.T + bias.double()
        original = x.double() @ w.double().T + bias.double()
        err_deq, err_orig = _norm_err(y, exact), _norm_err(y, original)
        kernel = module.kernel_name
        print(f"[{fmt} {device} {n}x{k} M={m}] seed={seed} kernel={kernel} "
              f"vs dequantized {err_deq:.2e}, vs original {err_orig:.2e}")  # fmt: skip
        assert err_deq < tol
        assert err_orig < ORIGINAL_TOL[fmt]
    x3 = torch.randn(2, 3, k, generator=gen).to(device, dtype)  # leading dims pass through
    torch.testing.assert_close(module(x3), module(x3.view(6, k)).view(2, 3, n))


def test_fp8_scaled_mm_math_on_cpu() -> None:
    """The _scaled_mm call the CUDA path makes (per-row e4m3 activations, column-major weight,
    row and column scales) run by torch's CPU _scaled_mm, against float64 of the dequantized
    weight: the layouts and scales agree, the error is the activations' quantization."""
    seed = 17
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(128, 256, generator=gen) * 0.02
    x = torch.randn(9, 256, generator=gen).bfloat16()
    q, scale = quantize_fp8(w)
    try:
        y = fp8_scaled_mm(x, q, scale)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch has no CPU _scaled_mm for these operands: {exc}")
    err = _norm_err(y, x.double() @ dequantize_fp8(q, scale).double().T)
    print(f"seed={seed} fp8 _scaled_mm (CPU) vs dequantized weight: {err:.2e}")
    assert y.dtype == torch.bfloat16 and err < DEQUANT_TOL["cuda-fp8"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rounds_back(fmt: str) -> None:
    """Quantizing a weight that is already on the format's grid changes nothing."""
    seed = 21
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=gen)
    once = _dequantized(fmt, w, torch.float32)
    twice = _dequantized(fmt, once, torch.float32)
    err = _norm_err(twice, once.double())
    print(f"[{fmt}] seed={seed} requantized grid error {err:.2e}")
    assert err < 1e-6


def test_int4_layout() -> None:
    """Two values per byte, even input in the high nibble; groups of 128 or a smaller power of 2."""
    assert [int4_group_size(k) for k in (7168, 1536, 96, 72, 36)] == [128, 128, 32, 8, 4]
    w = torch.tensor([[float(v) for v in range(-8, 8)] * 8], dtype=torch.float32)  # [1, 128]
    packed = quantize_int4(w, torch.float32)
    assert packed.packed.shape == (1, 64) and packed.packed.dtype == torch.uint8
    assert packed.unpacked()[0, :16].tolist() == list(range(16))
    assert packed.packed[0, 0].item() == (0 << 4 | 1) and packed.packed[0, 1].item() == (2 << 4 | 3)
    torch.testing.assert_close(dequantize_int4(packed), w, rtol=0, atol=1e-6)


def test_fp8_block_checkpoint_requantized_per_channel() -> None:
    """DeepSeek-V3's 128x128-block FP8 weights, requantized per output channel for _scaled_mm
    (fp8 on a FP8 checkpoint): the error that adds, measured against the block-dequantized
    weight the checkpoint means."""
    seed = 31
    gen = torch.Generator().manual_seed(seed)
    # rows of different scale per 128-block, as trained weights have
    blocks = torch.rand(4, 1, 8, 1, generator=gen).add(0.1)
    w = (torch.randn(4, 128, 8, 128, generator=gen) * blocks).reshape(512, 1024) * 0.02
    block_q, block_scale = quantize_fp8_blocks(w)
    checkpoint = dequantize_fp8_reference(block_q, block_scale)
    requantized = dequantize_fp8(*quantize_fp8(checkpoint))
    err = _norm_err(requantized, checkpoint.double())
    block_err = _norm_err(checkpoint, w.double())
    print(f"seed={seed} per-channel requantization error {err:.2e} (the block quantization's own "
          f"{block_err:.2e})")  # fmt: skip
    assert err < 0.05


# --- tiny models per format ------------------------------------------------------------------

FAMILIES = [f for f in ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral")
            if f in available_families()]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("gpuweights")
    built: dict = {}

    class Lazy(dict):
        def __missing__(self, family: str):
            seed = 4000 + FAMILIES.index(family)
            path = make_tiny_checkpoint(family, root / family, seed=seed)
            print(f"[{family}] checkpoint seed={seed}")
            built[family] = self[family] = (path, seed, load_reference_model(path))
            return self[family]

    return Lazy()


def _load(path, fmt: str, device: str = "cpu", quantize_lm_head: bool = False):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    experts = TorchExperts(CheckpointReader(path), device, torch.float32)
    return load_model(path, device, dtype, experts=experts, max_num_tokens_in_cache=256,
                      linear_quant=LinearQuantConfig(fmt, quantize_lm_head))  # fmt: skip


def _linears(model: torch.nn.Module) -> dict[str, type]:
    kinds = (Linear, FP8Linear, Int8Linear, Int4Linear)
    return {name: type(m) for name, m in model.named_modules() if isinstance(m, kinds)}


@pytest.mark.parametrize("fmt", ("bf16", *FORMATS))
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_per_format(tiny: dict, family: str, fmt: str) -> None:
    path, seed, reference = tiny[family]
    model = _load(path, fmt)
    linears = _linears(model)
    want = Linear if fmt == "bf16" else MODULES[fmt]
    projections = {
        n: t for n, t in linears.items() if n != "lm_head" and not n.endswith("shared_gate")
    }
    assert projections and set(projections.values()) == {want}, linears
    assert linears["lm_head"] is Linear  # the head stays in the model dtype by default
    assert all(t is Linear for n, t in linears.items() if n.endswith("shared_gate"))
    prompt = torch.randint(0, 101, (11,), generator=torch.Generator().manual_seed(seed)).tolist()
    kv = KVCacheManager(model.kv_cache.config)
    cache = kv.allocate(len(prompt))
    logits = model.forward(Batch((SeqInput(prompt, cache, 0),)), all_positions=True)
    with torch.no_grad():
        ref = reference(torch.tensor([prompt])).logits[0].double()
    err = _norm_err(logits, ref)
    tokens = []
    for _ in range(6):  # greedy decode, one token a step
        tokens.append(int(logits[-1].argmax()))
        pos = cache.num_tokens
        kv.extend(cache, pos + 1)
        logits = model.forward(Batch((SeqInput([tokens[-1]], cache, pos),)))
    kv.free(cache)
    print(f"[{family} {fmt}] seed={seed} logits error vs transformers {err:.2e}, greedy {tokens}")
    assert err < LOGITS_TOL[fmt]
    assert all(0 <= t < 101 for t in tokens)


@pytest.mark.skipif("deepseek_v3" not in available_families(), reason="no DeepseekV3Config")
def test_quantize_lm_head_and_weight_bytes(tiny: dict) -> None:
    path, _, _ = tiny["deepseek_v3"]
    dense, quantized = _load(path, "bf16"), _load(path, "int8", quantize_lm_head=True)
    assert type(quantized.lm_head) is Int8Linear
    assert weight_bytes(quantized) < weight_bytes(dense)
    linear_bytes = sum(b.nbytes for n, b in dense.named_buffers() if n.endswith("_proj.weight"))
    saved = weight_bytes(dense) - weight_bytes(quantized)
    print(f"dense {weight_bytes(dense)} B, int8 {weight_bytes(quantized)} B, "
          f"projections {linear_bytes} B")  # fmt: skip
    assert saved >= 0.7 * linear_bytes  # float32 -> int8 (+ a scale per row)


_FP8_NON_EXPERT = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.\w+_proj|mlp\.(shared_experts\.)?\w+_proj)\.weight$"
)


@pytest.mark.skipif("deepseek_v3" not in available_families(), reason="no DeepseekV3Config")
def test_fp8_checkpoint_kept_in_fp8(tmp_path) -> None:
    """A DeepSeek-V3-style checkpoint whose projections are 128x128-block FP8: auto keeps the
    tiny GPU part in bf16 (it fits: test_auto_weight_format.py has the choice), and fp8
    requantizes each projection per output channel within fp8's error of the block-dequantized
    weight (what transformers and the bf16 format compute with)."""
    seed = 4100
    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "fp8", seed=seed, fp8=True)
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        for name in [n for n in tensors if _FP8_NON_EXPERT.match(n)]:
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(tensors[name])
        save_file(tensors, file, metadata={"format": "pt"})
    config = GPUServiceConfig(str(path))
    assert resolve_linear_quant(config, torch.device("cpu"))[0].format == "bf16"
    assert resolve_linear_quant(config, torch.device("cpu"))[1] == "not a CUDA device"
    if HAS_CUDA:
        assert resolve_linear_quant(config, torch.device("cuda"))[0].format == "bf16"
    explicit = GPUServiceConfig(str(path), gpu_weight_format="int4", quantize_lm_head=True)
    assert resolve_linear_quant(explicit, torch.device("cpu")) == (
        LinearQuantConfig("int4", True),
        "",
    )
    dense, fp8 = _load(path, "bf16"), _load(path, "fp8")
    modules = dict(dense.named_modules())
    weight_errors = {
        name: _norm_err(dequantize_fp8(m.weight, m.weight_scale), modules[name].weight.double())
        for name, m in fp8.named_modules()
        if isinstance(m, FP8Linear)
    }
    assert len(weight_errors) >= 7 * 2  # every projection of both layers
    reference = load_reference_model(path)
    prompt = torch.randint(0, 101, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        ref = reference(torch.tensor([prompt])).logits[0].double()
    logits_errors = {}
    for fmt, model in (("bf16", dense), ("fp8", fp8)):
        cache = KVCacheManager(model.kv_cache.config).allocate(len(prompt))
        logits = model.forward(Batch((SeqInput(prompt, cache, 0),)), all_positions=True)
        logits_errors[fmt] = _norm_err(logits, ref)
    print(f"seed={seed} FP8 checkpoint requantized per channel: weight errors up to "
          f"{max(weight_errors.values()):.2e}; logits vs transformers {logits_errors}")  # fmt: skip
    # NOTE: the weights are the check: this model's logits move by 0.04 .. 0.17 under fp8
    # (and int8 up to 0.18) where a token's top-k routing sits on a near-tie and flips
    assert max(weight_errors.values()) < 0.04
    assert logits_errors["bf16"] < 1e-4 and logits_errors["fp8"] < 0.3


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="--gpu-weight-format"):
        GPUServiceConfig("m", gpu_weight_format="int3")
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        GPUServiceConfig("m", gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        GPUServiceConfig("m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="--quantize-lm-head"):
        GPUServiceConfig("m", gpu_weight_format="bf16", quantize_lm_head=True)
    with pytest.raises(ValueError, match="GPU weight format"):
        LinearQuantConfig("fp4")


# --- the memory plan -------------------------------------------------------------------------


def test_profile_lengths() -> None:
    assert profile_lengths(2048, 8192, 64) == [2048]
    assert profile_lengths(2048, 512, 64) == [512] * 4
    assert profile_lengths(2048, 600, 64) == [600, 600, 600, 248]
    assert profile_lengths(2048, 64, 3) == [64] * 3  # the step holds at most max_num_seqs
    assert profile_lengths(100, None, 1) == [100]


@pytest.mark.skipif("deepseek_v3" not in available_families(), reason="no DeepseekV3Config")
def test_cpu_plan_and_gauges(tiny: dict) -> None:
    path, _, _ = tiny["deepseek_v3"]
    model = _load(path, "int4")
    plan = cpu_plan(model, 4096, torch.float32)
    per_token = model.kv_cache.config.bytes_per_token(torch.float32)
    assert plan.parts == {"weights": weight_bytes(model), "kv_cache": 4096 * per_token}
    table = plan.table()
    print(table)
    assert "4096 tokens" in table and "n/a" in table
    metrics = EngineMetrics()
    metrics.observe_memory_plan(plan)
    text = generate_latest(metrics.registry).decode()
    assert f'ktserve_gpu_memory_plan_bytes{{part="weights"}} {float(weight_bytes(model))}' in text
    assert "ktserve_kv_cache_capacity_tokens 4096.0" in text
    assert 'part="activations"' not in text  # not measured off CUDA: no sample


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA: the plan measures on the GPU host")
@pytest.mark.skipif("deepseek_v3" not in available_families(), reason="no DeepseekV3Config")
def test_cuda_plan_fits_budget(tiny: dict) -> None:
    """The parts add up to the budget, and a cache of the planned size plus a forward of
    max_num_batched_tokens tokens stays inside it."""
    path, _, _ = tiny["deepseek_v3"]
    model = _load(path, "fp8", "cuda")
    # a budget 2 GiB past what the device already holds (this process's earlier tests, others)
    free, total = torch.cuda.mem_get_info()
    utilization, batched = min(1.0, (total - free + 2 * 2**30) / total), 512
    plan = cuda_plan(model, torch.bfloat16, utilization, batched, 8)
    print(plan.table())
    assert set(plan.parts) == set(PARTS) and sum(plan.parts.values()) == plan.budget
    assert plan.parts["activations"] > 0 and plan.parts["headroom"] > 0
    assert plan.parts["weights"] == weight_bytes(model)
    from dataclasses import replace

    from gpu_service.models import KVCacheTensors

    config = replace(model.kv_cache.config, max_num_tokens=plan.kv_cache_tokens)
    model.kv_cache = KVCacheTensors(config, torch.bfloat16, "cuda")
    torch.cuda.reset_peak_memory_stats()
    cache = KVCacheManager(config).allocate(batched)
    model.forward(Batch((SeqInput([3] * batched, cache, 0),)))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() + plan.parts["non_torch"]
    print(f"peak {peak / 2**30:.3f} GiB of a {plan.budget / 2**30:.3f} GiB budget")
    assert peak <= plan.budget


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA: the plan measures on the GPU host")
@pytest.mark.skipif("deepseek_v3" not in available_families(), reason="no DeepseekV3Config")
def test_cuda_plan_counts_what_the_process_holds_and_collects_its_garbage(tiny: dict) -> None:
    """Tensors this process holds beside the model (an earlier service still alive) are the
    plan's `other` and come out of the KV cache; unreachable ones in a reference cycle (a closed
    service) are collected before the plan measures."""
    path, _, _ = tiny["deepseek_v3"]
    model = _load(path, "bf16", "cuda")
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free + 4 * 2**30) / total)
    base = cuda_plan(model, torch.bfloat16, utilization, 256, 4)
    held = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    holding = cuda_plan(model, torch.bfloat16, utilization, 256, 4)
    assert holding.parts["other"] - base.parts["other"] >= held.numel()
    per_token = model.kv_cache.config.bytes_per_token(torch.bfloat16)
    assert base.kv_cache_tokens - holding.kv_cache_tokens >= held.numel() // per_token - 1
    cycle: list = [held]
    cycle.append(cycle)
    del held, cycle  # garbage now, freed only by the collector
    after = cuda_plan(model, torch.bfloat16, utilization, 256, 4)
    assert after.parts["other"] < base.parts["other"] + 2**30
    assert sum(after.parts.values()) == after.budget
