"""The runner executes what the scheduler decided: one forward step, then sampling. Decode steps
go through DecodeGraphs (CUDA graphs) when it is given one and the batch fits."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpu_service.engine.sampling import SampledToken, Sampler
from gpu_service.engine.scheduler import ScheduledStep
from gpu_service.models.batch import Batch, SeqInput
from gpu_service.models.decode_graphs import DecodeGraphs
from gpu_service.models.model import CausalLM


@dataclass(frozen=True)
class StepResult:
    tokens: tuple[SampledToken | None, ...]  # per scheduled sequence; None: a prompt chunk
    seconds: float
    graphed: bool = False  # the forward ran as CUDA graphs (DecodeGraphs)


class Runner:
    def __init__(self, model: CausalLM, decode_graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.decode_graphs = decode_graphs
        self.sampler = Sampler()

    def run(self, step: ScheduledStep) -> StepResult:
        start = time.perf_counter()
        batch = Batch(tuple(SeqInput(s.token_ids, s.request.cache, s.start_pos) for s in step.seqs))
        graphs = self.decode_graphs
        graphed = graphs is not None and graphs.supports(batch)
        model = graphs if graphed else self.model
        logits = model.forward(batch)  # [B, V] float32
        rows = [i for i, s in enumerate(step.seqs) if s.samples]
        requests = [step.seqs[i].request for i in rows]
        sampled = self.sampler(logits[rows], [r.params for r in requests],
                               [r.generator for r in requests]) if rows else []  # fmt: skip
        tokens: list[SampledToken | None] = [None] * len(step.seqs)
        for i, token in zip(rows, sampled):
            tokens[i] = token
        return StepResult(tuple(tokens), time.perf_counter() - start, graphed)
