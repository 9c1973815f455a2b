"""The Triton paged attention kernels against a naive float64 reference (tests/support: per
sequence, an explicit mask), at ragged lengths, over shuffled block tables with unused entries,
for GQA groups, MLA's latent cache (v a strided view of k), sliding windows, fp8 caches and
bf16 / fp16 / float32 queries.

On CUDA the kernels run compiled; without it, under Triton's interpreter (numpy on CPU tensors:
shapes kept small); without triton, the module is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install triton; without CUDA its interpreter runs the "
        "kernels on the CPU)",
        allow_module_level=True,
    )
# without CUDA, tests/conftest.py has set TRITON_INTERPRET=1: the kernels run interpreted

from gpu_service.attention import attention_triton as at  # noqa: E402
from gpu_service.attention.paged_attention import paged_prefill  # noqa: E402
from tests.support.attention_cases import TOLERANCE, backend_decode, check, make_case  # noqa: E402
from tests.support.attention_reference import reference  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def to_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


DECODE_CASES = {
    # name: kv_lens, block_size, Hq, Hkv, D, Dv, cache dtype, mla, window
    "gqa-group4": ([1, 37, 300], 16, 8, 2, 64, 64, torch.bfloat16, False, None),
    "gqa-group8-bs64": ([130, 5], 64, 16, 2, 128, 128, torch.bfloat16, False, None),
    "mha-odd-dims": ([17, 66], 16, 4, 4, 80, 48, torch.bfloat16, False, None),
    "gqa-window": ([40, 300, 7], 16, 8, 2, 64, 64, torch.bfloat16, False, 33),
    "gqa-fp8": ([90, 200], 16, 8, 2, 64, 64, torch.float8_e4m3fn, False, None),
    "mla": ([5, 130], 64, 16, 1, 576, 512, torch.bfloat16, True, None),
    "mla-fp8-bs16": ([77, 20], 16, 16, 1, 576, 512, torch.float8_e4m3fn, True, None),
    "mla-40-heads": ([33], 16, 40, 1, 576, 512, torch.bfloat16, True, None),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_decode_matches_reference(name, dtype, seed):
    kv_lens, block_size, hq, hkv, d, dv, cache_dtype, mla, window = DECODE_CASES[name]
    gen = torch.Generator().manual_seed(seed)
    case = make_case(gen, kv_lens, block_size, hkv, d, dv, cache_dtype, mla)
    k_cache, v_cache, table, kv_len = case
    q = torch.randn(len(kv_lens), hq, d, generator=gen).to(dtype)
    scale = d**-0.5
    cu = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    want = reference(q, k_cache, v_cache, table, cu, kv_len, block_size, scale, window)
    qd, kd, td, ld = to_device(q, k_cache, table, kv_len)
    vd = kd[..., :dv] if mla else v_cache.to(DEVICE)
    got = backend_decode(qd, kd, vd, td, ld, block_size, scale, window)
    check(got, want, dtype)


def float32_decode_case(name, seed):
    """DECODE_CASES[name] with float32 queries: (decode_with's positional arguments on DEVICE,
    the float64 reference output)."""
    kv_lens, block_size, hq, hkv, d, dv, cache_dtype, mla, window = DECODE_CASES[name]
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table, kv_len = make_case(gen, kv_lens, block_size, hkv, d, dv,
                                                cache_dtype, mla)  # fmt: skip
    q = torch.randn(len(kv_lens), hq, d, generator=gen)
    cu = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    want = reference(q, k_cache, v_cache, table, cu, kv_len, block_size, d**-0.5, window)
    qd, kd, td, ld = to_device(q, k_cache, table, kv_len)
    vd = kd[..., :dv] if mla else v_cache.to(DEVICE)
    return (qd, kd, vd, td, ld, block_size, d**-0.5, window), want


@pytest.mark.parametrize(
    "name,block_dv", [("mla", 128), ("mla-fp8-bs16", 256), ("mha-odd-dims", 16), ("gqa-window", 32)]
)
def test_decode_in_value_blocks(name, block_dv, seed):
    """Tiles.block_dv: each program of a head tile holds only block_dv value columns (MLA's
    value then loaded apart from its key tile); the output is the whole attention."""
    args, want = float32_decode_case(name, seed + block_dv)
    tiles = at.Tiles(block_h=16, block_n=16, num_warps=4, num_stages=1, block_dv=block_dv)
    got = at.decode_with(*args, tiles=tiles, num_splits=3)
    check(got, want, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits_merge_exactly(num_splits, seed):
    """Whatever the key partition (empty splits included), the merge gives the same attention."""
    gen = torch.Generator().manual_seed(seed + num_splits)
    k_cache, v_cache, table, kv_len = make_case(gen, [3, 70, 129], 16, 2, 32, 32, torch.float32)
    q = torch.randn(3, 4, 32, generator=gen)
    cu = torch.arange(4, dtype=torch.int32)
    want = reference(q, k_cache, v_cache, table, cu, kv_len, 16, 0.3, None)
    qd, kd, vd, td, ld = to_device(q, k_cache, v_cache, table, kv_len)
    got = at.decode_with(qd, kd, vd, td, ld, 16, 0.3, num_splits=num_splits)
    check(got, want, torch.float32)


@pytest.mark.parametrize("partial_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_partials_in_half_precision(partial_dtype, seed):
    """decode_with(partial_dtype=...): the splits' partial outputs stored halved (one rounding
    each, within the bf16 bound) and merged in float32; the MLA case, as its partials are big."""
    args, want = float32_decode_case("mla", seed + 5)
    got = at.decode_with(*args, num_splits=3, partial_dtype=partial_dtype)
    assert got.dtype == torch.float32
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16] * max(1.0, want.abs().max().item())


def test_decode_refuses_a_partial_dtype_it_cannot_merge(seed):
    q = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(16, 1, 16, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="partial_dtype"):
        at.decode_with(q, cache, cache, table, table[0] + 1, 16, 1.0, partial_dtype=torch.int8)


@pytest.mark.parametrize("num_splits, block_v", [(64, 64), (at.MAX_SPLITS, 16)])
def test_decode_merges_many_splits_in_value_blocks(num_splits, block_v, seed):
    """Many splits, most of them empty, and a value width (96, padded to 128) that the merge
    takes in column blocks: two of 64 (the second partly past Dv), or six of 16 at 256 splits."""
    gen = torch.Generator().manual_seed(seed + num_splits)
    k_cache, v_cache, table, kv_len = make_case(gen, [300, 1, 45], 16, 1, 32, 96, torch.float32)
    assert at._merge_block_v(128, num_splits) == block_v
    q = torch.randn(3, 2, 32, generator=gen)
    cu = torch.arange(4, dtype=torch.int32)
    want = reference(q, k_cache, v_cache, table, cu, kv_len, 16, 0.3, None)
    qd, kd, vd, td, ld = to_device(q, k_cache, v_cache, table, kv_len)
    got = at.decode_with(qd, kd, vd, td, ld, 16, 0.3, num_splits=num_splits)
    check(got, want, torch.float32)


def test_decode_empty_splits_neither_write_nor_read_their_partials(monkeypatch, seed):
    """The partial buffers start as NaN: a split past its sequence's keys leaves its rows so (no
    write: at MLA's width that is 128 KB a program), the merge reads none of them (no NaN in the
    output), and the splits with keys write theirs."""
    gen = torch.Generator().manual_seed(seed + 8)
    kv_lens = [3, 70, 129]
    k_cache, v_cache, table, kv_len = make_case(gen, kv_lens, 16, 2, 32, 32, torch.float32)
    q = torch.randn(3, 4, 32, generator=gen)
    cu = torch.arange(4, dtype=torch.int32)
    want = reference(q, k_cache, v_cache, table, cu, kv_len, 16, 0.3, None)
    qd, kd, vd, td, ld = to_device(q, k_cache, v_cache, table, kv_len)
    partials, empty = [], torch.empty

    def nan_partials(*shape, **kwargs):
        out = empty(*shape, **kwargs)
        if out.dim() == 4:  # [B, Hq, splits, Dv]: decode_with's partial outputs
            out.fill_(float("nan"))
            partials.append(out)
        return out

    monkeypatch.setattr(torch, "empty", nan_partials)
    num_splits, tiles = 8, at.Tiles(block_h=16, block_n=16, num_warps=4, num_stages=1)
    got = at.decode_with(qd, kd, vd, td, ld, 16, 0.3, tiles=tiles, num_splits=num_splits)
    monkeypatch.undo()
    check(got, want, torch.float32)
    (part,) = partials
    for b, n in enumerate(kv_lens):
        per_split = math.ceil(math.ceil(n / num_splits) / 16) * 16  # in steps of 16 keys
        used = math.ceil(n / per_split)
        assert not part[b, :, :used].isnan().any(), f"sequence {b}: a split with keys wrote none"
        assert part[b, :, used:].isnan().all(), f"sequence {b}: a split without keys wrote"


def test_decode_reads_strided_queries_and_fp16(seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table, kv_len = make_case(gen, [50, 9], 16, 2, 64, 64, torch.float16)
    wide = torch.randn(2, 8, 96, generator=gen).to(torch.float16)
    q = wide[:, :, 16:80]  # not contiguous: row stride 768, head stride 96
    cu = torch.arange(3, dtype=torch.int32)
    want = reference(q, k_cache, v_cache, table, cu, kv_len, 16, 0.125, None)
    qd = wide.to(DEVICE)[:, :, 16:80]
    kd, vd, td, ld = to_device(k_cache, v_cache, table, kv_len)
    check(backend_decode(qd, kd, vd, td, ld, 16, 0.125), want, torch.float16)


PREFILL_CASES = {
    # name: (n_q, kv_len) per sequence, block_size, Hq, Hkv, D, Dv, cache dtype, mla, window
    "gqa": ([(1, 1), (17, 40), (40, 40), (5, 133)], 16, 8, 2, 64, 64, torch.bfloat16, False, None),
    "gqa-window": ([(30, 90), (3, 3), (20, 20)], 16, 8, 4, 64, 64, torch.bfloat16, False, 12),
    "gqa-fp8-bs64": ([(9, 100), (70, 70)], 64, 4, 1, 128, 128, torch.float8_e4m3fn, False, None),
    "mla": ([(6, 70), (1, 9), (20, 20)], 16, 16, 1, 576, 512, torch.bfloat16, True, None),
    "mla-fp8": ([(3, 40), (12, 12)], 64, 8, 1, 576, 512, torch.float8_e4m3fn, True, None),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_prefill_matches_reference(name, dtype, seed):
    seqs, block_size, hq, hkv, d, dv, cache_dtype, mla, window = PREFILL_CASES[name]
    gen = torch.Generator().manual_seed(seed)
    n_q = [n for n, _ in seqs]
    case = make_case(gen, [n for _, n in seqs], block_size, hkv, d, dv, cache_dtype, mla)
    k_cache, v_cache, table, kv_len = case
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(n_q), hq, d, generator=gen).to(dtype)
    scale = d**-0.5
    want = reference(q, k_cache, v_cache, table, cu, kv_len, block_size, scale, window)
    qd, kd, td, cd, ld = to_device(q, k_cache, table, cu, kv_len)
    vd = kd[..., :dv] if mla else v_cache.to(DEVICE)
    got = at.paged_prefill(qd, kd, vd, td, cd, ld, block_size, scale, window)
    check(got, want, dtype)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "all-keys"])
def test_prefill_log_sum_exp_and_all_keys(causal, impl, seed):
    """causal=False: each query sees all of its sequence's keys; lse: each row's log-sum-exp of
    its scaled scores in base 2; against float64 from the same scores. The kernel and the torch
    reference (paged_attention.py) alike."""
    prefill = at.paged_prefill if impl == "triton" else paged_prefill
    gen = torch.Generator().manual_seed(seed + int(causal))
    seqs = [(5, 40), (17, 17), (1, 3)]
    k_cache, v_cache, table, kv_len = make_case(gen, [n for _, n in seqs], 16, 2, 32, 16,
                                                torch.float32)  # fmt: skip
    n_q = [n for n, _ in seqs]
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(n_q), 4, 32, generator=gen)
    scale = 0.3
    want_out, want_lse = [], []
    for i, (n, length) in enumerate(seqs):
        pos = torch.arange(length)
        slots = table[i].long()[pos // 16] * 16 + pos % 16
        keys = k_cache[slots].double().repeat_interleave(2, dim=1)  # [K, Hq, D]
        values = v_cache[slots].double().repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[i] : cu[i + 1]].double(), keys) * scale
        if causal:
            q_pos = torch.arange(length - n, length)
            scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        want_out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        want_lse.append((scores.logsumexp(-1) / torch.log(torch.tensor(2.0))).T)  # [n, Hq]
    qd, kd, vd, td, cd, ld = to_device(q, k_cache, v_cache, table, cu, kv_len)
    lse = torch.empty(sum(n_q), 4, dtype=torch.float32, device=DEVICE)
    got = prefill(qd, kd, vd, td, cd, ld, 16, scale, causal=causal, lse=lse)
    check(got, torch.cat(want_out), torch.float32)
    assert (lse.cpu().double() - torch.cat(want_lse)).abs().max().item() < 1e-4


def test_prefill_tiles_that_span_heads_and_queries(seed):
    """Small query tiles and head tiles that split a group still cover every row once."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table, kv_len = make_case(gen, [45, 8], 16, 2, 32, 32, torch.float32)
    cu = torch.tensor([0, 13, 21], dtype=torch.int32)
    q = torch.randn(21, 12, 32, generator=gen)
    want = reference(q, k_cache, v_cache, table, cu, kv_len, 16, 0.2, None)
    tiles = at.Tiles(block_h=4, block_n=16, num_warps=4, num_stages=1, block_q=4)
    qd, kd, vd, td, cd, ld = to_device(q, k_cache, v_cache, table, cu, kv_len)
    check(at.prefill_with(qd, kd, vd, td, cd, ld, 16, 0.2, tiles=tiles), want, torch.float32)


def test_rejects_mismatched_inputs():
    q = torch.zeros(2, 4, 32, device=DEVICE)
    cache = torch.zeros(64, 2, 32, device=DEVICE)
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    kv_len = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="int32"):
        backend_decode(q, cache, cache, table.long(), kv_len, 16, 1.0)
    with pytest.raises(ValueError, match="multiple of"):
        backend_decode(torch.zeros(2, 3, 32, device=DEVICE), cache, cache, table, kv_len, 16, 1.0)
    with pytest.raises(ValueError, match="head dim"):
        backend_decode(torch.zeros(2, 4, 16, device=DEVICE), cache, cache, table, kv_len, 16, 1.0)
    with pytest.raises(ValueError, match="share B"):
        backend_decode(q, cache, cache, table[:1], kv_len, 16, 1.0)
    with pytest.raises(ValueError, match="window"):
        backend_decode(q, cache, cache, table, kv_len, 16, 1.0, window=0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        at.paged_prefill(q, cache, cache, table, kv_len, kv_len, 16, 1.0)


def test_wide_heads_of_float32_queries_get_smaller_tiles():
    """MLA's 576-wide heads in float32 at 64 heads x 32 keys need 258 KB of shared memory on the
    H200 (227 KB there): its decode tiles shrink for 4-byte queries only."""
    assert at.decode_tiles(576, 128) == at.Tiles(block_h=64, block_n=64, num_warps=8, num_stages=2)
    wide = at.decode_tiles(576, 40, elem_bytes=4)
    assert wide.block_h <= 32 and wide.block_n == 16
    assert at.decode_tiles(128, 8, elem_bytes=4) == at.decode_tiles(128, 8)


def test_split_count_depends_on_shapes_only():
    assert at.num_decode_splits(1, 4, 32768, 132) == 128
    assert at.num_decode_splits(1, 4, 1 << 20, 132) == 128  # 2 waves: 264 / 4 programs, rounded up
    assert at.num_decode_splits(1, 1, 1 << 20, 132) == at.MAX_SPLITS
    assert at.num_decode_splits(16, 4, 32768, 132) == 8  # 2 waves of 132 SMs: 264 / 64 programs
    assert at.num_decode_splits(1, 4, 300, 132) == 1  # never under MIN_KEYS_PER_SPLIT keys each
    assert at.num_decode_splits(64, 32, 1 << 20, 132) == 1


def test_splits_write_less_than_they_read():
    """A split reads at least twice the bytes of the partial output it writes: MLA's 128 heads
    of 512 float32 columns (256 KB a split) keep 512 keys a split (1,152 bytes each in bf16,
    576 in fp8), GQA's 8 x 128 columns only the floor of MIN_KEYS_PER_SPLIT."""
    mla, gqa = at._HeadDims.of(576, 512), at._HeadDims.of(128, 128)
    for key_bytes, keys in ((1152, 512), (576, 1024)):
        min_keys = at.min_keys_per_split(128, mla, key_bytes)
        assert min_keys == keys
        assert 2 * 128 * 512 * 4 <= min_keys * key_bytes < 4 * 128 * 512 * 4
    assert at.num_decode_splits(1, 2, 32768, 132, at.min_keys_per_split(128, mla, 1152)) == 64
    assert at.min_keys_per_split(8, gqa, 512) <= at.MIN_KEYS_PER_SPLIT
    assert at.num_decode_splits(1, 4, 32768, 132, at.min_keys_per_split(8, gqa, 512)) == 128


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")
def test_decode_replays_in_a_cuda_graph(seed):
    """Captured once, replayed with new lengths, tables and queries: equal to eager calls."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, _, table, kv_len = make_case(gen, [700, 33, 1], 64, 1, 576, 512, torch.bfloat16, True)
    kd, td, ld = to_device(k_cache, table, kv_len)
    qd = torch.randn(3, 128, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    backend_decode(qd, kd, kd[..., :512], td, ld, 64, 0.1)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend_decode(qd, kd, kd[..., :512], td, ld, 64, 0.1)
    for step in range(3):
        ld.copy_(torch.tensor([700 - 90 * step, 33 + step, 1 + 40 * step], dtype=torch.int32))
        td.copy_(td[:, torch.randperm(td.shape[1], generator=gen).to(DEVICE)])
        qd.copy_(torch.randn(qd.shape, generator=gen).to(torch.bfloat16))
        graph.replay()
        eager = backend_decode(qd, kd, kd[..., :512], td, ld, 64, 0.1)
        assert torch.equal(out, eager), f"replay {step} differs from the eager call"
        cu = torch.arange(4, dtype=torch.int32)
        latent = k_cache[..., :512]
        want = reference(qd.cpu(), k_cache, latent, td.cpu(), cu, ld.cpu(), 64, 0.1, None)
        check(out, want, torch.bfloat16)


def compiled_variants(kernel) -> int:
    """How many specializations of a Triton kernel this process compiled (on any device)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.skipif(not HAS_CUDA, reason="counts compiled kernels: needs CUDA")
def test_a_new_mix_of_sequences_compiles_nothing(seed):
    """Prefill and decode over 1, 8, 16 and 3 sequences, block tables 3, 21, 16 and 71 wide and
    1 to 4 decode splits (== 1, a multiple of 16, neither: the classes Triton specializes
    integers on): after the first mix no kernel compiles again (a compile mid-serving stalls
    every running request for a second or more)."""
    gen = torch.Generator().manual_seed(seed)
    kernels = (at._prefill_kernel, at._decode_split_kernel, at._decode_merge_kernel)
    after_first = None
    for num_seqs, longest in ((1, 16), (8, 300), (16, 224), (3, 1100)):
        kv_lens = [longest] + [int(x) for x in torch.randint(1, longest + 1, (num_seqs - 1,),
                                                              generator=gen)]  # fmt: skip
        k_cache, v_cache, table, kv_len = make_case(gen, kv_lens, 16, 2, 64, 64, torch.bfloat16)
        n_q = [min(n, 5) for n in kv_lens]
        cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(n_q), 8, 64, generator=gen).to(torch.bfloat16)
        kd, vd, td, cd, ld, qd = to_device(k_cache, v_cache, table, cu, kv_len, q)
        qd_decode = torch.randn(num_seqs, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
        want = reference(q, k_cache, v_cache, table, cu, kv_len, 16, 0.125, None)
        check(at.paged_prefill(qd, kd, vd, td, cd, ld, 16, 0.125), want, torch.bfloat16)
        backend_decode(qd_decode, kd, vd, td, ld, 16, 0.125)
        counts = [compiled_variants(k) for k in kernels]
        if after_first is None:
            after_first = counts
        # the merge runs only where a context takes several splits: its first compile may come
        assert counts[:2] == after_first[:2], (num_seqs, tuple(table.shape), counts)
        assert counts[2] <= after_first[2] + 1


def test_the_unspecialized_arguments_are_the_kernels_own():
    """Triton ignores a do_not_specialize name that is no parameter of the kernel (silently: the
    kernel would recompile per integer class again), so each name must be one of its arguments;
    and the per-step integers are among them."""
    from gpu_service.experts import device_kernels
    from gpu_service.layers import weight_only_triton

    kernels = {at._prefill_kernel: {"num_seqs", "stride_bt"},
               at._decode_split_kernel: {"num_splits", "stride_bt", "stride_lh"},
               at._decode_merge_kernel: {"num_splits", "stride_lh"},
               device_kernels._post_kernel: {"num_x", "num_routes"},
               device_kernels._collect_kernel: {"num_out"},
               weight_only_triton._weight_only_mm_kernel: {"M"}}  # fmt: skip
    for kernel, per_step in kernels.items():
        names = getattr(kernel, "do_not_specialize", None)
        if names is None:  # under the interpreter (no CUDA): the decorator's arguments
            names = kernel.kwargs["do_not_specialize"]
        assert set(names) <= set(kernel.arg_names), (kernel, set(names) - set(kernel.arg_names))
        assert per_step <= set(names), kernel
