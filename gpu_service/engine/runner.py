"""The runner executes what the scheduler decided: one forward step, then sampling."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpu_service.engine.sampling import SampledToken, Sampler
from gpu_service.engine.scheduler import ScheduledStep
from gpu_service.models.batch import Batch, SeqInput
from gpu_service.models.model import CausalLM


@dataclass(frozen=True)
class StepResult:
    tokens: tuple[SampledToken, ...]  # one per scheduled sequence, in order
    seconds: float


class Runner:
    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.sampler = Sampler()

    def run(self, step: ScheduledStep) -> StepResult:
        start = time.perf_counter()
        batch = Batch(tuple(SeqInput(s.token_ids, s.request.cache, s.start_pos) for s in step.seqs))
        logits = self.model.forward(batch)  # [B, V] float32
        requests = [s.request for s in step.seqs]
        tokens = self.sampler(logits, [r.params for r in requests], [r.generator for r in requests])
        return StepResult(tuple(tokens), time.perf_counter() - start)
