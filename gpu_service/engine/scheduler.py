"""The scheduler decides; it never runs the model.

Each step it picks what runs: every running request feeds the tokens not yet in its cache (one,
when it decodes), and waiting requests are admitted (first come, first served) while the KV cache
has blocks for their prompt and max_num_seqs allows. A step holds at most max_num_batched_tokens
tokens: a prompt longer than what is left is fed in chunks over several steps (chunked prefill),
and only the step that feeds its last token samples. A running request whose next tokens find no
KV block preempts the youngest running request, which goes back to the front of the queue and
is recomputed from its prompt and output later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gpu_service.config import SchedulerConfig
from gpu_service.engine.errors import EngineError
from gpu_service.engine.request import FinishReason, Request, RequestState
from gpu_service.models.kv_cache import KVCache


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    token_ids: list[int]
    start_pos: int

    @property
    def samples(self) -> bool:
        """Whether this step feeds the request's last token (a chunk before it samples nothing)."""
        return self.start_pos + len(self.token_ids) == self.request.num_tokens


@dataclass(frozen=True)
class ScheduledStep:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCache) -> None:
        if config.max_model_len is None:
            raise ValueError("max_model_len is None: resolve it to the model's context length")
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a request that passed validation (it fits the context and the KV cache)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        budget = self.config.max_num_batched_tokens
        # running: the tokens not in the cache yet, decodes (one each) before prompt chunks (what
        # the budget leaves); preempt the youngest while the cache cannot grow
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_cached > 1):
            if request.state != RequestState.RUNNING:
                continue
            start = request.num_cached
            unprocessed = request.num_tokens - start
            if unprocessed > 1 and budget <= 0:
                continue
            n = 1 if unprocessed == 1 else min(unprocessed, budget)
            while not self.kv_cache.can_extend(request.cache, start + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.state != RequestState.RUNNING:
                continue
            self.kv_cache.extend(request.cache, start + n)
            seqs.append(ScheduledSeq(request, request.all_ids[start : start + n], start))
            budget -= n
        # admit: the prompt (plus output after a preemption), its first chunk in this step
        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.config.max_num_seqs):  # fmt: skip
            request = self.waiting[0]
            ids = request.all_ids
            if not self.kv_cache.can_allocate(len(ids)):
                break
            self.waiting.popleft()
            request.cache = self.kv_cache.allocate(len(ids))
            request.state = RequestState.RUNNING
            self.running.append(request)
            n = min(len(ids), budget)
            seqs.append(ScheduledSeq(request, ids[:n], 0))
            budget -= n
        return ScheduledStep(tuple(seqs), tuple(preempted))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.cache)
        request.cache = None
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)

    def finish(
        self, request: Request, reason: FinishReason, error: EngineError | None = None
    ) -> None:
        """Take a request out, whatever its state, and free its cache."""
        if request.state == RequestState.RUNNING:
            self.running.remove(request)
        elif request.state == RequestState.WAITING and request in self.waiting:
            self.waiting.remove(request)
        if request.cache is not None:
            self.kv_cache.free(request.cache)
            request.cache = None
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.error = error

    @property
    def kv_usage(self) -> float:
        cfg = self.kv_cache.config
        return 1.0 - self.kv_cache.num_free_blocks / cfg.num_blocks
