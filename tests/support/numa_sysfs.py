"""Fake /sys/devices/system/node trees, in the format Linux writes, for the NUMA topology tests."""

from __future__ import annotations

from pathlib import Path


def sysfs(root: Path, nodes: dict[int, str], mem_kb: int = 1048576) -> Path:
    """A /sys/devices/system/node tree: nodeN/cpulist and nodeN/meminfo as Linux writes them."""
    for node, cpulist in nodes.items():
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        (d / "meminfo").write_text(
            f"Node {node} MemTotal:       {mem_kb} kB\nNode {node} MemFree:        1000 kB\n"
        )
    (root / "online").write_text(f"0-{max(nodes)}\n")
    (root / "possible").write_text(f"0-{max(nodes)}\n")
    return root
