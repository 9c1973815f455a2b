"""The ISA quantizer of activation rows (ktk_ops.quantize_int8, which forward calls use for int8
and int4 weights) gives byte for byte what the scalar reference gives: the int8 values, the
scale and the sums of each 32, for f32 and bf16 rows of any length, with NaN, infinities, zeros
and signed zeros in them."""

from __future__ import annotations

import numpy as np
import pytest

from expert_service.kernels import _ext, available_isas
from expert_service.kernels.isa import ISA_CODES

SCALAR = -1
DT_F32, DT_BF16 = 0, 1


def quantize(isa: int, row: np.ndarray, src_dtype: int, n_pad: int):
    dst = np.full(n_pad, 99, np.int8)  # anything the quantizer leaves unwritten shows
    scale = np.full(1, -1.0, np.float32)
    gsum = np.full(n_pad // 32, 12345, np.int32)
    _ext.quantize_int8(isa, row.ctypes.data, src_dtype, row.size, n_pad, dst.ctypes.data,
                       scale.ctypes.data, gsum.ctypes.data)  # fmt: skip
    return dst, scale, gsum


def rows(rng: np.random.Generator):
    """(name, f32 values) of the cases: lengths around the vector and group widths."""
    for n in (1, 7, 8, 31, 32, 33, 64, 100, 2048, 7168):
        yield f"normal {n}", rng.standard_normal(n).astype(np.float32) * rng.uniform(1e-3, 1e3)
    ties = (np.arange(-300, 300, dtype=np.float32) / 2).astype(np.float32)  # x.5 after scaling
    yield "halves", ties
    yield "zeros", np.zeros(40, np.float32)
    yield "signed zeros", np.array([-0.0, 0.0] * 20, np.float32)
    special = rng.standard_normal(96).astype(np.float32)
    special[[3, 40, 77]] = np.nan
    yield "with NaN", special
    inf = rng.standard_normal(70).astype(np.float32)
    inf[[5, 66]] = [np.inf, -np.inf]
    yield "with infinities", inf
    tiny = rng.standard_normal(64).astype(np.float32) * 1e-38
    yield "subnormal-ish", tiny


@pytest.mark.parametrize("isa", available_isas())
def test_the_isa_quantizer_equals_the_scalar_one_byte_for_byte(isa, seed):
    rng = np.random.default_rng(seed)
    for name, values in rows(rng):
        n_pad = -(-max(values.size, 1) // 64) * 64 + 64 * int(rng.integers(0, 2))
        bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
        for src, dtype in ((values, DT_F32), (bf16, DT_BF16)):
            want = quantize(SCALAR, src, dtype, n_pad)
            got = quantize(ISA_CODES[isa], src, dtype, n_pad)
            for w, g, part in zip(want, got, ("int8 values", "scale", "group sums"), strict=True):
                assert np.array_equal(w, g, equal_nan=part == "scale"), (name, dtype, part, w, g)
            assert (want[0][values.size :] == 0).all()  # padding zeroed
            assert want[1][0] >= 0 or np.isnan(want[1][0])


def test_a_bad_padding_or_dtype_is_refused():
    row = np.ones(40, np.float32)
    with pytest.raises(ValueError, match="bad kernel argument"):
        quantize(SCALAR, row, DT_F32, 48)  # not a multiple of 32
    with pytest.raises(ValueError, match="bad kernel argument"):
        quantize(SCALAR, row, 7, 64)
