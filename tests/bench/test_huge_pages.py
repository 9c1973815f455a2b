"""bench/huge_pages.py: arrays in memory advised for transparent huge pages, and how much of an
array huge pages back."""

from __future__ import annotations

import numpy as np

from bench.huge_pages import HUGE_PAGE, huge_page_bytes, huge_page_empty


def test_a_huge_page_array_starts_on_a_huge_page_and_holds_what_is_written(seed):
    rng = np.random.default_rng(seed)
    want = rng.integers(-(2**31), 2**31, size=(3, HUGE_PAGE // 4 + 5), dtype=np.int32)
    got = huge_page_empty(want.shape, np.int32)
    assert got.shape == want.shape and got.dtype == np.int32 and got.flags.c_contiguous
    assert got.flags.writeable and got.ctypes.data % HUGE_PAGE == 0
    got[...] = want
    assert np.array_equal(got, want)
    assert 0 <= huge_page_bytes(got) <= got.nbytes
