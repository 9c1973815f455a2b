"""The worker plan: what each expert worker `ktserve serve` starts holds (expert ids, or a slice
of every expert's intermediate rows) and where it runs (CPUs and NUMA node), from --expert-workers,
--experts-per-worker, --expert-split and --numa."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ktserve.intermediate_split import format_rows, split_rows

if TYPE_CHECKING:
    from gpu_service.serve_config import WorkersConfig
    from ktserve.checkpoint.spec import ModelSpec
    from ktserve.numa import NumaNode, NumaTopology


@dataclass(frozen=True)
class WorkerPlan:
    """One worker ktserve serve starts: its expert ids, intermediate rows (None: all), CPUs and
    NUMA node (None: not placed)."""

    experts: str
    intermediate_rows: str | None = None
    cpus: str | None = None
    numa_node: int | None = None

    @property
    def label(self) -> str:
        label = f"experts {self.experts}"
        if self.intermediate_rows is not None:
            label += f" rows {self.intermediate_rows}"
        if self.numa_node is not None:
            label += f" on node {self.numa_node} (CPUs {self.cpus})"
        return label


def worker_plans(
    workers: WorkersConfig, spec: ModelSpec, topology: NumaTopology
) -> tuple[WorkerPlan, ...]:
    """What each worker ktserve serve starts holds and where it runs."""
    nodes = numa_nodes(workers, topology)
    config = workers if nodes is None else replace(workers, expert_workers=len(nodes))
    count = config.expert_workers
    if workers.expert_split == "intermediate":
        everyone = f"0-{spec.num_experts - 1}"
        shards = [(everyone, format_rows(rows))
                  for rows in split_rows(spec.moe_intermediate_size, count)]  # fmt: skip
    else:
        shards = [(experts, None) for experts in expert_ranges(config, spec.num_experts)]
    return tuple(
        WorkerPlan(experts, rows, nodes[i].cpulist if nodes else None,
                   nodes[i].node_id if nodes else None)
        for i, (experts, rows) in enumerate(shards)
    )  # fmt: skip


def expert_ranges(workers: WorkersConfig, num_experts: int) -> tuple[str, ...]:
    """Each worker's expert ids ("first-last"): as given, or an even split of num_experts."""
    if workers.experts_per_worker is not None:
        return workers.experts_per_worker
    return split_experts(num_experts, workers.expert_workers)


def numa_nodes(workers: WorkersConfig, topology: NumaTopology) -> tuple[NumaNode, ...] | None:
    """The node of each worker under --numa auto on a machine of several; None: unplaced."""
    if workers.numa == "off" or topology.num_nodes == 1:
        return None
    if workers.expert_workers not in (1, topology.num_nodes):
        raise ValueError(
            f"--numa auto runs one expert worker per NUMA node ({topology.num_nodes} here), "
            f"but --expert-workers is {workers.expert_workers}: leave it out, or use --numa off"
        )
    return topology.nodes


def split_experts(num_experts: int, num_workers: int) -> tuple[str, ...]:
    """Contiguous, even ranges ("first-last", inclusive); the first ones take the remainder."""
    if num_workers > num_experts:
        raise ValueError(
            f"{num_workers} expert workers for {num_experts} routed experts: use at most "
            f"{num_experts} workers"
        )
    base, extra = divmod(num_experts, num_workers)
    ranges, start = [], 0
    for i in range(num_workers):
        size = base + (i < extra)
        ranges.append(f"{start}-{start + size - 1}")
        start += size
    return tuple(ranges)
