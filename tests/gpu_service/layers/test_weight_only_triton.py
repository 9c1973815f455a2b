"""The weight-only Triton matmul (int8 and fp8 weights, a scale per output) against float64 torch
of the dequantized weight, at row counts from a decode step's to a chunk's, output counts that no
tile divides, and every launch shape it picks. On CUDA compiled; without it, under Triton's
interpreter (tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from gpu_service.layers import weight_only_triton as wo  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TILES = [None, wo.MMTiles(16, 16, 32, num_warps=2, num_stages=2), wo.MMTiles(32, 64, 128),
         wo.GemvTiles(4, 64), wo.GemvTiles(8, 2048, num_warps=8)]  # fmt: skip


def quantized(gen: torch.Generator, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n, k), generator=gen).to(dtype)
    return (torch.randn(n, k, generator=gen) * 64).to(dtype)  # e4m3: |q| <= 448


@pytest.mark.parametrize("weight_dtype", wo.WEIGHT_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("shape", [(101, 200), (64, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("tiles", TILES, ids=["default", "narrow", "wide", "gemv", "gemv-long"])
def test_matches_the_dequantized_weight(weight_dtype, m, shape, tiles, seed):
    n, k = shape
    gen = torch.Generator().manual_seed(seed + m + n)
    q = quantized(gen, n, k, weight_dtype)
    scale = (torch.rand(n, generator=gen) / 100).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    want = (x.double() @ q.double().T) * scale.double()
    got = wo.weight_only_mm(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), tiles)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    err = float((got.cpu().double() - want).norm() / want.norm())
    print(f"[{weight_dtype} m={m} {n}x{k} {tiles}] seed={seed} relative error {err:.2e}")
    # the output's bf16 rounding: 2^-9 of each element, 2^-8 under the interpreter (which
    # truncates to bf16), and the float32 summation order
    assert err < 2**-7


def test_few_rows_take_the_gemv_kernel(monkeypatch):
    """Up to GEMV_MAX_ROWS rows go to the GEMV kernel by default, more to the tile kernel."""
    launched = []
    for name in ("_weight_only_gemv_kernel", "_weight_only_mm_kernel"):
        kernel = getattr(wo, name)
        monkeypatch.setattr(wo, name, _Recording(kernel, name, launched))
    q = torch.ones(32, 64, dtype=torch.int8, device=DEVICE)
    for m in (1, wo.GEMV_MAX_ROWS, wo.GEMV_MAX_ROWS + 1):
        x = torch.ones(m, 64, dtype=torch.bfloat16, device=DEVICE)
        assert bool((wo.weight_only_mm(x, q, torch.ones(32, device=DEVICE)) == 64).all())
    assert launched == ["_weight_only_gemv_kernel"] * 2 + ["_weight_only_mm_kernel"]


class _Recording:
    """A Triton kernel whose launches are counted by name."""

    def __init__(self, kernel, name: str, launched: list) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def test_no_rows_give_an_empty_output():
    q = torch.zeros(32, 64, dtype=torch.int8, device=DEVICE)
    out = wo.weight_only_mm(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE), q,
                            torch.ones(32, device=DEVICE))  # fmt: skip
    assert out.shape == (0, 32)


def test_decode_rows_take_the_sweeps_tiles():
    """A decode step's rows read the weights once: 32 outputs a program where three quarters of
    the 132 SMs still get one, else 16; K steps of 512 and four stages over a long K (what
    bench_weight_only_mm's sweep chose at DeepSeek-V3's shapes on the H200); a chunk's rows keep
    the widest tiles that give every SM two programs."""
    o_proj = wo.default_tiles(1, 7168, 16384, 132)
    assert (o_proj.block_n, o_proj.block_k, o_proj.num_stages) == (32, 512, 4)  # 224 programs
    qkv_a = wo.default_tiles(1, 2112, 7168, 132)
    assert (qkv_a.block_n, qkv_a.block_k) == (16, 256)  # 32 wide would leave 66 SMs idle
    q_b = wo.default_tiles(4, 24576, 1536, 132)
    assert (q_b.block_n, q_b.block_k, q_b.num_stages) == (32, 256, 3)
    assert wo.default_tiles(1, 64, 40, 132).block_k == 64  # K below a step: its power of two
    wide = wo.default_tiles(128, 7168, 16384, 132)
    assert (wide.block_m, wide.block_n, wide.block_k) == (64, 32, 128)  # 2 row blocks x 224


@pytest.mark.parametrize("weight_dtype", wo.WEIGHT_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_the_start_up_probe_agrees_with_dequantization(weight_dtype):
    """linear.py's check before a layer takes the kernel (weight_only_supported: CUDA only),
    its probe run here on this device: the kernel against the dequantized weight."""
    from gpu_service.layers import linear

    probe = linear._weight_only_probe(weight_dtype)
    assert linear._kernel_agrees("weight-only probe", DEVICE, probe)
    assert linear.weight_only_supported(DEVICE, weight_dtype) == (DEVICE.type == "cuda")
