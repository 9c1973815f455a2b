"""mla_decode_hopper's split kernel (Gluon, Hopper GPUs) against the naive float64 reference
(tests/support), through attention_triton.decode_with(hopper=True): MLA's latent cache (the value
a view of the key's first 512 columns) at ragged lengths, block sizes 16 and 64, shuffled block
tables wider than needed, 64 and 128 heads, its launch shapes, many splits (most past a short
context), and the AttentionBackend's choice of it. Those need a Hopper GPU; without one, the
kernel is still compiled for sm_90 at each launch shape (Triton's own compiler and ptxas, no GPU
needed), so a Triton release that cannot build it, or a shape past Hopper's shared memory, fails
here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from gpu_service.attention import attention_triton as at  # noqa: E402
from gpu_service.attention import mla_decode_flashmla  # noqa: E402
from gpu_service.attention.backend import AttentionBackend  # noqa: E402
from tests.support.attention_cases import check, make_case  # noqa: E402
from tests.support.attention_reference import reference  # noqa: E402

if at.mla_decode_hopper is None:
    pytest.skip("this Triton has no Gluon (Hopper) language", allow_module_level=True)

HOPPER = torch.cuda.is_available() and at.mla_decode_hopper.supported_device(torch.device("cuda"))
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
HOPPER_SHARED_MEMORY = 232_448  # bytes a block may take on sm_90
ROOT = Path(__file__).resolve().parents[3]

CASES = {
    # name: kv_lens, block_size, heads, dtype
    "ragged-bs16": ([1, 37, 300, 1025], 16, 64, torch.bfloat16),
    "ragged-bs64-128-heads": ([130, 5, 64], 64, 128, torch.bfloat16),
    "one-long-fp16": ([4099], 16, 128, torch.float16),
}
SHAPES = [at.Tiles(64, n, 8, stages) for n, stages in sorted(at.mla_decode_hopper.LAUNCH_SHAPES)]


def mla_case(name, seed):
    kv_lens, block_size, heads, dtype = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    k_cache, _, table, kv_len = make_case(gen, kv_lens, block_size, 1, 576, 512, dtype, mla=True)
    q = torch.randn(len(kv_lens), heads, 576, generator=gen).to(dtype)
    cu = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    want = reference(q, k_cache, k_cache[..., :512], table, cu, kv_len, block_size, 0.07, None)
    kd = k_cache.cuda()
    args = (q.cuda(), kd, kd[..., :512], table.cuda(), kv_len.cuda(), block_size, 0.07)
    return args, want, dtype


COMPILE_FOR_SM90 = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.experimental.gluon._runtime import GluonASTSource
from gpu_service.attention import mla_decode_hopper

block_n, stages, partials = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
fn = mla_decode_hopper._mla_split_kernel
pointers = {"q": "*bf16", "cache": "*bf16", "block_table": "*i32", "kv_len": "*i32",
            "part_out": partials, "part_lse": "*fp32"}
constexprs = {"BLOCK_N": block_n, "STAGES": stages, "OVERLAP": stages >= 3}
signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
             for name in fn.arg_names}
signature["qk_scale"] = "fp32"
index = {name: i for i, name in enumerate(fn.arg_names)}
aligned = [*pointers, "stride_qb", "stride_qh", "stride_cs"]  # as the launcher sees them
attrs = {(index[name],): [["tt.divisibility", 16]] for name in aligned}
kernel = triton_compile(GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print(json.dumps({"cubin_bytes": len(kernel.asm["cubin"]), "shared": kernel.metadata.shared}))
"""


@pytest.mark.parametrize(
    "tiles, partials",
    [(t, "*fp32") for t in SHAPES] + [(at.HOPPER_MLA_TILES, "*bf16")],
    ids=lambda v: f"n{v.block_n}s{v.num_stages}" if isinstance(v, at.Tiles) else v[1:],
)
def test_hopper_kernel_compiles_for_sm90(tiles, partials):
    """The kernel's launch shapes build for sm_90 (bf16, float32 or bf16 partial outputs) within
    Hopper's shared memory. In a process of its own: where there is no GPU, this one runs
    Triton interpreted (conftest)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    args = [sys.executable, "-c", COMPILE_FOR_SM90, str(tiles.block_n), str(tiles.num_stages),
            partials]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert built["cubin_bytes"] > 0
    assert 0 < built["shared"] <= HOPPER_SHARED_MEMORY


@pytest.mark.parametrize(
    "tiles",
    [at.Tiles(32, 64, 8, 2), at.Tiles(64, 64, 4, 2), at.Tiles(64, 64, 8, 3),
     at.Tiles(64, 64, 8, 2, block_dv=256)],
    ids=["32-heads", "4-warps", "n64s3", "value-blocks"],
)  # fmt: skip
def test_launch_shapes_the_kernel_does_not_run_are_refused(tiles):
    hopper = at.mla_decode_hopper
    with pytest.raises(ValueError, match="Hopper MLA kernel runs"):
        hopper.check_launch(tiles.block_h, tiles.block_n, tiles.num_warps, tiles.num_stages,
                            tiles.block_dv)  # fmt: skip
    for t in SHAPES:
        hopper.check_launch(t.block_h, t.block_n, t.num_warps, t.num_stages, t.block_dv)


@needs_hopper
@pytest.mark.parametrize("tiles", SHAPES, ids=lambda t: f"n{t.block_n}s{t.num_stages}")
@pytest.mark.parametrize("name", list(CASES))
def test_hopper_decode_matches_reference(name, tiles, seed):
    args, want, dtype = mla_case(name, seed)
    got = at.decode_with(*args, tiles=tiles, hopper=True)
    check(got, want, dtype)


@needs_hopper
@pytest.mark.parametrize("partials", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 7, 64])
def test_hopper_decode_splits_merge(num_splits, partials, seed):
    """Any key partition, splits past a sequence's end (no keys) among them, and partial
    outputs in float32 or bf16."""
    args, want, dtype = mla_case("ragged-bs16", seed + num_splits)
    got = at.decode_with(*args, num_splits=num_splits, hopper=True, partial_dtype=partials)
    check(got, want, dtype)


@needs_hopper
def test_hopper_kernel_agrees_with_triton_and_auto_follows_the_switch(seed):
    """Within rounding of attention_triton's own split kernel; the AttentionBackend a model of
    these shapes gets gives FlashMLA's output exactly where FlashMLA serves the call (this case's
    64-token blocks, where sgl-flash-mla is installed), else the Hopper kernel's exactly where
    the backend has it (hopper_mla)."""
    args, want, dtype = mla_case("ragged-bs64-128-heads", seed)
    hopper = at.decode_with(*args, hopper=True)
    triton_out = at.decode_with(*args)
    check(hopper, want, dtype)
    check(triton_out, want, dtype)
    q, k_cache, _, _, _, block_size, _ = args
    backend = AttentionBackend.choose(q.device, q.dtype, k_cache.dtype, k_cache.shape[-1])
    if not mla_decode_flashmla.call_refusal(q, k_cache, True, None, block_size):
        expected = mla_decode_flashmla.decode_checked(*args)
    else:
        expected = hopper if backend.hopper_mla else triton_out
    assert torch.equal(backend.gpu_decode(*args), expected)


@needs_hopper
def test_hopper_decode_replays_in_a_cuda_graph(seed):
    """Captured once, replayed after the lengths and the queries change in place."""
    args, _, dtype = mla_case("ragged-bs16", seed)
    q, kd, vd, table, kv_len, block_size, scale = args
    at.decode_with(*args, hopper=True)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = at.decode_with(*args, hopper=True)
    gen = torch.Generator().manual_seed(seed + 1)
    q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
    kv_len.copy_(torch.tensor([300, 2, 1025, 64], dtype=torch.int32))
    graph.replay()
    cu = torch.arange(5, dtype=torch.int32)
    k_cpu = kd.cpu()
    want = reference(q.cpu(), k_cpu, k_cpu[..., :512], table.cpu(), cu, kv_len.cpu(),
                     block_size, scale, None)  # fmt: skip
    check(out, want, dtype)


@needs_hopper
def test_hopper_kernel_refuses_what_it_cannot_serve(seed):
    args, _, _ = mla_case("ragged-bs16", seed)
    q, kd, vd, table, kv_len, block_size, scale = args
    with pytest.raises(ValueError, match="Hopper MLA decode kernel"):
        at.decode_with(q[:, :40].contiguous(), kd, vd, table, kv_len, block_size, scale,
                       hopper=True)  # fmt: skip
    with pytest.raises(ValueError, match="Hopper MLA decode kernel"):
        fp8 = kd.to(torch.float8_e4m3fn)
        at.decode_with(q, fp8, fp8[..., :512], table, kv_len, block_size, scale, hopper=True)
    for tiles in (at.Tiles(32, 64, 8, 2), at.Tiles(64, 64, 4, 2), at.Tiles(64, 64, 8, 3)):
        with pytest.raises(ValueError, match="Hopper MLA kernel runs"):
            at.decode_with(*args, tiles=tiles, hopper=True)
