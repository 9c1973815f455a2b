"""The GGUF tensor types ktserve reads: those the gguf package dequantizes (float types and the
block quantizations, K-quants and IQ quants included). Each is dequantized at load for now
(docs/gguf.md); kernels that compute in the stored type are the next stage."""

from __future__ import annotations

from functools import cache

from gguf import GGMLQuantizationType


@cache
def readable_types() -> frozenset[GGMLQuantizationType]:
    from gguf import quants

    floats = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    return frozenset(floats | set(quants._type_traits))  # NOTE: the package's dequantizers


READABLE_TYPES = readable_types()


def readable_type_names() -> tuple[str, ...]:
    return tuple(sorted(t.name for t in READABLE_TYPES))
