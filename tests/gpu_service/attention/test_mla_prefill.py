"""MLA prefill over expanded keys (mla_prefill.py) against float64 attention written from the
definition: keys [W_uk c | k_rot] and values W_uv c per head, over shuffled block tables, ragged
chunks at the end of longer contexts, one key block or many (merged by log-sum-exp), head dims
padded to the kernel's 16 or not; attention_triton's kernel on CUDA compiled, else under its
interpreter."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton", reason="the expanded form runs in attention_triton's kernel")
# without CUDA, tests/conftest.py has set TRITON_INTERPRET=1: the kernels run interpreted
from gpu_service.attention import attention_triton, mla_prefill  # noqa: E402
from gpu_service.attention.backend import AttentionBackend  # noqa: E402
from gpu_service.attention.batch import AttentionGroup  # noqa: E402
from gpu_service.models.deepseek import absorbed_attention  # noqa: E402
from tests.support.attention_reference import reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL = attention_triton.paged_prefill
HEADS, RANK = 4, 32
DIMS = {"wide": (16, 8, 16), "tiny-padded": (8, 8, 8)}  # nope, rope, v (the tiny models': padded)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def make_case(gen, shapes, block_size, dtype, nope=16, rope=8, v=16):
    """shapes: (new queries, kv_len) per sequence -> (q_nope, q_rot, cache, w_uk, w_uv), group."""
    blocks = [-(-n // block_size) for _, n in shapes]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros((len(shapes), max(blocks) + 1), dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks):
        table[i, :count] = order[used : used + count]
        used += count
    cache = torch.randn(num_blocks * block_size, RANK + rope, generator=gen)
    rows = sum(q for q, _ in shapes)
    q_nope = torch.randn(rows, HEADS, nope, generator=gen)
    q_rot = torch.randn(rows, HEADS, rope, generator=gen)
    w_uk = torch.randn(HEADS, nope, RANK, generator=gen) / RANK**0.5
    w_uv = torch.randn(HEADS, v, RANK, generator=gen) / RANK**0.5
    cu = torch.tensor([0] + [sum(q for q, _ in shapes[: i + 1]) for i in range(len(shapes))])
    kv_len = torch.tensor([n for _, n in shapes], dtype=torch.int32)
    group = AttentionGroup(slice(0, rows), table.to(DEVICE), cu.to(torch.int32).to(DEVICE),
                           kv_len.to(DEVICE))  # fmt: skip
    tensors = [t.to(dtype).to(DEVICE) for t in (q_nope, q_rot, cache, w_uk, w_uv)]
    return tensors, group


def definition(q_nope, q_rot, cache, group, block_size, w_uk, w_uv, scale):
    """float64: every slot's keys and values expanded, then plain attention per sequence."""
    c, k_rot = cache.double().cpu().split([RANK, cache.shape[-1] - RANK], dim=-1)
    keys = torch.cat((torch.einsum("sr,hnr->shn", c, w_uk.double().cpu()),
                      k_rot[:, None, :].expand(-1, HEADS, -1)), dim=-1)  # fmt: skip
    values = torch.einsum("sr,hvr->shv", c, w_uv.double().cpu())
    q = torch.cat((q_nope, q_rot), dim=-1).double().cpu()
    return reference(q, keys, values, group.block_table.cpu(), group.cu_seqlens_q.cpu(),
                     group.kv_len.cpu(), block_size, scale, None)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_bytes", [1 << 30, 3000], ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("dims", list(DIMS))
def test_expanded_prefill_matches_definition(dims, block_bytes, dtype, seed):
    """Chunks at the end of longer contexts and a whole prompt (one causal block longer than a
    key block), the context in one key block or in 16-key blocks merged by log-sum-exp."""
    gen = torch.Generator().manual_seed(seed + 41)
    nope, rope, v = DIMS[dims]
    shapes = [(7, 50), (20, 20), (1, 33), (12, 90)]
    (q_nope, q_rot, cache, w_uk, w_uv), group = make_case(gen, shapes, 16, dtype, nope, rope, v)
    scale = (nope + rope) ** -0.5
    want = definition(q_nope, q_rot, cache, group, 16, w_uk, w_uv, scale)
    got = mla_prefill.expanded_prefill(q_nope, q_rot, cache, group, 16, w_uk, w_uv, scale,
                                       KERNEL, block_bytes=block_bytes)  # fmt: skip
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.cpu().double() - want).abs().max().item()
    print(f"{dims}, {block_bytes} bytes a block, {dtype}: max abs error {err:.2e}")
    assert err <= TOLERANCE[dtype]


def test_expanded_equals_absorbed(seed):
    """The absorbed form (deepseek.absorbed_attention, decode rows' and short chunks': queries
    W_uk^T q_nope over the latent, W_uv after) gives the same attention: one computation."""
    gen = torch.Generator().manual_seed(seed + 42)
    shapes = [(30, 70), (9, 9)]
    (q_nope, q_rot, cache, w_uk, w_uv), group = make_case(gen, shapes, 16, torch.float32)
    scale = 0.1
    attend = partial(AttentionBackend().attend_group, group=group, block_size=16, scale=scale,
                     prefill=True)  # fmt: skip
    absorbed = absorbed_attention(q_nope, q_rot, cache, w_uk, w_uv, attend)
    got = mla_prefill.expanded_prefill(q_nope, q_rot, cache, group, 16, w_uk, w_uv, scale,
                                       KERNEL, block_bytes=2000)  # fmt: skip
    assert (got - absorbed).abs().max().item() < 2e-5


def test_worth_expanding_at_the_flop_crossover():
    """DeepSeek-V3 (r 512, nope 128, v 128): 171 queries a sequence and more go expanded."""
    assert not mla_prefill.worth_expanding(170, 512, 128, 128)
    assert mla_prefill.worth_expanding(171, 512, 128, 128)
    assert not mla_prefill.worth_expanding(0, RANK, 16, 16)


def test_expanded_only_where_the_kernel_runs():
    """On the CPU MLA prefill stays absorbed (torch's absorbed form measured faster there)."""
    cpu = AttentionBackend.choose(torch.device("cpu"), torch.float32, torch.float32)
    assert cpu.expanded_prefill_kernel() is None


def test_a_key_block_fits_the_memory_plans_headroom():
    """The expanded keys and values of one block are transient beyond what the plan's profile
    prefill measured: they must fit the smallest headroom it leaves."""
    from gpu_service.memory_plan import MIN_HEADROOM

    assert mla_prefill.EXPANDED_BLOCK_BYTES <= MIN_HEADROOM
