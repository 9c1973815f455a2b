"""Expert shards: parse an expert id range, check it against the model, size it against memory."""

from __future__ import annotations

import math
from pathlib import Path

from ktserve import envs
from ktserve.checkpoint.errors import InsufficientMemory, InvalidExpertRange, ShardOutOfRange
from ktserve.checkpoint.spec import ModelSpec

MEMORY_LIMIT_ENV = "KTSERVE_MEMORY_LIMIT_BYTES"
MEMINFO_PATH = Path("/proc/meminfo")


def parse_expert_range(text: str) -> range:
    """'0-63' -> range(0, 64) (both ends inclusive); '7' -> range(7, 8)."""
    parts = text.strip().split("-")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise InvalidExpertRange(text, "not one or two non-negative integers joined by '-'")
    first, last = int(parts[0]), int(parts[-1])
    if last < first:
        raise InvalidExpertRange(text, f"the last expert {last} comes before the first {first}")
    return range(first, last + 1)


def validate_shard(spec: ModelSpec, experts: range) -> None:
    """Raise ShardOutOfRange unless the (non-empty, step 1) range lies inside [0, num_experts)."""
    if experts.step != 1 or len(experts) == 0:
        raise ShardOutOfRange("expert range", _show(experts), spec.num_experts)
    if experts.start < 0 or experts.stop > spec.num_experts:
        raise ShardOutOfRange("expert range", _show(experts), spec.num_experts)


def estimate_shard_bytes(spec: ModelSpec, num_experts: int, bytes_per_weight: float) -> int:
    """Host bytes for `num_experts` routed experts in every MoE layer at `bytes_per_weight`."""
    if num_experts < 0 or bytes_per_weight <= 0:
        raise ValueError("num_experts must be >= 0 and bytes_per_weight > 0")
    return math.ceil(spec.num_moe_layers * num_experts * spec.expert_num_params * bytes_per_weight)


def available_memory_bytes() -> tuple[int, str]:
    """(bytes, where the number came from): $KTSERVE_MEMORY_LIMIT_BYTES, else MemAvailable."""
    override = envs.MEMORY_LIMIT_BYTES.read()
    if override is not None:
        return override, f"${MEMORY_LIMIT_ENV}"
    for line in MEMINFO_PATH.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise RuntimeError(f"{MEMINFO_PATH}: unexpected unit in {line!r}")
            return int(value) * 1024, f"MemAvailable in {MEMINFO_PATH}"
    raise RuntimeError(f"{MEMINFO_PATH} has no MemAvailable line")


def check_memory_available(required_bytes: int) -> int:
    """Raise InsufficientMemory if `required_bytes` exceeds what is available; return available."""
    available, source = available_memory_bytes()
    if required_bytes > available:
        raise InsufficientMemory(required_bytes, available, source)
    return available


def _show(experts: range) -> str:
    if experts.step != 1:
        return repr(experts)
    return f"{experts.start}-{experts.stop - 1}" if len(experts) else f"{experts!r} (empty)"
