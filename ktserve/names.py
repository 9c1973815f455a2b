"""The one table of dtype and weight-format names; other spellings are converted here only.

    canonical   short (kernels, formats)   safetensors tag
    float32     f32                        F32
    bfloat16    bf16                       BF16
    float16     f16                        F16

Canonical names are torch's and ktshm's (`getattr(torch, name)`); config fields and flags use
them. Weight formats of the routed experts in RAM are "bf16", "int8", "int4"; protobuf's
WeightFormat enum spells them WEIGHT_FORMAT_<NAME>.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FloatDType:
    name: str
    short: str
    safetensors: str
    itemsize: int

    def torch(self) -> Any:
        import torch

        return getattr(torch, self.name)


FLOAT32 = FloatDType("float32", "f32", "F32", 4)
BFLOAT16 = FloatDType("bfloat16", "bf16", "BF16", 2)
FLOAT16 = FloatDType("float16", "f16", "F16", 2)
FLOAT_DTYPES = (FLOAT32, BFLOAT16, FLOAT16)
FLOAT_DTYPE_NAMES = tuple(d.name for d in FLOAT_DTYPES)
FP8_SAFETENSORS = "F8_E4M3"

_BY_SPELLING = {s: d for d in FLOAT_DTYPES for s in (d.name, d.short, d.safetensors)}

WEIGHT_FORMATS = ("bf16", "int8", "int4")
_PB_FORMAT_PREFIX = "WEIGHT_FORMAT_"


def float_dtype(spelling: str) -> FloatDType:
    """The dtype any of the table's spellings names; ValueError for anything else."""
    try:
        return _BY_SPELLING[spelling]
    except KeyError:
        raise ValueError(
            f"unknown dtype {spelling!r}; known: {', '.join(FLOAT_DTYPE_NAMES)}"
        ) from None


def check_weight_format(fmt: str) -> str:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    return fmt


def weight_format_to_pb(fmt: str) -> int:
    from ktserve.protocol import expert_pb2 as pb

    return pb.WeightFormat.Value(_PB_FORMAT_PREFIX + check_weight_format(fmt).upper())


def weight_format_from_pb(value: int) -> str | None:
    """The format a protobuf WeightFormat names; None for WEIGHT_FORMAT_UNSPECIFIED."""
    from ktserve.protocol import expert_pb2 as pb

    name = pb.WeightFormat.Name(value).removeprefix(_PB_FORMAT_PREFIX).lower()
    return name if name in WEIGHT_FORMATS else None
