"""What the expert workers hold, from their GetInfo, and the check that together they hold one
model's routed experts exactly once: each expert's every intermediate row (gate and up rows,
down columns) on exactly one worker. Their replies are partial sums; a row held twice would be
counted twice, a row held by none not at all."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ktserve.checkpoint.spec import ModelSpec
from ktserve.protocol import expert_pb2 as pb


class ExpertCoverageError(ValueError):
    """The workers' shards are not one model's routed experts, each held exactly once."""


@dataclass(frozen=True)
class WorkerShard:
    """What one worker holds: expert ids [start, stop) of a model, and of each of them the
    intermediate rows `intermediate` (None: all of them)."""

    address: str
    experts: range
    num_experts: int
    hidden_size: int
    moe_layers: tuple[int, ...]
    intermediate: range | None = None
    intermediate_size: int = 0  # 0: not reported (a worker of before intermediate slices)

    @classmethod
    def from_info(cls, address: str, info: pb.WorkerInfo) -> WorkerShard:
        rows = None
        if info.HasField("intermediate") and info.intermediate.stop > 0:
            rows = range(info.intermediate.start, info.intermediate.stop)
            if info.intermediate_size and len(rows) == info.intermediate_size:
                rows = None
        return cls(
            address=address,
            experts=range(info.experts.start, info.experts.stop),
            num_experts=info.num_experts,
            hidden_size=info.hidden_size,
            moe_layers=tuple(info.moe_layers),
            intermediate=rows,
            intermediate_size=info.intermediate_size,
        )

    @property
    def label(self) -> str:
        label = f"{self.experts.start}-{self.experts.stop - 1}"
        if self.intermediate is not None:
            label += f" rows {self.intermediate.start}-{self.intermediate.stop - 1}"
        return label


def check_coverage(shards: list[WorkerShard], spec: ModelSpec) -> None:
    """ExpertCoverageError unless the shards are of `spec`'s model and hold each expert's every
    intermediate row once."""
    held = ", ".join(f"{s.address} holds {s.label}" for s in shards)
    inter = spec.moe_intermediate_size
    for s in shards:
        mine = (s.num_experts, s.hidden_size, s.moe_layers, s.intermediate_size or inter)
        model = (spec.num_experts, spec.hidden_size, tuple(spec.moe_layers), inter)
        if mine != model:
            raise ExpertCoverageError(
                f"expert worker {s.address} serves another model: {s.num_experts} experts, "
                f"hidden size {s.hidden_size}, MoE layers {list(s.moe_layers)}, intermediate "
                f"size {mine[3]}; this model has {spec.num_experts}, {spec.hidden_size}, "
                f"{list(spec.moe_layers)}, {inter}"
            )
    rows_of: list[list[range]] = [[] for _ in range(spec.num_experts)]
    for s in shards:
        for expert in s.experts:
            rows_of[expert].append(s.intermediate or range(inter))
    missing = _runs([e for e, rows in enumerate(rows_of) if not rows])
    problems = [f"no worker holds experts {missing}"] if missing else []
    gaps: dict[str, list[int]] = defaultdict(list)
    overlaps: dict[str, list[int]] = defaultdict(list)
    for expert, rows in enumerate(rows_of):
        if not rows:
            continue
        gap, overlap = _row_coverage(rows, inter)
        if gap:
            gaps[gap].append(expert)
        if overlap:
            overlaps[overlap].append(expert)
    whole = range(inter)
    for rows, experts in overlaps.items():
        if rows == _show(whole):
            problems.append(f"experts {_runs(experts)} are held by more than one worker")
        else:
            problems.append(f"intermediate rows {rows} of experts {_runs(experts)} are held by "
                            "more than one worker")  # fmt: skip
    for rows, experts in gaps.items():
        problems.append(f"no worker holds intermediate rows {rows} (of 0-{inter - 1}) of experts "
                        f"{_runs(experts)}")  # fmt: skip
    if problems:
        raise ExpertCoverageError(
            f"the expert workers must hold each of the model's {spec.num_experts} routed experts "
            f"(0-{spec.num_experts - 1}) exactly once, but {' and '.join(problems)} ({held}); "
            "start each `ktserve expert` with its own --experts range (or, splitting the "
            "intermediate dimension, its own --intermediate-rows)"
        )


def _row_coverage(rows: list[range], size: int) -> tuple[str, str]:
    """(rows of [0, size) held by none, rows held more than once), each as "a-b, c-d" or ""."""
    events = sorted([(r.start, 1) for r in rows] + [(r.stop, -1) for r in rows] + [(size, 0)])
    gaps, overlaps = [], []
    depth, position = 0, 0
    for at, step in events:
        if at > position:
            if depth == 0:
                gaps.append(range(position, min(at, size)))
            elif depth > 1:
                overlaps.append(range(position, at))
            position = at
        depth += step
    return ", ".join(map(_show, gaps)), ", ".join(map(_show, overlaps))


def _show(rows: range) -> str:
    return f"{rows.start}-{rows.stop - 1}"


def _runs(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
