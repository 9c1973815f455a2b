"""Splitting every expert's intermediate dimension I among workers (`--expert-split
intermediate`): worker w of W holds gate and up rows [w*I/W, (w+1)*I/W) and the matching down
columns of every expert, so its reply is a partial sum over its rows and the replies add up to
the whole MoE output (silu(gate x) * (up x) is per row; down sums over rows).

A slice starts and ends on the packing's block (PACK_ALIGN rows; the last may end at I): a slice
packed on its own is padded to that block, and a ragged one would stream zero padding.
"""

from __future__ import annotations

from ktserve.packed_layout import PACK_ALIGN


def check_rows(rows: range, intermediate_size: int) -> None:
    """ValueError unless rows is a non-empty slice of [0, I) on block boundaries."""
    shown = f"{rows.start}-{rows.stop - 1}"
    if rows.step != 1 or not 0 <= rows.start < rows.stop <= intermediate_size:
        raise ValueError(
            f"intermediate rows {shown} are not inside the experts' intermediate dimension "
            f"0-{intermediate_size - 1}"
        )
    if rows.start % PACK_ALIGN or (rows.stop % PACK_ALIGN and rows.stop != intermediate_size):
        raise ValueError(
            f"intermediate rows {shown}: a slice must start at a multiple of {PACK_ALIGN} and "
            f"end just before one (or at the last row, {intermediate_size - 1}): the kernel "
            f"packs rows in blocks of {PACK_ALIGN}"
        )


def slice_or_whole(rows: range | None, intermediate_size: int) -> range | None:
    """rows checked (check_rows); None for no slice or one that is the whole dimension."""
    if rows is None:
        return None
    check_rows(rows, intermediate_size)
    return None if len(rows) == intermediate_size else rows


def split_rows(intermediate_size: int, num_workers: int) -> tuple[range, ...]:
    """The even split [w*I/W, (w+1)*I/W) for each worker w; ValueError where I/W is not a whole
    number of blocks."""
    if num_workers < 1:
        raise ValueError(f"need at least one worker, got {num_workers}")
    block = PACK_ALIGN * num_workers
    if intermediate_size % block:
        fits = [w for w in range(1, 65) if intermediate_size % (PACK_ALIGN * w) == 0]
        raise ValueError(
            f"--expert-split intermediate: the experts' intermediate dimension {intermediate_size} "
            f"does not split into {num_workers} slices of whole {PACK_ALIGN}-row blocks (it "
            f"must be a multiple of {PACK_ALIGN} x {num_workers} = {block}); worker counts that "
            f"split it: {', '.join(map(str, fits)) or 'none'}; or use --expert-split experts"
        )
    size = intermediate_size // num_workers
    return tuple(range(w * size, (w + 1) * size) for w in range(num_workers))


def format_rows(rows: range) -> str:
    """range(0, 768) -> '0-767' (the --intermediate-rows format)."""
    return f"{rows.start}-{rows.stop - 1}"
