"""The Triton RMSNorm and rotary kernels against the torch code they replace on CUDA (the same
float32 steps) and, in float32, against transformers' RMSNorm and rotate_half RoPE.

They run on CUDA; without it, under Triton's interpreter when TRITON_INTERPRET=1 and Triton
imports (CPU tensors), else they are skipped."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_service.models import fused_ops
from gpu_service.models.layers import RMSNorm
from gpu_service.models.rope import apply_rotary

if torch.cuda.is_available() and fused_ops.triton is not None:
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1" and fused_ops.triton is not None:
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="needs CUDA with Triton, or TRITON_INTERPRET=1 with Triton installed"
)


def skip_interpreted_bf16(dtype: torch.dtype) -> None:
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter casts float32 to bfloat16 by truncation, not rounding")


def torch_path(monkeypatch):
    monkeypatch.setattr(fused_ops, "supports", lambda *tensors: False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (7, 4, 128), (33, 576), (3, 5, 72)])
def test_rms_norm_matches_the_torch_code(seed, monkeypatch, dtype, shape):
    skip_interpreted_bf16(dtype)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE, dtype)
    norm = RMSNorm(weight, 1e-6)
    got = fused_ops.rms_norm(x, weight, 1e-6)
    with monkeypatch.context() as m:
        torch_path(m)
        want = norm(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the float32 sums differ in order only: after rounding, at most one unit apart
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert ((got.float() - want.float()).abs() <= want.abs().float() * ulp + 1e-6).all()
    if dtype == torch.float32:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

        oracle = Qwen3MoeRMSNorm(shape[-1], eps=1e-6).to(DEVICE)
        oracle.weight.data.copy_(weight)
        torch.testing.assert_close(got, oracle(x), rtol=1e-5, atol=1e-6)


def test_rms_norm_of_a_strided_view(seed):
    """q/k norms run on views of a projection's output: rows evenly spaced, unit last stride."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 3, 2 * 64, generator=g).to(DEVICE)
    x = base[:, :, :64]  # [6, 3, 64], not contiguous
    weight = torch.rand(64, generator=g).to(DEVICE)
    got = fused_ops.rms_norm(x, weight, 1e-5)
    xf = x.double()
    ref = weight.double() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 32, 128), (9, 4, 64), (5, 128, 64)])
def test_rotary_matches_the_torch_code(seed, monkeypatch, interleaved, dtype, tokens, heads, dim):
    skip_interpreted_bf16(dtype)
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, heads, dim + 32, generator=g).to(DEVICE, dtype)
    x = wide[..., 32:]  # MLA ropes the tail of each head: a strided view
    angles = torch.rand(tokens, dim // 2, generator=g) * 40
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    got = fused_ops.rotary(x, cos, sin, interleaved)
    with monkeypatch.context() as m:
        torch_path(m)
        want = apply_rotary(x, cos, sin, interleaved)
    assert got.shape == want.shape and got.dtype == want.dtype
    # the same float32 products and sums: equal, but for the compiler's fused multiply-adds
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert ((got.float() - want.float()).abs() <= want.abs().float() * ulp + 1e-6).all()
    if dtype == torch.float32 and not interleaved:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import rotate_half

        c, s = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
        torch.testing.assert_close(got, x * c + rotate_half(x) * s, rtol=1e-5, atol=1e-5)
