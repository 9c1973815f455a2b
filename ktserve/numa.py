"""The machine's NUMA nodes, as Linux describes them under /sys/devices/system/node:

    node0/cpulist   "0-15,32-47"          the node's CPUs (cpulist format; empty: memory only)
    node0/meminfo   "Node 0 MemTotal:       263856 kB"   (one line of several)

Only CPUs this process may run on (os.sched_getaffinity) count; nodes left without any are not
listed. A machine without that directory (not Linux, or no NUMA support) is one node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SYSFS_NODES = Path("/sys/devices/system/node")
_NODE_DIR = re.compile(r"node(\d+)$")


@dataclass(frozen=True)
class NumaNode:
    """One node: its id, the CPUs of it this process may use, and its memory."""

    node_id: int
    cpus: tuple[int, ...]
    memory_bytes: int

    @property
    def cpulist(self) -> str:
        return format_cpulist(self.cpus)


@dataclass(frozen=True)
class NumaTopology:
    """The nodes with CPUs this process may use, by node id."""

    nodes: tuple[NumaNode, ...]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a topology needs at least one node with usable CPUs")

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8-11' -> (0, 1, 2, 3, 8, 9, 10, 11); '' -> (). Sorted, each CPU once."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{text.strip()!r} is not a CPU list like 0-3,8-11")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"{text.strip()!r}: the range {part} ends before it starts")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8': the format of cpulist files and Cpus_allowed_list."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def read_topology(root: Path = SYSFS_NODES, allowed: Iterable[int] | None = None) -> NumaTopology:
    """The nodes under root (a sysfs node directory) with CPUs in `allowed` (default: this
    process's affinity). Without node directories: one node 0 of the allowed CPUs."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    node_dirs = sorted(
        (int(m.group(1)), p) for p in _listdir(root) if (m := _NODE_DIR.match(p.name))
    )
    nodes = []
    for node_id, path in node_dirs:
        cpus = tuple(c for c in parse_cpulist((path / "cpulist").read_text()) if c in allowed)
        if cpus:
            nodes.append(NumaNode(node_id, cpus, _memory_bytes(path / "meminfo")))
    if not node_dirs:
        nodes.append(NumaNode(0, tuple(sorted(allowed)), 0))
    if not nodes:
        raise ValueError(
            f"none of the CPUs this process may use ({format_cpulist(allowed)}) belongs to a "
            f"NUMA node under {root}"
        )
    return NumaTopology(tuple(nodes))


def _listdir(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _memory_bytes(meminfo: Path) -> int:
    """MemTotal of a node's meminfo ('Node 0 MemTotal:  263856 kB'); 0 where unreadable."""
    try:
        text = meminfo.read_text()
    except OSError:
        return 0
    match = re.search(r"MemTotal:\s+(\d+)\s*kB", text)
    return int(match.group(1)) * 1024 if match else 0
