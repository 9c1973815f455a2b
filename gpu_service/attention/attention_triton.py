"""Paged attention kernels for CUDA, in Triton: batched decode (split-K) and ragged prefill.

Cache layout (kvcache/tensors.py): row `slot` of k_cache [S, Hkv, D] and v_cache [S, Hkv, Dv]
holds the token of a sequence at position p, slot = block_table[b, p // block_size] * block_size
+ p % block_size. Every tensor is read through its strides, so v_cache may be a view of k_cache
(MLA: one latent kv head, D = kv_lora_rank + rope, v = its first kv_lora_rank columns); when it is,
each key tile is loaded once and used as both key and value. A float8 cache is upcast on load.

Query head h reads kv head h // (Hq / Hkv). A program takes a tile of query rows that share one kv
head (decode: a group of heads of one sequence; prefill: queries x heads), so every key tile it
loads serves all of them; scores and softmax run in float32 (base 2, the scale folded in).

Decode (flash-decoding): the keys of each sequence are split over `num_splits` programs, each
writing its normalized partial output and log-sum-exp; a second kernel merges them. A head tile's
value columns may be split too (Tiles.block_dv): each of its programs scores the keys in full but
accumulates only its own columns, for a smaller accumulator (MLA's is 512 wide). The split
count depends on shapes only (batch, heads, block_table's width), never on kv_len's values, and
nothing syncs with the host, so a decode step can be captured in a CUDA graph.

Prefill: the queries of sequence i (rows cu_seqlens_q[i]:cu_seqlens_q[i+1]) are at positions
kv_len[i] - n_i .. kv_len[i] - 1, causal over the sequence's cached keys. The grid has
T // BLOCK_Q + B query blocks (sequence i's blocks start at cu_seqlens_q[i] // BLOCK_Q + i), each
program finding its sequence by binary search, so the grid too comes from shapes alone. Off the
causal default, every query sees all kv_len keys; each row's log-sum-exp may be stored too, so
that partial attentions over key ranges merge (mla_prefill.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_service.attention.paged_attention import LOG2E

try:  # Gluon (Triton's explicit-layout dialect) is newer than some Triton releases
    from gpu_service.attention import mla_decode_hopper
except ImportError:
    mla_decode_hopper = None

MAX_SPLITS = 256
MIN_KEYS_PER_SPLIT = 256
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
QUERY_DTYPES = tuple(_TL_DTYPES)
# NOTE: Triton compiles a kernel once per specialization of its integer arguments (== 1, a
# multiple of 16, else); arguments that change from step to step (sequences, the block table's
# width, the splits a context takes) are left unspecialized, so a new mix of requests never
# stalls a running step on a compile
_PER_STEP = ("stride_bt", "window")
# the decode's partial results [B, Hq, splits, Dv] and their log-sum-exps [B, Hq, splits]: strides
# that move with the splits (1 at a short context: == 1 is a class of its own)
_SPLIT_STRIDES = ("stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh")


@dataclass(frozen=True)
class Tiles:
    """Launch shape: query heads per program, keys per loop step, warps, pipeline stages."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    block_q: int = 1  # prefill only: queries per program (rows = block_q * block_h)
    block_dv: int = 0  # decode only: value columns per program (0: all; each program of a
    # head tile scores the keys in full, but holds an accumulator only block_dv wide)

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n", "block_q"):
            value = getattr(self, name)
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name} must be a positive power of two, got {value}")
        if self.block_dv and (self.block_dv < 16 or self.block_dv & (self.block_dv - 1)):
            raise ValueError(f"block_dv must be 0 or a power of two >= 16, got {self.block_dv}")
        if self.block_n < 16 or self.block_q * self.block_h < 16:
            raise ValueError("tiles need at least 16 keys and 16 query rows (tensor-core shapes)")


def decode_tiles(head_dim: int, group: int, elem_bytes: int = 2) -> Tiles:
    """Default decode tiles (elem_bytes: the query's). MLA's 576-wide latent at 64 heads per
    program: Hopper's warpgroup MMA (needs 64 rows) over 64 keys a step, 8 warps, 2 stages (216
    KB of shared memory with a bf16 cache, 180 with fp8), the fastest of bench_attention's
    sweeps (docs/attention.md); fewer heads, mma.sync tiles over 32 keys. float32 queries of a
    head wider than 256: 32 heads over 16 keys (the 64 x 32 tiles take 258 KB of shared memory
    there, past the H200's 227 KB)."""
    block_h = max(16, min(triton.next_power_of_2(group), 64))
    if head_dim > 256 and elem_bytes > 2:
        return Tiles(block_h=min(block_h, 32), block_n=16, num_warps=4, num_stages=2)
    if head_dim > 256:
        if block_h == 64:
            return Tiles(block_h=64, block_n=64, num_warps=8, num_stages=2)
        return Tiles(block_h=block_h, block_n=32, num_warps=8 if block_h > 16 else 4, num_stages=2)
    return Tiles(block_h=block_h, block_n=64, num_warps=4, num_stages=2)


def prefill_tiles(head_dim: int, group: int) -> Tiles:
    """Default prefill tiles: 64 query rows, as many heads of a group as fit (up to 16)."""
    block_h = min(triton.next_power_of_2(group), 16)
    block_q = max(1, 64 // block_h)
    if head_dim > 256:
        return Tiles(block_h=block_h, block_n=16, num_warps=8, num_stages=2, block_q=block_q)
    return Tiles(block_h=block_h, block_n=64, num_warps=4, num_stages=2, block_q=block_q)


@dataclass(frozen=True)
class _HeadDims:
    """D = da + the rest (da the largest power of two <= D, the rest padded to db); Dv padded."""

    d: int
    dv: int
    da: int
    db: int
    dv_pad: int

    @classmethod
    def of(cls, d: int, dv: int) -> _HeadDims:
        if d < 16 or dv < 16:
            raise ValueError(f"head dims must be at least 16, got D={d}, Dv={dv}")
        da = 1 << (d.bit_length() - 1)
        rest = d - da
        db = max(16, triton.next_power_of_2(rest)) if rest else 0
        return cls(d, dv, da, db, max(16, triton.next_power_of_2(dv)))


@triton.jit
def _key_tile(
    acc,
    m_i,
    l_i,
    q_a,
    q_b,
    keys,
    row_lo,
    row_hi,
    load_lo,
    load_hi,
    block_row,
    block_size,
    k_cache,
    v_cache,
    kv_head,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    qk_scale,
    v0,
    D: tl.constexpr,
    DV: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    V_FROM_K: tl.constexpr,
    PRECISION: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One step of online softmax over key positions `keys` [N] for query rows [M]: row r sees
    key j where row_lo[r] <= j < row_hi[r]; keys outside [load_lo, load_hi) are not loaded;
    acc [M, BLOCK_DV] gathers value columns v0 .. v0 + BLOCK_DV - 1."""
    key_ok = (keys >= load_lo) & (keys < load_hi)  # [N]
    block = tl.load(block_row + keys // block_size, mask=key_ok, other=0)
    slot = block.to(tl.int64) * block_size + keys % block_size  # [N]
    offs_a = tl.arange(0, DA)
    k_rows = k_cache + slot[:, None] * stride_ks + kv_head * stride_kh  # [N, 1]
    k_a = tl.load(k_rows + offs_a[None, :] * stride_kd, mask=key_ok[:, None], other=0.0)
    k_a = k_a.to(IN_DTYPE).to(DOT_DTYPE)  # [N, DA]
    scores = tl.dot(q_a, tl.trans(k_a), input_precision=PRECISION)  # [M, N]
    if DB > 0:
        offs_b = DA + tl.arange(0, DB)
        k_b = tl.load(
            k_rows + offs_b[None, :] * stride_kd,
            mask=key_ok[:, None] & (offs_b[None, :] < D),
            other=0.0,
        )
        k_b = k_b.to(IN_DTYPE).to(DOT_DTYPE)
        scores += tl.dot(q_b, tl.trans(k_b), input_precision=PRECISION)
    scores = scores * qk_scale
    visible = (keys[None, :] >= row_lo[:, None]) & (keys[None, :] < row_hi[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
    p = tl.math.exp2(scores - m_safe[:, None])  # [M, N]
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_FROM_K:
        v = k_a  # [N, DA], DA == Dv == BLOCK_DV: the value is the key's first Dv columns
    else:
        offs_v = v0 + tl.arange(0, BLOCK_DV)
        v_rows = v_cache + slot[:, None] * stride_vs + kv_head * stride_vh
        v = (
            tl.load(
                v_rows + offs_v[None, :] * stride_vd,
                mask=key_ok[:, None] & (offs_v[None, :] < DV),
                other=0.0,
            )
            .to(IN_DTYPE)
            .to(DOT_DTYPE)
        )  # [N, BLOCK_DV]
    p = p.to(IN_DTYPE).to(DOT_DTYPE)  # rounded to q's dtype, as attend() rounds its probs
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_queries(
    q_rows,
    row_ok,
    stride_qd,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """q_rows [M, 1] pointers -> ([M, DA], [M, DB]) (the second is the first again when DB == 0)."""
    offs_a = tl.arange(0, DA)
    q_a = tl.load(q_rows + offs_a[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    q_a = q_a.to(DOT_DTYPE)
    if DB > 0:
        offs_b = DA + tl.arange(0, DB)
        q_b = tl.load(
            q_rows + offs_b[None, :] * stride_qd,
            mask=row_ok[:, None] & (offs_b[None, :] < D),
            other=0.0,
        ).to(DOT_DTYPE)
    else:
        q_b = q_a
    return q_a, q_b


@triton.jit(do_not_specialize=_PER_STEP + _SPLIT_STRIDES + ("num_splits",))
def _decode_split_kernel(
    q,
    k_cache,
    v_cache,
    block_table,
    kv_len,
    part_out,
    part_lse,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    group,
    block_size,
    qk_scale,
    window,
    num_splits,
    D: tl.constexpr,
    DV: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    V_FROM_K: tl.constexpr,
    PRECISION: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    # NOTE: value blocks, then head tiles vary fastest, so the programs that read the same keys
    # run side by side (L2)
    pid, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    v_blocks = tl.cdiv(DV, BLOCK_DV)
    pid_tile, v0 = pid // v_blocks, (pid % v_blocks) * BLOCK_DV
    tiles_per_kv = tl.cdiv(group, BLOCK_H)
    kv_head = pid_tile // tiles_per_kv
    in_group = (pid_tile % tiles_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = in_group < group
    heads = kv_head * group + in_group  # [H]
    n = tl.load(kv_len + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(n - window, 0)
    per_split = tl.cdiv(tl.cdiv(n - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, n)

    # NOTE: a split past the context (most of them at a short one: the split count follows the
    # block table's width) stores only its log-sum-exp, -inf, which the merge reads first: its
    # partial output is neither written nor read (MLA's is 128 KB a program)
    live = head_ok & (tl.full([BLOCK_H], 0, dtype=tl.int32) + start < end)  # [H]
    q_rows = q + b * stride_qb + heads[:, None] * stride_qh
    q_a, q_b = _load_queries(q_rows, live, stride_qd, D, DA, DB, DOT_DTYPE)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_lo = tl.full([BLOCK_H], 0, dtype=tl.int32) + start
    row_hi = tl.full([BLOCK_H], 0, dtype=tl.int32) + end
    block_row = block_table + b * stride_bt
    for key0 in range(start, end, BLOCK_N):
        keys = key0 + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _key_tile(
            acc, m_i, l_i, q_a, q_b, keys, row_lo, row_hi, start, end, block_row, block_size,
            k_cache, v_cache, kv_head, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh,
            stride_vd, qk_scale, v0, D, DV, DA, DB, BLOCK_DV, V_FROM_K, PRECISION, IN_DTYPE,
            DOT_DTYPE,
        )  # fmt: skip

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    offs_v = v0 + tl.arange(0, BLOCK_DV)
    part = part_out + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
    out = out.to(part_out.dtype.element_ty)  # float32, or halved (decode_with's partial_dtype)
    tl.store(part + offs_v[None, :], out, mask=live[:, None] & (offs_v[None, :] < DV))
    if v0 == 0:
        tl.store(part_lse + b * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit(do_not_specialize=_SPLIT_STRIDES + ("num_splits",))
def _decode_merge_kernel(
    part_out,
    part_lse,
    out,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_od,
    num_splits,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # NOTE: every split's partial is loaded in one [S, BLOCK_V] tile, not in a loop over the
    # splits: a loop waits out one load's latency per split (64 at a long context)
    b, h, v0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BLOCK_V
    offs_s = tl.arange(0, SPLITS_PAD)
    split_ok = offs_s < num_splits
    lse = tl.load(part_lse + b * stride_lb + h * stride_lh + offs_s, mask=split_ok,
                  other=float("-inf"))  # fmt: skip
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.math.exp2(lse - m)  # [S], 0 for a split that saw no key
    total = tl.sum(weights, 0)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    part = part_out + b * stride_pb + h * stride_ph
    tiles = tl.load(
        part + offs_s[:, None] * stride_ps + offs_v[None, :],
        mask=(weights[:, None] > 0) & (offs_v[None, :] < DV),
        other=0.0,
    ).to(tl.float32)  # [S, V]
    result = tl.sum(weights[:, None] * tiles, 0) / tl.where(total > 0, total, 1.0)
    dst = out + b * stride_ob + h * stride_oh + offs_v * stride_od
    tl.store(dst, result.to(out.dtype.element_ty), mask=offs_v < DV)


def _merge_block_v(dv_pad: int, splits_pad: int) -> int:
    """Value columns per merge program: a [splits, columns] tile of at most 4,096 floats."""
    return max(16, min(dv_pad, 4096 // splits_pad))


@triton.jit
def _find_sequence(cu_seqlens_q, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks (from cu_seqlens_q[i] // BLOCK_Q + i on) hold q_block."""
    # NOTE: tensors from the start: a loop-carried int must not be a constexpr (Triton makes an
    # int argument equal to 1 one, as num_seqs is for a single sequence).
    left = tl.full([], 0, tl.int32)
    right = tl.full([], 0, tl.int32) + num_seqs
    while left < right:
        mid = (left + right) // 2
        first = tl.load(cu_seqlens_q + mid) // BLOCK_Q + mid
        if first <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit(do_not_specialize=_PER_STEP + ("num_seqs",))
def _prefill_kernel(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    kv_len,
    out,
    lse,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    num_seqs,
    group,
    block_size,
    qk_scale,
    window,
    D: tl.constexpr,
    DV: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,
    V_FROM_K: tl.constexpr,
    PRECISION: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    q_block, pid_tile = tl.program_id(0), tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q, q_block, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q + seq)
    n_q = tl.load(cu_seqlens_q + seq + 1) - q_begin
    first_q = (q_block - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # within the sequence
    if first_q < n_q:
        tiles_per_kv = tl.cdiv(group, BLOCK_H)
        kv_head = pid_tile // tiles_per_kv
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)  # [M]: query-major, then head
        q_idx = first_q + rows // BLOCK_H
        in_group = (pid_tile % tiles_per_kv) * BLOCK_H + rows % BLOCK_H
        row_ok = (q_idx < n_q) & (in_group < group)
        heads = kv_head * group + in_group
        tokens = (q_begin + q_idx).to(tl.int64)
        n_kv = tl.load(kv_len + seq)
        pos = n_kv - n_q + q_idx  # [M]
        row_lo = tl.zeros_like(pos)
        if CAUSAL:
            row_hi = pos + 1
            hi = n_kv - n_q + tl.minimum(first_q + BLOCK_Q, n_q)  # the last query's pos + 1
        else:  # every query sees every key
            row_hi = tl.zeros_like(pos) + n_kv
            hi = n_kv
        lo = 0
        if HAS_WINDOW:
            row_lo = tl.maximum(pos - window + 1, 0)
            lo = tl.maximum(n_kv - n_q + first_q - window + 1, 0)

        q_rows = q + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
        q_a, q_b = _load_queries(q_rows, row_ok, stride_qd, D, DA, DB, DOT_DTYPE)
        acc = tl.zeros([BLOCK_Q * BLOCK_H, DV_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
        block_row = block_table + seq * stride_bt
        for key0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            keys = key0 + tl.arange(0, BLOCK_N)
            acc, m_i, l_i = _key_tile(
                acc, m_i, l_i, q_a, q_b, keys, row_lo, row_hi, lo, hi, block_row, block_size,
                k_cache, v_cache, kv_head, stride_ks, stride_kh, stride_kd, stride_vs,
                stride_vh, stride_vd, qk_scale, 0, D, DV, DA, DB, DV_PAD, V_FROM_K, PRECISION,
                IN_DTYPE, DOT_DTYPE,
            )  # fmt: skip
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        offs_v = tl.arange(0, DV_PAD)
        dst = out + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
        mask = row_ok[:, None] & (offs_v[None, :] < DV)
        tl.store(dst + offs_v[None, :] * stride_od, result.to(out.dtype.element_ty), mask=mask)
        if STORE_LSE:  # base 2, the scale folded in: log2 sum_k 2^(s_k * scale * log2 e)
            seen = l_i > 0
            row_lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(lse + tokens * stride_lt + heads * stride_lh, row_lse, mask=row_ok)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter (TRITON_INTERPRET=1) on CPU tensors
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_decode_splits(
    batch: int, programs_per_seq: int, max_keys: int, num_sms: int, min_keys: int = 0
) -> int:
    """Key partitions per sequence: enough programs for about two waves of the GPU, each split
    keeping at least max(min_keys, MIN_KEYS_PER_SPLIT) of the longest possible context; a power
    of two."""
    wanted = triton.cdiv(2 * num_sms, batch * programs_per_seq)
    cap = max(1, min(MAX_SPLITS, max_keys // max(min_keys, MIN_KEYS_PER_SPLIT)))
    return min(triton.next_power_of_2(max(1, wanted)), 1 << (cap.bit_length() - 1))


def min_keys_per_split(group: int, dims: _HeadDims, cache_bytes_per_key: int) -> int:
    """Keys a split must read so that its cache bytes are at least twice the float32 partial
    outputs it writes (group x Dv a kv head): GQA's 8 x 128 partial is 4 KB against 512 B of
    bf16 keys and values a token, so a split may be short; MLA's 128 x 512 is 256 KB against
    its 1,152-byte latent row, so its splits stay long (512 keys) and the merge does not read
    back as much as the split kernel did."""
    partial_bytes = group * dims.dv * 4
    return triton.next_power_of_2(triton.cdiv(2 * partial_bytes, cache_bytes_per_key))


def _check_cache(q, k_cache, v_cache, block_table, kv_len, block_size, window) -> tuple[int, int]:
    if q.dtype not in QUERY_DTYPES:
        raise TypeError(f"q must be one of {QUERY_DTYPES}, got {q.dtype}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"the cache must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
    if k_cache.dim() != 3 or v_cache.dim() != 3 or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(
            "k_cache [S, Hkv, D] and v_cache [S, Hkv, Dv] must share S and Hkv, got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q's head dim {q.shape[-1]} != the key's {k_cache.shape[-1]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_table.dtype != torch.int32 or kv_len.dtype != torch.int32:
        raise TypeError("block_table and kv_len must be int32")
    if block_table.dim() != 2 or block_table.stride(-1) != 1 or kv_len.dim() != 1:
        raise ValueError("block_table must be [B, max_blocks] with unit column stride, kv_len [B]")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    devices = {t.device for t in (q, k_cache, v_cache, block_table, kv_len)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    return num_heads, num_kv_heads


# the Hopper MLA kernel's launch shape: 64 heads, 64 keys a step, 8 warps, 2 stages
HOPPER_MLA_TILES = Tiles(block_h=64, block_n=64, num_warps=8, num_stages=2)


@dataclass(frozen=True)
class DecodeCall:
    """A checked decode call's shapes (check_decode): what the kernels launch from."""

    batch: int
    num_heads: int
    num_kv_heads: int
    dims: _HeadDims
    v_from_k: bool  # MLA: one latent row is key and value

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def hopper_takes(self, q: torch.Tensor, k_cache: torch.Tensor, window: int | None) -> bool:
        """Whether mla_decode_hopper's kernel serves this call (where Gluon imports)."""
        return mla_decode_hopper is not None and mla_decode_hopper.takes(
            q, k_cache, self.group, self.v_from_k, window
        )


def _v_from_k(k_cache: torch.Tensor, v_cache: torch.Tensor, dims: _HeadDims) -> bool:
    """v_cache is k_cache's first Dv columns (MLA), so a loaded key tile is also the value."""
    return (
        v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.stride() == k_cache.stride()
        and v_cache.dtype == k_cache.dtype
        and dims.dv == dims.da
    )


def _dot_args(q: torch.Tensor) -> dict:
    """How the tiles are multiplied: in q's dtype on tensor cores (float32 as exact ieee, not
    tf32); under the interpreter (CPU tensors) in float32 after rounding to q's dtype, because its
    numpy dot cannot take bf16."""
    in_dtype = _TL_DTYPES[q.dtype]
    dot_dtype = in_dtype if q.device.type == "cuda" else tl.float32
    precision = "ieee" if dot_dtype == tl.float32 else "tf32"
    return {"PRECISION": precision, "IN_DTYPE": in_dtype, "DOT_DTYPE": dot_dtype}


def check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    window: int | None = None,
) -> DecodeCall:
    """The shapes of a decode call q [B, Hq, D] over the caches; a TypeError or ValueError for
    one no decode kernel takes."""
    num_heads, num_kv_heads = _check_cache(
        q, k_cache, v_cache, block_table, kv_len, block_size, window
    )
    if q.dim() != 3 or q.shape[0] != kv_len.shape[0] or block_table.shape[0] != q.shape[0]:
        raise ValueError(
            f"q [B, Hq, D], block_table [B, max_blocks] and kv_len [B] must share B, got "
            f"{tuple(q.shape)}, {tuple(block_table.shape)}, {tuple(kv_len.shape)}"
        )
    dims = _HeadDims.of(q.shape[-1], v_cache.shape[-1])
    return DecodeCall(q.shape[0], num_heads, num_kv_heads, dims, _v_from_k(k_cache, v_cache, dims))


def decode_with(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    tiles: Tiles | None = None,
    num_splits: int | None = None,
    hopper: bool = False,
    partial_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The split decode, q [B, Hq, D] (each sequence's query at position kv_len - 1) -> [B, Hq,
    Dv] in q's dtype: this module's split kernel, or with hopper=True mla_decode_hopper's (a
    ValueError where it does not take the call). tiles, num_splits: the launch shape (default:
    chosen from the shapes). partial_dtype: the splits' normalized partial outputs, written and
    read back by the merge (at MLA's width a traffic of their own beside the cache's); bf16 /
    fp16 halve it, adding one rounding of each partial; their log-sum-exps stay float32. Which
    kernel serves a model's decode is its AttentionBackend's choice (backend.py)."""
    if partial_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"partial_dtype must be float32, bfloat16 or float16, got {partial_dtype}")
    call = check_decode(q, k_cache, v_cache, block_table, kv_len, block_size, window)
    if hopper and not call.hopper_takes(q, k_cache, window):
        raise ValueError(
            "the Hopper MLA decode kernel takes bf16/fp16 MLA caches (576-wide latent rows read "
            "as key and value, heads a multiple of 64, no window) on a Hopper GPU with Gluon"
        )
    return split_decode(call, q, k_cache, v_cache, block_table, kv_len, block_size, scale,
                        window, tiles, num_splits, hopper, partial_dtype)  # fmt: skip


def split_decode(
    call: DecodeCall,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    tiles: Tiles | None = None,
    num_splits: int | None = None,
    hopper: bool = False,
    partial_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """decode_with after its checks (call: check_decode's); hopper: the call is one the Hopper
    kernel takes (DecodeCall.hopper_takes), launched at HOPPER_MLA_TILES unless tiles says."""
    batch, num_heads, num_kv_heads, dims = call.batch, call.num_heads, call.num_kv_heads, call.dims
    group, v_from_k = call.group, call.v_from_k
    given_tiles = tiles
    tiles = tiles or decode_tiles(dims.d, group, q.element_size())
    out = torch.empty((batch, num_heads, dims.dv), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    tiles_per_kv = triton.cdiv(group, tiles.block_h)
    block_dv = min(tiles.block_dv or dims.dv_pad, dims.dv_pad)
    v_blocks = triton.cdiv(dims.dv, block_dv)
    if hopper:
        tiles = given_tiles or HOPPER_MLA_TILES
        mla_decode_hopper.check_launch(
            tiles.block_h, tiles.block_n, tiles.num_warps, tiles.num_stages, tiles.block_dv
        )
        tiles_per_kv, block_dv, v_blocks = group // tiles.block_h, dims.dv, 1
    if num_splits is None:
        max_keys = block_table.shape[1] * block_size
        if window is not None:
            max_keys = min(max_keys, window)
        programs_per_seq = num_kv_heads * tiles_per_kv * v_blocks
        key_bytes = dims.d * k_cache.element_size() + (
            0 if v_from_k else dims.dv * v_cache.element_size()
        )
        num_splits = num_decode_splits(
            batch, programs_per_seq, max_keys, _num_sms(q.device),
            min_keys_per_split(group, dims, key_bytes),
        )  # fmt: skip
    part_shape = (batch, num_heads, num_splits, dims.dv)
    part_out = torch.empty(part_shape, dtype=partial_dtype, device=q.device)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    grid = (num_kv_heads * tiles_per_kv * v_blocks, num_splits, batch)
    if hopper:
        mla_decode_hopper.split_launch(
            q, k_cache, block_table, kv_len, part_out, part_lse, block_size, scale * LOG2E,
            tiles.block_n, tiles.num_stages,
        )  # fmt: skip
    else:
        _decode_split_kernel[grid](
            q, k_cache, v_cache, block_table, kv_len, part_out, part_lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
            *part_out.stride()[:3], *part_lse.stride()[:2],
            group, block_size, scale * LOG2E, window or 0, num_splits,
            D=dims.d, DV=dims.dv, DA=dims.da, DB=dims.db, BLOCK_DV=block_dv,
            BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, HAS_WINDOW=window is not None,
            V_FROM_K=v_from_k and block_dv == dims.dv_pad, **_dot_args(q),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip
    splits_pad = max(2, triton.next_power_of_2(num_splits))
    block_v = _merge_block_v(dims.dv_pad, splits_pad)
    _decode_merge_kernel[(batch, num_heads, triton.cdiv(dims.dv, block_v))](
        part_out, part_lse, out, *part_out.stride()[:3], *part_lse.stride()[:2], *out.stride(),
        num_splits, DV=dims.dv, BLOCK_V=block_v, SPLITS_PAD=splits_pad, num_warps=4,
    )  # fmt: skip
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    causal: bool = True,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] ragged by cu_seqlens_q [B + 1] -> [T, Hq, Dv] in q's dtype. causal=False:
    every query sees all of its sequence's kv_len keys. lse: a float32 [T, Hq] that receives
    each row's log-sum-exp of its scaled scores, in base 2 (to merge partial attentions)."""
    return prefill_with(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_len, block_size,
                        scale, window, causal=causal, lse=lse)  # fmt: skip


def prefill_with(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    tiles: Tiles | None = None,
    causal: bool = True,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_prefill with the launch shape chosen by the caller (benchmarks, tests)."""
    num_heads, num_kv_heads = _check_cache(
        q, k_cache, v_cache, block_table, kv_len, block_size, window
    )
    batch = kv_len.shape[0]
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (batch + 1,):
        raise ValueError(f"cu_seqlens_q must be int32 [B + 1] = [{batch + 1}]")
    if q.dim() != 3 or block_table.shape[0] != batch:
        raise ValueError(
            f"q must be [T, Hq, D] and block_table [B={batch}, max_blocks], got "
            f"{tuple(q.shape)}, {tuple(block_table.shape)}"
        )
    group = num_heads // num_kv_heads
    dims = _HeadDims.of(q.shape[-1], v_cache.shape[-1])
    tiles = tiles or prefill_tiles(dims.d, group)
    num_tokens = q.shape[0]
    if lse is not None and (lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32):
        raise ValueError(f"lse must be float32 [T, Hq] = [{num_tokens}, {num_heads}]")
    if window is not None and not causal:
        raise ValueError("a sliding window is causal: window needs causal=True")
    out = torch.empty((num_tokens, num_heads, dims.dv), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out
    tiles_per_kv = triton.cdiv(group, tiles.block_h)
    grid = (num_tokens // tiles.block_q + batch, num_kv_heads * tiles_per_kv)
    lse_out, lse_strides = (out, (0, 0)) if lse is None else (lse, lse.stride())
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, cu_seqlens_q, kv_len, out, lse_out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0), *out.stride(),
        *lse_strides, batch, group, block_size, scale * LOG2E, window or 0,
        D=dims.d, DV=dims.dv, DA=dims.da, DB=dims.db, DV_PAD=dims.dv_pad,
        BLOCK_Q=tiles.block_q, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
        HAS_WINDOW=window is not None, CAUSAL=causal, STORE_LSE=lse is not None,
        V_FROM_K=_v_from_k(k_cache, v_cache, dims),
        **_dot_args(q), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
