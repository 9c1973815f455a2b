"""bench_attention's torch reference (the column its Triton timings and differences stand beside)
equals the float64 paged attention, at both of its shapes, on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.bench_attention import SHAPES, Case, torch_attention
from tests.support.attention_reference import reference


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name.split()[-1])
@pytest.mark.parametrize("per_seq", [1, 24], ids=["decode", "prefill"])
def test_torch_reference_matches_float64(shape, per_seq, seed):
    torch.manual_seed(seed)
    small = dataclasses.replace(shape, num_heads=shape.num_heads // 8)  # 16 MLA, 4 GQA heads
    case = Case(small, batch=2, context=80, block_size=16, device="cpu", dtype=torch.float32)
    q = case.queries(per_seq)
    cu = case.cu_seqlens(per_seq)
    args = (case.k_cache, case.v_cache, case.block_table, cu, case.kv_len, 16, case.scale, None)
    want = reference(q, *args)
    got = torch_attention(case, q, per_seq)
    assert (got.double() - want).abs().max().item() < 1e-5
