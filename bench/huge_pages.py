"""Weights in transparent huge pages, for bench_moe_kernel.py --huge-pages: whether the kernel's
weight stream gains from one page-table entry per 2 MiB instead of per 4 KiB (the finding:
expert_service/kernels/README.md)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20  # bytes: the x86-64 transparent huge page


def huge_page_empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialized C-contiguous array in anonymous memory that starts on a 2 MiB boundary and
    is advised MADV_HUGEPAGE before anything touches it, so that where the kernel's transparent
    huge pages are on ("always" or "madvise") its pages fault in as 2 MiB pages: streaming
    gigabytes of weights then walks one page-table entry per 2 MiB instead of per 4 KiB. Where
    the advice is refused (no THP support) it is plain anonymous memory; huge_page_bytes() says
    how much of an array huge pages back."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-_address(region)) % HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError):
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes + HUGE_PAGE - start)
    flat = np.frombuffer(region, dtype=dtype, count=int(np.prod(shape)), offset=start)
    return flat.reshape(shape)


def _address(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def huge_page_bytes(arr: np.ndarray) -> int:
    """Bytes of arr's memory that huge pages back now (AnonHugePages of the mappings it lies in,
    from /proc/self/smaps; 0 where that file is absent)."""
    lo = arr.ctypes.data
    hi = lo + arr.nbytes
    total, inside = 0, False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start < hi and lo < end
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return min(total, arr.nbytes)
