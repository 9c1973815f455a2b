"""MLA decode's split kernel for Hopper, in Gluon (Triton's explicit-layout dialect).

DeepSeek's absorbed MLA decode attends 128 query heads to one latent cache row a token (512 latent
+ 64 rope columns; the value is the latent): per key the heads do ~240 FLOPs a cache byte, so on
an H200 the step is bound by the tensor cores as much as by HBM. attention_triton's split kernel
stays far from that FLOP roof (docs/attention.md): Triton lays a chained dot's first product
over all 8 warps along its 64 rows, so both warpgroups compute the same scores, and its
pipeliner issues the next key tile's copy only after this tile's products. Here the layouts and
the pipeline are explicit:

    per program: 64 heads of one sequence, one key range (a split), 8 warps = 2 warpgroups
    smem: Q [64, 512] + [64, 64] | STAGES x (keys [N, 512] + rope [N, 64]) | P [64, N]
    loop over key tiles i:
        wait tile i's copies; barrier
        issue tile i + STAGES - 1's copies (into the buffer tile i - 1 used)      <- overlaps below
        S [64, N] = Q K^T       warpgroup w scores keys w*N/2 .. (w+1)*N/2 (no duplicate work)
        online softmax over S (row max and sum across both warpgroups)
        P -> smem; O [64, 512] = O * alpha + P V   warpgroup w owns value columns w*256 ..
    store O / l and the log-sum-exp, as attention_triton's split kernel does; its merge follows.

With 3 stages or more (OVERLAP), tile i + 1's Q K^T is issued before tile i's softmax and runs
on the tensor cores while it does; each step then waits for tiles up to i + 1.

Block ids are loaded one tile ahead of the copies that use them, so no load latency sits between
a tile's products and the next copy. Cache rows are gathered by cp.async through the block table
(any block size); masked rows are zero-filled, so keys past a split's end score -inf and add 0.
Only bf16 / fp16 caches with queries of the same dtype and head groups that are multiples of 64
take this path (a model's AttentionBackend decides: backend.py); an fp8 cache must be upcast on
load, which cp.async cannot do.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# NOTE: Triton 3.9 renamed Gluon's cp.async copy (async_copy_global_to_shared) and CTA barrier
# (thread_barrier); the GPU host's torch ships Triton 3.6, CI installs the newest
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# (keys a step, stages) built for sm_90 (tests/gpu_service/attention/test_mla_decode_hopper.py);
# 64 keys at 3 stages would take 303 KB of shared memory
LAUNCH_SHAPES = frozenset({(64, 2), (32, 2), (32, 3), (32, 4)})
HEADS_PER_PROGRAM = 64
HEAD_DIM = 576  # latent 512 + rope 64
# the kernels' constants
LATENT = gl.constexpr(512)
ROPE = gl.constexpr(64)
BLOCK_H = gl.constexpr(HEADS_PER_PROGRAM)
NUM_WARPS = gl.constexpr(8)


@functools.lru_cache(maxsize=4)
def supported_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def takes(q: torch.Tensor, k_cache: torch.Tensor, group: int, v_from_k: bool, window) -> bool:
    """Whether this kernel serves a decode call (else attention_triton's split kernel does)."""
    return (
        v_from_k
        and window is None
        and q.shape[-1] == HEAD_DIM
        and group % HEADS_PER_PROGRAM == 0
        and k_cache.shape[1] == 1
        and q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype == q.dtype
        and k_cache.stride(-1) == 1
        and q.stride(-1) == 1
        and supported_device(q.device)
    )


@gluon.jit
def _issue_tile(
    keys_buf,
    rope_buf,
    cache,
    stride_cs,
    blocks_n,
    blocks_r,
    key0,
    end,
    block_size,
    BLOCK_N: gl.constexpr,
    LOAD_N: gl.constexpr,
    LOAD_R: gl.constexpr,
):
    """cp.async the cache rows of keys key0 .. key0 + BLOCK_N - 1 (their blocks' ids given, one
    copy per layout) into the stage's buffers; rows at or past `end` are zero-filled."""
    keys_n = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD_N))
    slot_n = blocks_n.to(gl.int64) * block_size + keys_n % block_size
    cols_n = gl.arange(0, LATENT, layout=gl.SliceLayout(0, LOAD_N))
    ptr_n = cache + slot_n[:, None] * stride_cs + cols_n[None, :]
    _async_load(keys_buf, ptr_n, mask=(keys_n < end)[:, None])
    keys_r = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD_R))
    slot_r = blocks_r.to(gl.int64) * block_size + keys_r % block_size
    cols_r = LATENT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, LOAD_R))
    ptr_r = cache + slot_r[:, None] * stride_cs + cols_r[None, :]
    _async_load(rope_buf, ptr_r, mask=(keys_r < end)[:, None])
    async_copy.commit_group()


@gluon.jit
def _block_ids(block_row, key0, end, block_size, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    return gl.load(block_row + keys // block_size, mask=keys < end, other=0)


@gluon.jit
def _scores(q_n_smem, q_r_smem, keys_tile, rope_tile, BLOCK_H: gl.constexpr,
            BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):  # fmt: skip
    """Q K^T [BLOCK_H, BLOCK_N] of one key tile, issued (a token to wait for)."""
    scores = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    scores = warpgroup_mma(q_n_smem, keys_tile.permute((1, 0)), scores, is_async=True)
    return warpgroup_mma(q_r_smem, rope_tile.permute((1, 0)), scores, is_async=True)


@gluon.jit
def _softmax_step(scores, m_i, l_i, key0, end, qk_scale, BLOCK_N: gl.constexpr,
                  S_LAYOUT: gl.constexpr):  # fmt: skip
    """Online softmax over one tile's scores (keys key0 ..; those at or past end unseen):
    -> (p, alpha: the rescale of what came before, the running max, the running sum)."""
    key_ok = (key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))) < end
    scores = gl.where(key_ok[None, :], scores * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(scores - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _tiles_landed(NUM_OUTSTANDING: gl.constexpr):
    """This thread's copies done but the newest NUM_OUTSTANDING groups, then every thread's,
    visible to the tensor cores' proxy. NOTE: the barrier also retires the products issued
    before it, so a buffer they read may be overwritten by the copies issued after it."""
    async_copy.wait_group(NUM_OUTSTANDING)
    _cta_barrier()
    fence_async_shared()


@gluon.jit
def _prefetch(keys_buf, rope_buf, cache, stride_cs, block_row, blocks_n, blocks_r, i, start,
              end, block_size, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              LOAD_N: gl.constexpr, LOAD_R: gl.constexpr):  # fmt: skip
    """At tile i: issue tile i + STAGES - 1's copies (into tile i - 1's buffer; its block ids
    given) and load the block ids of the tile after it."""
    ahead = start + (i + STAGES - 1) * BLOCK_N
    stage = (i + STAGES - 1) % STAGES
    _issue_tile(keys_buf.index(stage), rope_buf.index(stage), cache, stride_cs, blocks_n,
                blocks_r, ahead, end, block_size, BLOCK_N, LOAD_N, LOAD_R)  # fmt: skip
    blocks_n = _block_ids(block_row, ahead + BLOCK_N, end, block_size, BLOCK_N, LOAD_N)
    blocks_r = _block_ids(block_row, ahead + BLOCK_N, end, block_size, BLOCK_N, LOAD_R)
    return blocks_n, blocks_r


@gluon.jit
def _accumulate(acc, p, alpha, p_smem, values, O_LAYOUT: gl.constexpr):
    """O * alpha + P V, issued (a token to wait for): P through shared memory, rounded to the
    query's dtype as attend() rounds its probabilities."""
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _cta_barrier()
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    return warpgroup_mma(p_smem, values, acc, is_async=True)


@gluon.jit(do_not_specialize=("stride_bt", "stride_pb", "stride_ph", "stride_ps", "stride_lb",
                              "stride_lh", "num_splits"))  # fmt: skip
def _mla_split_kernel(
    q,
    cache,
    block_table,
    kv_len,
    part_out,
    part_lse,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    block_size,
    qk_scale,
    num_splits,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
):
    LOAD_N: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    LOAD_R: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 2], [16, BLOCK_N // 2, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 2], [16, LATENT // 2, 16])
    dtype: gl.constexpr = q.dtype.element_ty
    SMEM_N: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dtype)
    SMEM_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    SMEM_QN: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LATENT], dtype)
    SMEM_QR: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
    SMEM_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

    tile, split, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    n = gl.load(kv_len + b)
    per_split = gl.cdiv(gl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = gl.minimum(start + per_split, n)
    block_row = block_table + b * stride_bt

    keys_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, LATENT], SMEM_N)
    rope_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, ROPE], SMEM_R)
    for s in gl.static_range(STAGES - 1):
        key0 = start + s * BLOCK_N
        blocks_n = _block_ids(block_row, key0, end, block_size, BLOCK_N, LOAD_N)
        blocks_r = _block_ids(block_row, key0, end, block_size, BLOCK_N, LOAD_R)
        _issue_tile(keys_buf.index(s), rope_buf.index(s), cache, stride_cs, blocks_n, blocks_r,
                    key0, end, block_size, BLOCK_N, LOAD_N, LOAD_R)  # fmt: skip
    ahead = start + (STAGES - 1) * BLOCK_N
    next_n = _block_ids(block_row, ahead, end, block_size, BLOCK_N, LOAD_N)
    next_r = _block_ids(block_row, ahead, end, block_size, BLOCK_N, LOAD_R)

    heads = tile * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD_N))
    q_rows = q + b * stride_qb + heads[:, None] * stride_qh
    q_n = gl.load(q_rows + gl.arange(0, LATENT, layout=gl.SliceLayout(0, LOAD_N))[None, :])
    heads_r = tile * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD_R))
    q_rows_r = q + b * stride_qb + heads_r[:, None] * stride_qh
    q_r = gl.load(q_rows_r + LATENT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, LOAD_R))[None, :])
    q_n_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LATENT], SMEM_QN, q_n)
    q_r_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], SMEM_QR, q_r)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], SMEM_P)

    acc = gl.zeros([BLOCK_H, LATENT], gl.float32, O_LAYOUT)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    if OVERLAP:
        # NOTE: tile i + 1's scores run on the tensor cores while tile i's softmax runs: the
        # loop enters with tile 0's scores, and each step waits for tiles up to i + 1 (so 3
        # stages at least: i's buffer for P V, i + 1's for Q K^T, one loading)
        _tiles_landed(STAGES - 2)
        scores_next = _scores(q_n_smem, q_r_smem, keys_buf.index(0), rope_buf.index(0),
                              BLOCK_H, BLOCK_N, S_LAYOUT)  # fmt: skip
        scores_next = warpgroup_mma_wait(0, deps=[scores_next])
        for i in range(num_tiles):
            _tiles_landed(STAGES - 3)
            next_n, next_r = _prefetch(keys_buf, rope_buf, cache, stride_cs, block_row, next_n,
                                       next_r, i, start, end, block_size, BLOCK_N, STAGES,
                                       LOAD_N, LOAD_R)  # fmt: skip
            scores = scores_next
            scores_next = _scores(q_n_smem, q_r_smem, keys_buf.index((i + 1) % STAGES),
                                  rope_buf.index((i + 1) % STAGES), BLOCK_H, BLOCK_N,
                                  S_LAYOUT)  # fmt: skip
            p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, start + i * BLOCK_N, end,
                                               qk_scale, BLOCK_N, S_LAYOUT)  # fmt: skip
            acc = _accumulate(acc, p, alpha, p_smem, keys_buf.index(i % STAGES), O_LAYOUT)
            scores_next, acc = warpgroup_mma_wait(0, deps=[scores_next, acc])
    else:
        for i in range(num_tiles):
            _tiles_landed(STAGES - 2)  # tile i's
            next_n, next_r = _prefetch(keys_buf, rope_buf, cache, stride_cs, block_row, next_n,
                                       next_r, i, start, end, block_size, BLOCK_N, STAGES,
                                       LOAD_N, LOAD_R)  # fmt: skip
            scores = _scores(q_n_smem, q_r_smem, keys_buf.index(i % STAGES),
                             rope_buf.index(i % STAGES), BLOCK_H, BLOCK_N, S_LAYOUT)  # fmt: skip
            scores = warpgroup_mma_wait(0, deps=[scores])
            p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, start + i * BLOCK_N, end,
                                               qk_scale, BLOCK_N, S_LAYOUT)  # fmt: skip
            acc = _accumulate(acc, p, alpha, p_smem, keys_buf.index(i % STAGES), O_LAYOUT)
            acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)

    seen = l_i > 0
    lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    heads_s = tile * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_LAYOUT))
    gl.store(part_lse + b * stride_lb + heads_s * stride_lh + split, lse)
    if start < end:
        denom = gl.convert_layout(gl.where(seen, l_i, 1.0), gl.SliceLayout(1, O_LAYOUT))
        out = acc / denom[:, None]
        heads_o = tile * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_LAYOUT))
        cols_o = gl.arange(0, LATENT, layout=gl.SliceLayout(0, O_LAYOUT))
        part = part_out + b * stride_pb + heads_o[:, None] * stride_ph + split * stride_ps
        gl.store(part + cols_o[None, :], out.to(part_out.dtype.element_ty))


def check_launch(heads: int, block_n: int, num_warps: int, stages: int, block_dv: int) -> None:
    """A ValueError for a launch shape (attention_triton.Tiles' fields) this kernel does not run:
    64 heads a program on 8 warps over all value columns, at LAUNCH_SHAPES' keys and stages."""
    if (heads, num_warps, block_dv) != (HEADS_PER_PROGRAM, NUM_WARPS.value, 0) or (
        block_n,
        stages,
    ) not in LAUNCH_SHAPES:
        raise ValueError(
            f"the Hopper MLA kernel runs {HEADS_PER_PROGRAM} heads a program on "
            f"{NUM_WARPS.value} warps over all value columns, at (keys a step, stages) "
            f"{sorted(LAUNCH_SHAPES)}: others do not fit Hopper's shared memory or were never "
            f"built; got {heads} heads, {num_warps} warps, {block_dv or 'all'} value columns, "
            f"({block_n}, {stages})"
        )


def split_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    block_size: int,
    qk_scale: float,
    block_n: int = 64,
    stages: int = 2,
) -> None:
    """Writes part_out [B, Hq, splits, 512] and part_lse [B, Hq, splits] for q [B, Hq, 576]
    (qk_scale: the softmax scale times log2(e)); attention_triton's merge kernel reads them.
    With 3 stages or more a tile's scores overlap the softmax before them (OVERLAP)."""
    check_launch(HEADS_PER_PROGRAM, block_n, NUM_WARPS.value, stages, 0)
    batch, num_heads = q.shape[0], q.shape[1]
    num_splits = part_lse.shape[2]
    grid = (num_heads // HEADS_PER_PROGRAM, num_splits, batch)
    _mla_split_kernel[grid](
        q, k_cache, block_table, kv_len, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), block_table.stride(0),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        block_size, qk_scale, num_splits,
        BLOCK_N=block_n, STAGES=stages, OVERLAP=stages >= 3, num_warps=NUM_WARPS.value,
    )  # fmt: skip
