"""The Triton RMSNorm and rotary kernels against the torch code they replace on CUDA (the same
float32 steps) and, in float32, against transformers' RMSNorm and rotate_half RoPE.

They run on CUDA; without it, under Triton's interpreter when TRITON_INTERPRET=1 and Triton
imports (CPU tensors), else they are skipped."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_service.layers import fused_ops
from gpu_service.layers.blocks import RMSNorm
from gpu_service.layers.rope import apply_rotary

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


def fused_path(monkeypatch):
    """The kernels for every tensor (on the CPU too, where the interpreter runs them)."""
    monkeypatch.setattr(fused_ops, "supports", lambda *tensors: True)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (7, 576), (3, 72)])
def test_add_rms_norm_matches_the_torch_code(seed, monkeypatch, dtype, shape):
    """The residual add and the norm after it: the sum as the torch code rounds it, and its norm."""
    skip_interpreted_bf16(dtype)
    g = torch.Generator().manual_seed(seed)
    h, delta = ((torch.randn(shape, generator=g) * 3).to(DEVICE, dtype) for _ in range(2))
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE, dtype)
    norm = RMSNorm(weight, 1e-6)
    with monkeypatch.context() as m:
        fused_path(m)
        got_sum, got = norm.add_then_norm(h, delta)
    with monkeypatch.context() as m:
        torch_path(m)
        want_sum, want = norm.add_then_norm(h, delta)
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # one rounding, the same one
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert got.dtype == want.dtype and got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= want.abs().float() * ulp + 1e-6).all()


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


def _by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids, weights) ordered by id: the DeepSeek-V3 router's top-k is unsorted."""
    order = ids.long().argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize(
    ("experts", "k", "renorm", "round_weights", "dtype"),
    [(128, 8, True, False, torch.bfloat16), (60, 4, False, False, torch.float32),
     (8, 2, True, True, torch.bfloat16), (64, 6, True, False, torch.float32)],
)  # fmt: skip
def test_softmax_router_matches_the_torch_code(seed, monkeypatch, experts, k, renorm,
                                               round_weights, dtype):  # fmt: skip
    """Qwen-MoE (128 experts, top 8, renorm), Qwen2-MoE (60, top 4), Mixtral (8, top 2, rounded
    to the model dtype), DeepSeek-V2 greedy: the fused kernel after the gate GEMM."""
    if DEVICE == "cpu" and round_weights:
        pytest.skip("Triton's interpreter casts float32 to bfloat16 by truncation, not rounding")
    from gpu_service.layers.moe import SoftmaxRouter

    g = torch.Generator().manual_seed(seed)
    hidden = 64
    router = SoftmaxRouter((torch.randn(experts, hidden, generator=g) / 8).to(DEVICE, dtype), k,
                           norm_topk_prob=renorm, scaling=1.5,
                           round_to_model_dtype=round_weights)  # fmt: skip
    x = torch.randn(37, hidden, generator=g).to(DEVICE, dtype)
    with monkeypatch.context() as m:
        fused_path(m)
        got_ids, got_w = router(x)
    with monkeypatch.context() as m:
        torch_path(m)
        want_ids, want_w = router(x)
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    # bf16 logits tie often, and torch.topk breaks ties its own way: the chosen experts must
    # have the probabilities torch's have, best first (the kernel: ties to the lower id)
    probs = torch.softmax(torch.nn.functional.linear(x, router.weight), -1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, got_ids.long()), probs.gather(1, want_ids.long()))
    assert all(len(set(row)) == k for row in got_ids.tolist())
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("experts", "groups", "topk_groups", "k"), [(256, 8, 4, 8), (64, 4, 2, 6)])
def test_grouped_sigmoid_router_matches_the_torch_code(seed, monkeypatch, experts, groups,
                                                       topk_groups, k):  # fmt: skip
    """DeepSeek-V3's router (256 experts in 8 groups, the best 4 groups, top 8) and a small one:
    the same experts with the same weights (the torch top-k is unsorted: compared by id)."""
    from gpu_service.layers.moe import GroupedSigmoidRouter

    g = torch.Generator().manual_seed(seed)
    hidden = 96
    router = GroupedSigmoidRouter(
        (torch.randn(experts, hidden, generator=g) / 8).to(DEVICE),
        (torch.randn(experts, generator=g) / 4).to(DEVICE), k, groups, topk_groups,
        norm_topk_prob=True, scaling=2.5,
    )  # fmt: skip
    x = torch.randn(29, hidden, generator=g).to(DEVICE, torch.bfloat16)
    with monkeypatch.context() as m:
        fused_path(m)
        got = _by_id(*router(x))
    with monkeypatch.context() as m:
        torch_path(m)
        want = _by_id(*router(x))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, heads_q, heads_kv, dim", [(1, 32, 4, 128), (5, 8, 2, 64),
                                                            (3, 4, 4, 72)])  # fmt: skip
def test_qk_rope_cache_matches_the_torch_code(seed, monkeypatch, norm, dtype, tokens, heads_q,
                                              heads_kv, dim):  # fmt: skip
    """One kernel for GQA's q/k RMSNorm, RoPE and the cache writes: q, and both whole caches
    (slots not written included), equal the torch code's, q/k/v as views of one projection."""
    skip_interpreted_bf16(dtype)
    from gpu_service.kvcache.tensors import write_cache

    g = torch.Generator().manual_seed(seed)
    width = (heads_q + 2 * heads_kv) * dim
    qkv = (torch.randn(tokens, width, generator=g) * 3).to(DEVICE, dtype)
    q = qkv[:, : heads_q * dim].view(tokens, heads_q, dim)
    k = qkv[:, heads_q * dim : (heads_q + heads_kv) * dim].view(tokens, heads_kv, dim)
    v = qkv[:, (heads_q + heads_kv) * dim :].view(tokens, heads_kv, dim)
    weights = tuple((torch.rand(dim, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    angles = torch.rand(tokens, dim // 2, generator=g) * 6.3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots_count = 4 * tokens + 3
    slots = torch.randperm(slots_count, generator=g)[:tokens].to(DEVICE)
    caches = [torch.randn(slots_count, heads_kv, dim, generator=g).to(DEVICE, dtype)
              for _ in range(2)]  # fmt: skip
    want_caches = [c.clone() for c in caches]
    with monkeypatch.context() as m:
        torch_path(m)
        wq, wk = q, k
        if norm:
            wq, wk = RMSNorm(weights[0], 1e-6)(q), RMSNorm(weights[1], 1e-6)(k)
        want_q = apply_rotary(wq, cos, sin, interleaved=False)
        write_cache(want_caches[0], slots, apply_rotary(wk, cos, sin, interleaved=False))
        write_cache(want_caches[1], slots, v)
    print(f"seed={seed} tokens={tokens} heads {heads_q}/{heads_kv} dim={dim} norm={norm}")
    assert fused_ops.qk_rope_cache_fits(q, k, v, *caches, cos, sin, weights) == (DEVICE == "cuda")
    got_q = fused_ops.qk_rope_cache(q, k, v, *(weights if norm else (None, None)), 1e-6, cos,
                                    sin, caches[0], caches[1], slots)  # fmt: skip
    # the float32 sums differ in order only: after rounding, at most one unit apart
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    for got, want in ((got_q, want_q), (caches[0], want_caches[0]), (caches[1], want_caches[1])):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert ((got.float() - want.float()).abs() <= want.abs().float() * 2 * ulp + 1e-5).all()
    torch.testing.assert_close(caches[1], want_caches[1], rtol=0, atol=0)  # v: a plain copy


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, heads, rank, rope", [(1, 16, 512, 64), (4, 3, 24, 8)])
def test_mla_rope_cache_matches_the_torch_code(seed, monkeypatch, interleaved, dtype, tokens,
                                               heads, rank, rope):  # fmt: skip
    """One kernel for MLA's latent RMSNorm, the RoPE of q's and k's rotary parts and the cache
    write: q's rotary part and the whole cache (slots not written included) equal the torch
    code's, q_rot and kv_a as views of their projections, as DeepSeekV3 slices them."""
    skip_interpreted_bf16(dtype)
    from gpu_service.kvcache.tensors import write_cache

    g = torch.Generator().manual_seed(seed)
    nope = 2 * rope
    q = (torch.randn(tokens, heads, nope + rope, generator=g) * 3).to(DEVICE, dtype)
    q_rot = q[..., nope:]
    qkv_a = (torch.randn(tokens, 40 + rank + rope, generator=g) * 3).to(DEVICE, dtype)
    kv_a = qkv_a[:, 40:]  # q_a's 40 columns first, as the stacked projection gives them
    weight = (torch.rand(rank, generator=g) + 0.5).to(DEVICE, dtype)
    angles = torch.rand(tokens, rope // 2, generator=g) * 6.3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots_count = 4 * tokens + 3
    slots = torch.randperm(slots_count, generator=g)[:tokens].to(DEVICE)
    cache = torch.randn(slots_count, rank + rope, generator=g).to(DEVICE, dtype)
    want_cache = cache.clone()
    with monkeypatch.context() as m:
        torch_path(m)
        c, k_rot = kv_a.split([rank, rope], dim=-1)
        want_q = apply_rotary(q_rot, cos, sin, interleaved)
        k_rot = apply_rotary(k_rot[:, None, :], cos, sin, interleaved)[:, 0]
        write_cache(want_cache, slots, torch.cat((RMSNorm(weight, 1e-6)(c), k_rot), dim=-1))
    print(f"seed={seed} tokens={tokens} heads={heads} rank={rank} rope={rope} {interleaved=}")
    assert fused_ops.mla_rope_cache_fits(q_rot, kv_a, weight, cache, cos, sin) == (DEVICE == "cuda")
    got_q = fused_ops.mla_rope_cache(q_rot, kv_a, weight, 1e-6, cos, sin, cache, slots,
                                     interleaved)  # fmt: skip
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6  # summation order: one unit after rounding
    for got, want in ((got_q, want_q), (cache, want_cache)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert ((got.float() - want.float()).abs() <= want.abs().float() * 2 * ulp + 1e-5).all()
    untouched = torch.ones(slots_count, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(cache[untouched.to(DEVICE)], want_cache[untouched.to(DEVICE)])
