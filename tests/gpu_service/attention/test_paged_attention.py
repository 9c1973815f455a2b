"""The torch reference of paged attention (decode, ragged prefill, a mixed step) against a naive
float64 attention written here: per sequence, per query, over the keys read slot by slot through
the sequence's block list. Random shapes (GQA groups, MLA's one 576-wide kv head with the values
its first 512 columns), sliding windows, ragged lengths, shuffled non-contiguous blocks with the
rest of the cache full of noise, and an FP8 cache."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from gpu_service.attention import backend as attention_backend
from gpu_service.attention import paged_attention as pa
from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.batch import AttentionMetadata, Batch, SeqInput
from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.kvcache.tensors import KVCacheTensors, write_cache

FP8 = torch.float8_e4m3fn
TORCH_REFERENCE = AttentionBackend()  # a CPU's backend: the reference runs every call


def naive_attention(q, k_cache, v_cache, blocks, num_queries, kv_lens, block_size, scale,
                    window=None) -> torch.Tensor:  # fmt: skip
    """q [T, Hq, D] (sequence after sequence) -> [T, Hq, Dv] float64."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    head_kv = torch.arange(num_heads) // (num_heads // num_kv_heads)
    out, row = [], 0
    for ids, n, length in zip(blocks, num_queries, kv_lens):
        slots = [ids[p // block_size] * block_size + p % block_size for p in range(length)]
        keys = k_cache[slots].double()[:, head_kv]  # [L, Hq, D]
        values = v_cache[slots].double()[:, head_kv]  # [L, Hq, Dv]
        for j in range(n):
            pos = length - n + j
            seen = [p for p in range(length) if p <= pos and (window is None or p > pos - window)]
            scores = torch.einsum("hd,lhd->hl", q[row].double(), keys[seen]) * scale
            out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values[seen]))
            row += 1
    return torch.stack(out)


class Case:
    """A random cache (noise everywhere) and sequences on shuffled blocks of it."""

    def __init__(self, rng: random.Random, gen: torch.Generator, *, num_kv_heads: int,
                 groups: int, head_dim: int, v_dim: int, block_size: int,
                 num_queries: list[int], kv_lens: list[int], mla: bool = False,
                 cache_dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        self.block_size = block_size
        self.num_queries, self.kv_lens = num_queries, kv_lens
        needed = [-(-n // block_size) for n in kv_lens]
        num_blocks = sum(needed) + 3
        order = list(range(num_blocks))
        rng.shuffle(order)
        self.blocks, taken = [], 0
        for count in needed:
            self.blocks.append(order[taken : taken + count])
            taken += count
        slots = num_blocks * block_size
        k = torch.randn(slots, num_kv_heads, head_dim, generator=gen)
        if mla:
            self.k_cache = k.to(cache_dtype)
            self.v_cache = self.k_cache[..., :v_dim]
        else:
            self.k_cache = k.to(cache_dtype)
            self.v_cache = torch.randn(slots, num_kv_heads, v_dim, generator=gen).to(cache_dtype)
        width = max(needed) + 2  # wider than any sequence needs: the rest points at noise
        self.block_table = torch.tensor(
            [ids + [rng.randrange(num_blocks) for _ in range(width - len(ids))]
             for ids in self.blocks], dtype=torch.int32)  # fmt: skip
        self.q = torch.randn(sum(num_queries), num_kv_heads * groups, head_dim, generator=gen)
        self.scale = head_dim**-0.5

    def expected(self, window=None) -> torch.Tensor:
        return naive_attention(self.q, self.k_cache, self.v_cache, self.blocks, self.num_queries,
                               self.kv_lens, self.block_size, self.scale, window)  # fmt: skip

    def decode(self, window=None) -> torch.Tensor:
        kv_len = torch.tensor(self.kv_lens, dtype=torch.int32)
        return pa.paged_decode(self.q, self.k_cache, self.v_cache, self.block_table, kv_len,
                               self.block_size, self.scale, window)  # fmt: skip

    def prefill(self, window=None) -> torch.Tensor:
        cu = torch.tensor(
            [0, *torch.tensor(self.num_queries).cumsum(0).tolist()], dtype=torch.int32
        )
        kv_len = torch.tensor(self.kv_lens, dtype=torch.int32)
        return pa.paged_prefill(self.q, self.k_cache, self.v_cache, self.block_table, cu, kv_len,
                                self.block_size, self.scale, window)  # fmt: skip


def _shape(rng: random.Random) -> dict:
    return dict(num_kv_heads=rng.choice([1, 2, 4]), groups=rng.choice([1, 2, 3, 4]),
                head_dim=rng.choice([8, 16, 64]), v_dim=rng.choice([8, 16, 32]),
                block_size=rng.choice([1, 4, 16]))  # fmt: skip


MLA_SHAPE = dict(num_kv_heads=1, groups=16, head_dim=576, v_dim=512, mla=True)


@pytest.mark.parametrize("trial", range(6))
def test_decode_matches_naive(seed, trial) -> None:
    rng, gen = random.Random(seed + trial), torch.Generator().manual_seed(seed + trial)
    b = rng.randint(1, 6)
    case = Case(rng, gen, **_shape(rng), num_queries=[1] * b,
                kv_lens=[rng.randint(1, 70) for _ in range(b)])  # fmt: skip
    window = rng.choice([None, rng.randint(1, 20)])
    got = case.decode(window)
    assert got.shape == (b, case.q.shape[1], case.v_cache.shape[-1]) and got.dtype == case.q.dtype
    torch.testing.assert_close(got.double(), case.expected(window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trial", range(6))
def test_prefill_matches_naive(seed, trial) -> None:
    rng, gen = random.Random(seed + 100 + trial), torch.Generator().manual_seed(seed + 100 + trial)
    b = rng.randint(1, 4)
    num_queries = [rng.randint(1, 40) for _ in range(b)]
    kv_lens = [n + rng.choice([0, rng.randint(1, 30)]) for n in num_queries]  # cached before
    case = Case(rng, gen, **_shape(rng), num_queries=num_queries, kv_lens=kv_lens)
    window = rng.choice([None, rng.randint(1, 20)])
    torch.testing.assert_close(case.prefill(window).double(), case.expected(window), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_in_query_chunks(seed, monkeypatch, window) -> None:
    """A score budget smaller than one sequence's scores: the queries go in chunks (of 3 here),
    each against the keys it can see, and the result is the same."""
    rng, gen = random.Random(seed + 200), torch.Generator().manual_seed(seed + 200)
    case = Case(rng, gen, num_kv_heads=2, groups=2, head_dim=16, v_dim=16, block_size=4,
                num_queries=[29, 1, 17], kv_lens=[40, 9, 17])  # fmt: skip
    monkeypatch.setattr(pa, "PREFILL_SCORE_ELEMENTS", 4 * 3 * 40)
    torch.testing.assert_close(case.prefill(window).double(), case.expected(window), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_mla_shapes(seed) -> None:
    """One kv head 576 wide, values its first 512 columns (a view of the same cache)."""
    rng, gen = random.Random(seed + 300), torch.Generator().manual_seed(seed + 300)
    dec = Case(rng, gen, **MLA_SHAPE, block_size=16, num_queries=[1] * 3, kv_lens=[1, 37, 64])
    torch.testing.assert_close(dec.decode().double(), dec.expected(), rtol=1e-5, atol=1e-5)
    pre = Case(rng, gen, **MLA_SHAPE, block_size=16, num_queries=[20, 5], kv_lens=[20, 33])
    torch.testing.assert_close(pre.prefill().double(), pre.expected(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mla", [False, True])
def test_fp8_cache_is_read_upcast(seed, mla) -> None:
    """An FP8 cache: the same attention over the FP8 values, read as q's dtype."""
    rng, gen = random.Random(seed + 400), torch.Generator().manual_seed(seed + 400)
    shape = MLA_SHAPE if mla else dict(num_kv_heads=2, groups=4, head_dim=64, v_dim=64)
    dec = Case(rng, gen, **shape, block_size=16, num_queries=[1] * 4, kv_lens=[3, 50, 17, 64],
               cache_dtype=FP8)  # fmt: skip
    assert dec.k_cache.dtype == FP8
    torch.testing.assert_close(dec.decode().double(), dec.expected(), rtol=1e-5, atol=1e-5)
    pre = Case(rng, gen, **shape, block_size=16, num_queries=[30, 2], kv_lens=[30, 40],
               cache_dtype=FP8)  # fmt: skip
    torch.testing.assert_close(pre.prefill(8).double(), pre.expected(8), rtol=1e-5, atol=1e-5)


def test_bf16_is_close_to_float64(seed) -> None:
    """In bfloat16 (the GPU dtype) the reference stays within bf16 rounding of the exact result."""
    rng, gen = random.Random(seed + 500), torch.Generator().manual_seed(seed + 500)
    case = Case(rng, gen, num_kv_heads=2, groups=4, head_dim=64, v_dim=64, block_size=16,
                num_queries=[25, 9], kv_lens=[25, 60], cache_dtype=torch.bfloat16)  # fmt: skip
    case.q = case.q.bfloat16()
    got = case.prefill()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), case.expected(), rtol=0.02, atol=0.02)


def test_fp8_write_saturates(seed) -> None:
    """write_cache clamps to FP8's range (+-448) instead of overflowing to NaN, and rounds the
    rest to the nearest FP8 value."""
    gen = torch.Generator().manual_seed(seed + 600)
    values = torch.randn(8, 2, 16, generator=gen) * 300  # many beyond 448
    cache = torch.zeros(10, 2, 16, dtype=FP8)
    slots = torch.tensor([9, 0, 3, 4, 5, 6, 7, 1])
    write_cache(cache, slots, values)
    stored = cache[slots].float()
    assert torch.isfinite(stored).all()
    expected = values.clamp(-448, 448).to(FP8).float()
    torch.testing.assert_close(stored, expected, rtol=0, atol=0)
    assert (stored.abs() <= 448).all() and (stored.abs().amax() == 448)
    inside = values.abs() < 400
    rel = ((stored - values).abs() / values.abs().clamp_min(1e-3))[inside & (values.abs() > 1)]
    assert rel.max() <= 2**-4  # e4m3: 3 mantissa bits, half an ulp


def _real_step(
    rng: random.Random,
    gen: torch.Generator,
    shapes: list[tuple[int, int]],
    kv_heads: int,
    dim: int,
    block_size: int,
) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """A batch of sequences (new tokens, kv_len) on KVCacheManager blocks allocated in turns with
    filler ones (so their blocks interleave), and the layer's caches full of noise."""
    config = KVCacheConfig(1, ((kv_heads, dim), (kv_heads, dim)), 4096, block_size,
                           enable_prefix_caching=False)  # fmt: skip
    cache, tensors = KVCacheManager(config), KVCacheTensors(config, torch.float32, "cpu")
    seqs, filler = [], []
    for n, length in shapes:
        filler.append(cache.allocate(rng.randint(1, 9)))
        seq = cache.allocate(length)
        seq.num_tokens = length - n
        seqs.append(SeqInput([0] * n, seq, length - n))
    k_cache, v_cache = tensors.layers[0]
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    return Batch(tuple(seqs)), k_cache, v_cache


def _check_step(gen: torch.Generator, batch: Batch, meta: AttentionMetadata, k_cache, v_cache,
                heads: int, window: int | None) -> None:  # fmt: skip
    """A step's attention (AttentionBackend.attend) over its metadata against the naive
    attention of each sequence."""
    seqs, dim = batch.seqs, k_cache.shape[-1]
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen)
    got = TORCH_REFERENCE.attend(q, k_cache, v_cache, meta, dim**-0.5, window)
    expected = naive_attention(q, k_cache, v_cache, [s.cache.block_ids for s in seqs],
                               [len(s.token_ids) for s in seqs], [s.end_pos for s in seqs],
                               meta.block_size, dim**-0.5, window)  # fmt: skip
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _rows(group) -> list[int]:
    rows = group.rows
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()


def _decode_rows_by_width(batch: Batch, meta: AttentionMetadata) -> list[list[int]]:
    """Each decode group's block-table widths (its sequences' block counts), after checking that
    its table is as wide as its own longest sequence needs and that the groups hold every decode
    row once."""
    starts, bs = batch.cu_seqlens, meta.block_size
    widths, seen = [], []
    for group in meta.decodes:
        rows = _rows(group)
        counts = [-(-batch.seqs[starts.index(r)].end_pos // bs) for r in rows]
        assert group.block_table.shape == (len(rows), max(counts))
        assert group.kv_len.tolist() == [batch.seqs[starts.index(r)].end_pos for r in rows]
        widths.append(counts)
        seen += rows
    decode_rows = [starts[i] for i, s in enumerate(batch.seqs) if len(s.token_ids) == 1]
    assert sorted(seen) == decode_rows
    return widths


@pytest.mark.parametrize("interleaved", [False, True])
def test_mixed_step_splits_decodes_and_prefills(seed, interleaved) -> None:
    """AttentionMetadata of a real batch (KVCacheManager blocks, decodes and prompt chunks mixed, in
    either order) and paged_attention over it, against the naive attention of each sequence."""
    rng, gen = random.Random(seed + 700), torch.Generator().manual_seed(seed + 700)
    bs = 4
    shapes = [(1, 30), (23, 23), (1, 5), (12, 140), (1, 64), (1, 29)]  # (new tokens, kv_len)
    if not interleaved:
        shapes.sort(key=lambda s: s[0] > 1)
    batch, k_cache, v_cache = _real_step(rng, gen, shapes, kv_heads=2, dim=16, block_size=bs)
    meta = AttentionMetadata.build(batch, "cpu")
    assert meta.prefill is not None
    assert isinstance(meta.prefill.rows, slice) != interleaved
    # each group's block table as wide as its own longest sequence needs (not the step's)
    assert meta.prefill.block_table.shape[1] == -(-140 // bs)
    assert _decode_rows_by_width(batch, meta) == [[8, 8], [2], [16]]
    _check_step(gen, batch, meta, k_cache, v_cache, heads=4, window=9)


@pytest.mark.parametrize("window", [None, 50])
def test_cpu_decode_groups_by_width_class(seed, window) -> None:
    """One long context among short ones: on the CPU the metadata splits the decode rows by the
    power-of-two class of their block counts, each group's table at its own width, and the
    step's attention is every row's naive attention."""
    rng, gen = random.Random(seed + 900), torch.Generator().manual_seed(seed + 900)
    kv_lens = [3, 700, 40, 1, 160, 700, 17, 13]
    rng.shuffle(kv_lens)
    batch, k_cache, v_cache = _real_step(rng, gen, [(1, n) for n in kv_lens], kv_heads=2,
                                         dim=16, block_size=4)  # fmt: skip
    meta = AttentionMetadata.build(batch, "cpu")
    assert meta.prefill is None
    widths = _decode_rows_by_width(batch, meta)
    assert sorted(sorted(w) for w in widths) == [[1, 1], [4, 5], [10], [40], [175, 175]]
    _check_step(gen, batch, meta, k_cache, v_cache, heads=4, window=window)


def test_decode_stays_one_group_off_the_cpu(seed) -> None:
    """Elsewhere (CUDA: the one group a decode graph captures) the decode rows stay one group as
    wide as the step's longest (built here on the meta device, which needs no GPU)."""
    rng, gen = random.Random(seed + 950), torch.Generator().manual_seed(seed + 950)
    shapes = [(1, 3), (1, 700), (5, 20), (1, 40)]
    batch, _, _ = _real_step(rng, gen, shapes, kv_heads=1, dim=8, block_size=4)
    meta = AttentionMetadata.build(batch, "meta")
    assert len(meta.decodes) == 1 and meta.decodes[0].block_table.is_meta
    assert meta.decodes[0].block_table.shape == (3, 175)
    assert meta.decodes[0].rows.shape == (3,) and meta.prefill.block_table.shape == (1, 5)


def test_a_steps_layers_hand_their_decode_kernel_one_plans_dict(seed, monkeypatch) -> None:
    """Every layer's decode call of a step gets its decode group's plans (where FlashMLA keeps
    the split schedule the step's first layer made), the same dict each time; the next step's
    metadata brings a new, empty one, so no plan outlives the kv_len it was made from."""
    rng, gen = random.Random(seed + 960), torch.Generator().manual_seed(seed + 960)
    shapes = [(1, 30), (1, 29), (1, 32)]  # one width class: one decode group on the CPU too
    batch, k_cache, v_cache = _real_step(rng, gen, shapes, kv_heads=2, dim=16, block_size=4)
    handed = []

    def decode(*args, plans=None):
        assert plans is not None
        plans.setdefault("made by call", len(handed))
        handed.append(plans)
        return pa.paged_decode(*args)

    monkeypatch.setattr(AttentionBackend, "kernels", lambda *a, **k: (decode, pa.paged_prefill))
    q = torch.randn(batch.num_tokens, 4, 16, generator=gen)
    layers = 3
    for step in range(2):
        meta = AttentionMetadata.build(batch, "cpu")
        assert len(meta.decodes) == 1 and meta.decodes[0].plans == {}
        outs = [TORCH_REFERENCE.attend(q, k_cache, v_cache, meta, 0.25) for _ in range(layers)]
        this_step = handed[step * layers :]
        assert all(plans is meta.decodes[0].plans for plans in this_step)
        assert meta.decodes[0].plans == {"made by call": step * layers}
        assert all(torch.equal(out, outs[0]) for out in outs)
    assert handed[0] is not handed[-1]


def test_dispatch_without_the_gpu_kernels(monkeypatch) -> None:
    """With attention_triton absent every device's backend gets the torch reference."""
    monkeypatch.setitem(sys.modules, attention_backend.TRITON_MODULE, None)  # an ImportError
    attention_backend.triton_kernels.cache_clear()
    try:
        assert attention_backend.triton_kernels() is None
        for device in ("cpu", "cuda", "cuda:1"):
            chosen = AttentionBackend.choose(torch.device(device), torch.bfloat16, torch.bfloat16)
            assert chosen.kernels() == (pa.paged_decode, pa.paged_prefill)
    finally:
        attention_backend.triton_kernels.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dispatch_on_cuda_uses_the_gpu_kernels_where_they_import() -> None:
    attention_backend.triton_kernels.cache_clear()
    kernels = attention_backend.triton_kernels()
    bf16 = torch.bfloat16
    cuda = AttentionBackend.choose(torch.device("cuda"), bf16, bf16)
    expected = (pa.paged_decode, pa.paged_prefill)
    if kernels is not None:
        expected = (cuda.gpu_decode, kernels.paged_prefill)
    assert cuda.kernels() == expected
    # MLA's latent prefill stays on the torch reference (measured faster there)
    latent = cuda.kernels(latent=True)
    assert latent == (expected[0], pa.paged_prefill)
    # heads narrower than the kernels' tiles (the tiny test checkpoints) take the reference
    assert cuda.kernels(head_dim=12) == (
        pa.paged_decode,
        pa.paged_prefill,
    )
    cpu = AttentionBackend.choose(torch.device("cpu"), bf16, bf16)
    assert cpu.kernels() == (pa.paged_decode, pa.paged_prefill)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mla", [False, True])
def test_reference_on_cuda_matches_naive(seed, mla) -> None:
    """The reference on CUDA tensors (the GPU path while attention_triton is absent)."""
    rng, gen = random.Random(seed + 800), torch.Generator().manual_seed(seed + 800)
    shape = MLA_SHAPE if mla else dict(num_kv_heads=2, groups=4, head_dim=64, v_dim=64)
    case = Case(rng, gen, **shape, block_size=16, num_queries=[17, 3], kv_lens=[40, 3])
    expected = case.expected(window=None)
    for name in ("q", "k_cache", "v_cache", "block_table"):
        setattr(case, name, getattr(case, name).cuda())
    if mla:
        case.v_cache = case.k_cache[..., :512]
    torch.testing.assert_close(case.prefill().double().cpu(), expected, rtol=1e-4, atol=1e-4)
