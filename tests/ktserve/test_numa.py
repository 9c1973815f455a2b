"""ktserve/numa.py: cpulists parsed and printed as Linux writes them, and the NUMA topology read
from sysfs (fake trees in the real format, and this machine's)."""

from __future__ import annotations

import os

import pytest

from ktserve.numa import NumaNode, NumaTopology, format_cpulist, parse_cpulist, read_topology
from tests.support.numa_sysfs import sysfs


def test_cpulists_parse_and_print_as_linux_writes_them():
    assert parse_cpulist("0-3,8-11\n") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert parse_cpulist("5") == (5,) and parse_cpulist("\n") == ()
    assert format_cpulist([11, 0, 1, 2, 3, 8, 9, 10, 5]) == "0-3,5,8-11"
    for bad in ("a-b", "3-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_one_node(tmp_path):
    topology = read_topology(sysfs(tmp_path, {0: "0-7"}), allowed=range(8))
    assert topology == NumaTopology((NumaNode(0, tuple(range(8)), 1 << 30),))


def test_two_nodes_with_split_ranges_and_offline_cpus(tmp_path):
    root = sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})  # node 2: memory only
    allowed = set(range(16)) - {2, 13}  # offline, or outside this process's affinity
    topology = read_topology(root, allowed=allowed)
    assert [n.node_id for n in topology.nodes] == [0, 1]
    assert [n.cpulist for n in topology.nodes] == ["0-1,3,8-11", "4-7,12,14-15"]
    only_node_1 = read_topology(root, allowed={5, 6})
    assert only_node_1.nodes == (NumaNode(1, (5, 6), 1 << 30),)
    with pytest.raises(ValueError, match="belongs to a NUMA node"):
        read_topology(root, allowed={99})


def test_no_sysfs_is_one_node_of_the_allowed_cpus(tmp_path):
    assert read_topology(tmp_path / "absent", allowed={1, 0}).nodes == (NumaNode(0, (0, 1), 0),)


def test_this_machine():
    topology = read_topology()
    cpus = [c for n in topology.nodes for c in n.cpus]
    print(f"this machine: {[(n.node_id, n.cpulist, n.memory_bytes) for n in topology.nodes]}")
    assert sorted(cpus) == sorted(os.sched_getaffinity(0))
    assert all(n.memory_bytes > 0 for n in topology.nodes)
