"""`ktserve serve --numa auto` and `--expert-split intermediate`: the topology read from sysfs
(fake trees in the real format, and this machine's), the workers' plans (workers/plan.py) and
command lines, and the coverage check of intermediate slices."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpu_service.serve_config import WorkersConfig
from gpu_service.workers.plan import WorkerPlan, worker_plans
from gpu_service.workers.shard_coverage import ExpertCoverageError, WorkerShard, check_coverage
from gpu_service.workers.supervisor import worker_specs
from ktserve.checkpoint.spec import ModelSpec
from ktserve.numa import NumaNode, NumaTopology, format_cpulist, parse_cpulist, read_topology

SPEC = ModelSpec(family="qwen3_moe", num_layers=2, hidden_size=64, moe_intermediate_size=256,
                 num_experts=8, num_experts_per_tok=2, moe_layers=(0, 1))  # fmt: skip


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


def test_numa_auto_on_one_node_is_todays_workers():
    topology = read_topology()
    if topology.num_nodes != 1:
        pytest.skip(f"this machine has {topology.num_nodes} NUMA nodes")
    for numa in ("auto", "off"):
        plans = worker_plans(WorkersConfig(numa=numa), SPEC, topology)
        assert plans == (WorkerPlan("0-7"),)


def test_numa_auto_places_one_worker_per_node(tmp_path):
    topology = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7"}), allowed=range(8))
    plans = worker_plans(WorkersConfig(numa="auto"), SPEC, topology)
    assert plans == (WorkerPlan("0-3", None, "0-3", 0), WorkerPlan("4-7", None, "4-7", 1))
    split = worker_plans(WorkersConfig(numa="auto", expert_split="intermediate"), SPEC, topology)
    assert split == (WorkerPlan("0-7", "0-127", "0-3", 0), WorkerPlan("0-7", "128-255", "4-7", 1))
    argv = [s.argv for s in worker_specs("/m", split, "int8", None, "/tmp/d")]
    assert argv[1][-6:] == ("--intermediate-rows", "128-255", "--cpus", "4-7", "--numa-node", "1")
    assert worker_plans(WorkersConfig(numa="off"), SPEC, topology) == (WorkerPlan("0-7"),)
    with pytest.raises(ValueError, match=r"one expert worker per NUMA node \(2 here\)"):
        worker_plans(WorkersConfig(numa="auto", expert_workers=3), SPEC, topology)


def test_intermediate_split_without_numa_and_its_refusals():
    one = read_topology(allowed={0})
    plans = worker_plans(WorkersConfig(expert_workers=4, expert_split="intermediate"), SPEC, one)
    assert [p.intermediate_rows for p in plans] == ["0-63", "64-127", "128-191", "192-255"]
    assert {p.experts for p in plans} == {"0-7"}
    with pytest.raises(ValueError, match=r"256 does not split into 3 slices.*split it: 1, 2, 4"):
        worker_plans(WorkersConfig(expert_workers=3, expert_split="intermediate"), SPEC, one)
    with pytest.raises(ValueError, match="--experts-per-worker gives each worker expert ids"):
        WorkersConfig(expert_workers=2, experts_per_worker=("0-3", "4-7"),
                      expert_split="intermediate")  # fmt: skip


def shard(address: str, experts: range, rows: range | None) -> WorkerShard:
    return WorkerShard(address, experts, 8, 64, (0, 1), rows, 256)


def test_coverage_of_intermediate_slices():
    all_experts = range(8)
    check_coverage([shard("a:1", all_experts, range(0, 128)),
                    shard("b:1", all_experts, range(128, 256))], SPEC)  # fmt: skip
    # a grid: expert ranges, each split in rows
    check_coverage([shard("a:1", range(0, 4), range(0, 64)),
                    shard("b:1", range(0, 4), range(64, 256)),
                    shard("c:1", range(4, 8), None)], SPEC)  # fmt: skip
    with pytest.raises(ExpertCoverageError,
                       match=r"no worker holds intermediate rows 128-255 \(of 0-255\) of experts "
                             r"0-7 \(a:1 holds 0-7 rows 0-127\)"):  # fmt: skip
        check_coverage([shard("a:1", all_experts, range(0, 128))], SPEC)
    with pytest.raises(
        ExpertCoverageError,
        match="intermediate rows 64-127 of experts 4-7 are held by more than one",
    ):
        check_coverage([shard("a:1", all_experts, range(0, 128)),
                        shard("b:1", range(4, 8), range(64, 256)),
                        shard("c:1", range(0, 4), range(128, 256))], SPEC)  # fmt: skip
    with pytest.raises(ExpertCoverageError, match="intermediate size 128; this model has"):
        check_coverage([WorkerShard("a:1", all_experts, 8, 64, (0, 1), None, 128)], SPEC)
