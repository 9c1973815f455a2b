"""`ktserve serve --numa auto` and `--expert-split intermediate`: the workers' plans
(workers/plan.py) and command lines on a topology read from a fake sysfs tree or this machine's,
and the coverage check of intermediate slices."""

from __future__ import annotations

import pytest

from gpu_service.serve_config import WorkersConfig
from gpu_service.workers.plan import WorkerPlan, worker_plans
from gpu_service.workers.shard_coverage import ExpertCoverageError, WorkerShard, check_coverage
from gpu_service.workers.supervisor import worker_specs
from ktserve.checkpoint.spec import ModelSpec
from ktserve.numa import read_topology
from tests.support.numa_sysfs import sysfs

SPEC = ModelSpec(family="qwen3_moe", num_layers=2, hidden_size=64, moe_intermediate_size=256,
                 num_experts=8, num_experts_per_tok=2, moe_layers=(0, 1))  # fmt: skip


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
