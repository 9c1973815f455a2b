"""Which instruction sets the kernel can use here, and which one a new kernel picks."""

from __future__ import annotations

from expert_service.kernels import _ext
from ktserve import envs

ISA_ENV_VAR = envs.KERNEL_ISA.name
# NOTE: ordered from least to most capable; the codes match KTK_ISA_* in ktk.h.
ISA_CODES: dict[str, int] = {"avx2": 0, "avx512": 1, "amx": 2}


def available_isas() -> list[str]:
    """The instruction sets compiled in and supported by this CPU (and OS), least capable first."""
    return [name for name, code in ISA_CODES.items() if _ext.isa_supported(code)]


def check_isa(isa: str) -> str:
    if isa not in ISA_CODES:
        raise ValueError(f"unknown ISA {isa!r}: expected one of {sorted(ISA_CODES)}")
    available = available_isas()
    if isa not in available:
        raise ValueError(f"ISA {isa!r} is not available on this machine (available: {available})")
    return isa


def default_isa() -> str:
    """The most capable available ISA, or the one named by KTSERVE_KERNEL_ISA (checked)."""
    override = envs.KERNEL_ISA.read()
    if override:
        try:
            return check_isa(override)
        except ValueError as exc:
            raise ValueError(f"{ISA_ENV_VAR}={override!r}: {exc}") from None
    available = available_isas()
    if not available:
        raise RuntimeError("this CPU lacks AVX2+FMA+F16C, the minimum the MoE kernel needs")
    return available[-1]
