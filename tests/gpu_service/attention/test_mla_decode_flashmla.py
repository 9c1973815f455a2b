"""FlashMLA (mla_decode_flashmla, the sgl-flash-mla package), named or as the AttentionBackend's
choice, against the naive float64 reference (tests/support): MLA's latent cache of 64-token
blocks (the value a view of the key's first 512 columns) at ragged lengths, shuffled block tables
wider than needed, 16, 64 and 128 heads, replays of one CUDA graph at new lengths, and the choice
of the server's cache blocks. The kernels need a Hopper GPU with the package installed;
everywhere, the refusals and the block-size choice are checked (on a machine without them, what
they say)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from gpu_service.attention import attention_triton as at  # noqa: E402
from gpu_service.attention import mla_decode_flashmla as flashmla  # noqa: E402
from gpu_service.models.registry import DEFAULT_BLOCK_SIZE, choose_attention  # noqa: E402
from ktserve.checkpoint import HFConfig  # noqa: E402
from tests.support.attention_cases import backend_decode, check, make_case  # noqa: E402
from tests.support.attention_reference import reference  # noqa: E402

CUDA = torch.device("cuda")
SERVES = torch.cuda.is_available() and not flashmla.refusal(
    CUDA, torch.bfloat16, torch.bfloat16, flashmla.HEAD_DIM
)
needs_flashmla = pytest.mark.skipif(
    not SERVES, reason=f"needs a Hopper GPU with {flashmla.PACKAGE} that loads"
)
BLOCK = flashmla.BLOCK_SIZE
CASES = {
    # name: kv_lens, heads
    "ragged-128-heads": ([1, 63, 64, 65, 1000], 128),
    "one-long-64-heads": ([4099], 64),
    "batch-16-16-heads": ([7 + 97 * i for i in range(16)], 16),
}


def mla_case(name, seed, device="cuda"):
    kv_lens, heads = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    k_cache, _, table, kv_len = make_case(gen, kv_lens, BLOCK, 1, 576, 512, dtype, mla=True)
    q = torch.randn(len(kv_lens), heads, 576, generator=gen).to(dtype)
    cu = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    want = reference(q, k_cache, k_cache[..., :512], table, cu, kv_len, BLOCK, 0.07, None)
    kd = k_cache.to(device)
    args = (q.to(device), kd, kd[..., :512], table.to(device), kv_len.to(device), BLOCK, 0.07)
    return args, want


@needs_flashmla
@pytest.mark.parametrize("name", list(CASES))
def test_flashmla_decode_matches_reference(name, seed):
    args, want = mla_case(name, seed)
    got = flashmla.decode_checked(*args)
    check(got, want, torch.bfloat16)


@needs_flashmla
def test_auto_takes_flashmla_at_64_token_blocks(seed):
    """The AttentionBackend's decode gives FlashMLA's output exactly; a launch shape named by
    the caller keeps the split kernels."""
    args, want = mla_case("ragged-128-heads", seed)
    ours = flashmla.decode_checked(*args)
    assert torch.equal(backend_decode(*args), ours)
    split = at.decode_with(*args, num_splits=7)
    check(split, want, torch.bfloat16)


@needs_flashmla
def test_flashmla_replays_in_a_cuda_graph_at_new_lengths(seed):
    """Captured once, replayed after the lengths, the block table and the queries change in
    place: FlashMLA plans its splits from kv_len inside the captured call."""
    args, _ = mla_case("ragged-128-heads", seed)
    q, kd, vd, table, kv_len, block_size, scale = args
    flashmla.decode_checked(*args)  # NOTE: loads the library before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashmla.decode_checked(*args)
    gen = torch.Generator().manual_seed(seed + 1)
    q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
    kv_len.copy_(torch.tensor([1000, 2, 129, 1, 64], dtype=torch.int32))
    table.copy_(table.flip(0))
    for _ in range(2):
        graph.replay()
        cu = torch.arange(6, dtype=torch.int32)
        k_cpu = kd.cpu()
        want = reference(q.cpu(), k_cpu, k_cpu[..., :512], table.cpu(), cu, kv_len.cpu(),
                         block_size, scale, None)  # fmt: skip
        check(out, want, torch.bfloat16)
        kv_len.copy_(torch.tensor([3, 700, 64, 65, 1], dtype=torch.int32))


@needs_flashmla
def test_a_steps_layers_share_one_schedule_in_a_cuda_graph(seed):
    """Three layers' calls over caches of their own and one kv_len, given one plans dict (as a
    step's layers get their group's): the first plans the splits inside the captured graph, the
    others read its schedule; each replay at new lengths matches the reference in every layer,
    and the dict holds one schedule."""
    args, _ = mla_case("ragged-128-heads", seed)
    q, kd, vd, table, kv_len, block_size, scale = args
    gen = torch.Generator().manual_seed(seed + 2)
    caches = [kd] + [torch.randn(kd.shape, generator=gen).to(kd) for _ in range(2)]
    plans_seen = []

    def step():
        plans = {}
        plans_seen.append(plans)
        return [backend_decode(q, k, k[..., :512], table, kv_len, block_size, scale,
                               plans=plans) for k in caches]  # fmt: skip

    step()  # NOTE: loads the library before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    assert len(plans_seen[-1]) == 1
    cu = torch.arange(6, dtype=torch.int32)
    for lens in ([1000, 2, 129, 1, 64], [3, 700, 64, 65, 1]):
        kv_len.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        for k, out in zip(caches, outs):
            k_cpu = k.cpu()
            want = reference(q.cpu(), k_cpu, k_cpu[..., :512], table.cpu(), cu, kv_len.cpu(),
                             block_size, scale, None)  # fmt: skip
            check(out, want, torch.bfloat16)


def test_flashmla_refuses_what_it_cannot_serve(seed):
    """A 16-token-block cache, an fp16 query, or a machine without FlashMLA: ValueErrors that
    say what it takes (and, where it cannot load, why); a launch shape has no argument to name
    it by (it splits and merges by itself)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args, _ = mla_case("ragged-128-heads", seed, device)
    q, kd, vd, table, kv_len, block_size, scale = args
    with pytest.raises(TypeError, match="num_splits"):
        flashmla.decode_checked(*args, num_splits=4)
    with pytest.raises(TypeError, match="partial_dtype"):
        flashmla.decode_checked(*args, partial_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="64-token blocks"):
        flashmla.decode_checked(q, kd, vd, table * 4, kv_len, 16, scale)
    with pytest.raises(ValueError, match="64-token blocks"):
        flashmla.decode_checked(q.half(), kd.half(), vd.half(), table, kv_len, block_size, scale)
    if not SERVES:
        with pytest.raises(ValueError, match=flashmla.PACKAGE):
            flashmla.decode_checked(*args)


def hf_config(model_type: str, **fields) -> HFConfig:
    return HFConfig({"model_type": model_type, **fields}, "test config.json")


def kv_cache_block_size(hf, device, dtype, kv_dtype, flashmla=True) -> tuple[int, str]:
    """(the KV cache's block size, the start-up line's words) of the backend chosen for hf."""
    attention = choose_attention(hf, device, dtype, kv_dtype, flashmla=flashmla)
    return attention.block_size, attention.mla_decode


def test_the_cache_block_size_follows_the_mla_decode_kernel():
    """64-token blocks exactly where FlashMLA serves the model's MLA decode and KTSERVE_FLASHMLA=0
    is not set, else the default; the start-up line names the kernel and, where FlashMLA does not
    serve, why."""
    bf16 = torch.bfloat16
    qwen = hf_config("qwen3_moe")
    assert kv_cache_block_size(qwen, "cpu", bf16, bf16) == (DEFAULT_BLOCK_SIZE, "")
    deepseek = hf_config("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64)
    block, said = kv_cache_block_size(deepseek, "cpu", bf16, bf16)
    assert (block, said) == (DEFAULT_BLOCK_SIZE, "ktserve's own kernels (not on a CUDA device)")
    narrow = hf_config("deepseek_v3", kv_lora_rank=32, qk_rope_head_dim=16)
    assert kv_cache_block_size(narrow, "cpu", bf16, bf16)[0] == DEFAULT_BLOCK_SIZE
    assert kv_cache_block_size(deepseek, "cpu", bf16, bf16, flashmla=False) == (
        DEFAULT_BLOCK_SIZE,
        "ktserve's own kernels (FlashMLA off: KTSERVE_FLASHMLA=0)",
    )
    if torch.cuda.is_available():
        block, said = kv_cache_block_size(deepseek, CUDA, bf16, bf16)
        assert (block == BLOCK) == SERVES, said
        assert said.startswith("FlashMLA") == SERVES, said
        off = kv_cache_block_size(deepseek, CUDA, bf16, bf16, flashmla=False)
        off_said = "ktserve's own kernels (FlashMLA off: KTSERVE_FLASHMLA=0)"
        assert off == (DEFAULT_BLOCK_SIZE, off_said)
        block, said = kv_cache_block_size(narrow, CUDA, bf16, bf16)
        assert block == DEFAULT_BLOCK_SIZE
        assert not SERVES or "this model's are 48" in said, said
        fp8 = kv_cache_block_size(deepseek, CUDA, bf16, torch.float8_e4m3fn)
        assert fp8[0] == DEFAULT_BLOCK_SIZE and "ktserve's own kernels" in fp8[1]


def test_unavailable_library_says_why():
    """Where the package is missing or does not load, the reason names it; where it loads,
    there is none."""
    why = flashmla.unavailable_reason()
    assert (flashmla.library() is None) == bool(why)
    if why:
        assert flashmla.PACKAGE in why


@pytest.mark.parametrize(
    "init, says",
    [
        ("raise OSError('libcudart.so.13: cannot open shared object file')",
         "does not load: OSError: libcudart.so.13"),
        ("__version__ = '9.9'\ndef has_legacy():\n    return False", "9.9 has no SM90"),
        ("__version__ = '9.8'", "9.8 has no SM90"),
    ],
    ids=["does-not-load", "no-legacy-kernels", "no-has-legacy"],
)  # fmt: skip
def test_a_package_that_cannot_serve_is_unavailable_with_its_reason(init, says, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    """A flash_mla package that fails to import, or has no SM90 kernels, is not used, and the
    reason (which the start-up line and decode_checked's refusal give) says why."""
    (tmp_path / "flash_mla").mkdir()
    (tmp_path / "flash_mla" / "__init__.py").write_text(init + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    flashmla._load.cache_clear()
    try:
        assert flashmla.library() is None
        assert says in flashmla.unavailable_reason()
    finally:
        sys.modules.pop("flash_mla", None)
        flashmla._load.cache_clear()
