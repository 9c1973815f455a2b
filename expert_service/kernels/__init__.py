"""The CPU Mixture-of-Experts kernel: fused gate/up + SiLU*up + down + weighted sum over the routed
experts, with AVX2, AVX-512 and AMX paths chosen at run time (see README.md in this directory)."""

from expert_service.kernels.isa import available_isas, default_isa
from expert_service.kernels.kernel import MoEKernel
from expert_service.kernels.packing import (
    PackedExperts,
    WeightFormat,
    pack_expert_list,
    pack_experts,
)

__all__ = [
    "MoEKernel",
    "PackedExperts",
    "WeightFormat",
    "available_isas",
    "default_isa",
    "pack_expert_list",
    "pack_experts",
]
