"""Attention cases (random queries, paged caches) and their check against the float64
reference, shared by the kernels' tests."""

from __future__ import annotations

import torch

# bf16 / fp16: the probabilities are rounded to the query's dtype before p @ v, as in attend();
# for outputs up to 1 in size: rounding errors grow with the values (check scales them)
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def make_case(gen, kv_lens, block_size, num_kv_heads, head_dim, v_dim, cache_dtype, mla=False):
    """A cache with every slot random (a wrong slot read shows), blocks handed out in shuffled
    order, and block-table rows wider than needed, padded with blocks of other sequences."""
    blocks_per_seq = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + 3
    width = max(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = order[torch.randint(num_blocks, (len(kv_lens), width), generator=gen)]
    used = 0
    for i, count in enumerate(blocks_per_seq):
        table[i, :count] = order[used : used + count]
        used += count
    slots = num_blocks * block_size
    if mla:  # one latent: v is the first v_dim columns of the same rows
        k_cache = torch.randn(slots, 1, head_dim, generator=gen).to(cache_dtype)
        v_cache = k_cache[..., :v_dim]
    else:
        k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
        v_cache = torch.randn(slots, num_kv_heads, v_dim, generator=gen).to(cache_dtype)
    return k_cache, v_cache, table, torch.tensor(kv_lens, dtype=torch.int32)


def check(got, want, dtype):
    """Max abs error within TOLERANCE times the output's largest value (at least 1): a query
    that sees one key returns that key's value row, up to ~4.5 for randn in fp8, where bf16's
    rounding of p and of the output alone is up to ~0.033 (seed 1794369244 measured 0.0296)."""
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.cpu().double() - want).abs().max().item()
    tol = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    assert err <= tol, f"max abs error {err} > {tol}"


def backend_decode(q, k_cache, v_cache, *rest, **kwargs):
    """A decode call through the AttentionBackend a model of these shapes and dtypes gets on q's
    device (gpu_service/attention/backend.py), on its GPU kernels (on the CPU: under Triton's
    interpreter, where the backend runs attention_triton's split kernel)."""
    from gpu_service.attention.backend import AttentionBackend

    latent = k_cache.shape[-1] if v_cache.data_ptr() == k_cache.data_ptr() else 0
    backend = AttentionBackend.choose(q.device, q.dtype, k_cache.dtype, latent)
    return backend.gpu_decode(q, k_cache, v_cache, *rest, **kwargs)
