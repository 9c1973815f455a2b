"""The scheduler decides; it never runs the model.

Each step it picks what runs: every running request feeds the tokens not yet in its cache (one,
when it decodes), and waiting requests are admitted (first come, first served) while the KV cache
has blocks for their prompt and max_num_seqs allows. A step holds at most max_num_batched_tokens
tokens: a prompt longer than what is left is fed in chunks over several steps (chunked prefill),
and only the step that feeds its last token samples. A running request whose next tokens find no
KV block preempts the youngest running request, which goes back to the front of the queue and
is recomputed from its prompt and output later.

Mixed steps (config.time_budgeted): while requests decode, a step's prompt chunks are sized by
time, not only by tokens: the step's predicted time (step_cost.py's model, fitted from the times
the engine measured) stays within mixed_step_time_factor x that of its decode rows alone (on
CUDA, where decode steps replay as graphs, the rows' eager step plus the larger of
(factor - 1) decode steps and that eager step's gap over the graphed one: `_mixed_step_bound`),
or mixed_step_time_ms, so a long prompt's prefill does not stall the decodes. The step's first
chunk gets at least min_prefill_chunk_tokens whatever the prediction (and while the model has no
fit yet: those steps are what it learns from). A step without decode rows is bounded by
max_num_batched_tokens alone.

The scheduler owns the KV cache's books (kvcache/manager.py's KVCacheManager: blocks, prefix
cache, host tier); a step carries what the runner needs of them as data (each sequence's blocks,
the copies between tiers). With prefix caching, a request is admitted with the longest cached
prefix of its tokens (prompt and, after a preemption, output) and its prefill starts after it:
those tokens never run through the model, nor through the experts. Each step first offers the
blocks the last step filled to the prefix cache, and so does a request's end or preemption
before it frees them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gpu_service.config import SchedulerConfig
from gpu_service.engine.errors import EngineError
from gpu_service.engine.request import FinishReason, Request, RequestState
from gpu_service.engine.step_cost import StepCostModel, StepShape
from gpu_service.kvcache.block_pool import extend_block_hashes
from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.kvcache.host_tier import BlockCopy
from gpu_service.kvcache.manager import KVCacheManager


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    token_ids: list[int]
    start_pos: int
    # its token is the last step's sample, on the device still (token_ids holds a stand-in)
    chained: bool = False

    @property
    def samples(self) -> bool:
        """Whether this step feeds the request's last token (a chunk before it samples nothing)."""
        return self.chained or self.start_pos + len(self.token_ids) == self.request.num_tokens


@dataclass(frozen=True)
class ScheduledStep:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Request, ...] = ()
    # between cache tiers, run before the forward. NOTE: only allocate/extend queue copies, and
    # each call schedules its sequence: a step with copies always has seqs
    block_copies: tuple[BlockCopy, ...] = ()
    # the predicted seconds its prompt chunks were sized to (None: no decode rows beside them,
    # or no time budget)
    time_bound_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig) -> None:
        if config.max_model_len is None:
            raise ValueError("max_model_len is None: resolve it to the model's context length")
        self.config = config
        self.kv_manager = KVCacheManager(kv_config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # fed the measured steps by the engine; None: chunks by max_num_batched_tokens only
        self.cost_model = StepCostModel() if config.time_budgeted else None

    def add(self, request: Request) -> None:
        """Queue a request that passed validation (it fits the context and the KV cache)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        for request in self.running:
            self._cache_computed(request)
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        budget = self.config.max_num_batched_tokens
        chunks = _ChunkSizer(self.config, self.cost_model)
        # running: the tokens not in the cache yet, decodes (one each) before prompt chunks (what
        # the budget and the time bound leave); preempt the youngest while the cache cannot grow
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_cached > 1):
            if request.state != RequestState.RUNNING:
                continue
            start = request.num_cached
            unprocessed = request.num_tokens - start
            if unprocessed > 1 and budget <= 0:
                continue
            n = 1 if unprocessed == 1 else chunks.size(seqs, start, min(unprocessed, budget))
            if n == 0:
                continue
            while not self.kv_manager.can_extend(request.cache, start + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.state != RequestState.RUNNING:
                continue
            self.kv_manager.extend(request.cache, start + n)
            seqs.append(ScheduledSeq(request, request.ids(start, start + n), start))
            budget -= n
        # admit: the prompt (plus output after a preemption), its first chunk in this step
        while (self.waiting and not preempted and budget > 0 and not chunks.spent(seqs)
               and len(self.running) < self.config.max_num_seqs):  # fmt: skip
            request = self.waiting[0]
            ids = request.all_ids
            hashes = self._block_hashes(request, ids)
            if not self.kv_manager.can_allocate(len(ids), hashes):
                break
            self.waiting.popleft()
            request.cache = self.kv_manager.allocate(len(ids), hashes)
            request.state = RequestState.RUNNING
            self.running.append(request)
            start = request.cache.num_tokens  # the cached prefix
            if request.num_cached_prompt_tokens is None:
                request.num_cached_prompt_tokens = start
            n = chunks.size(seqs, start, min(len(ids) - start, budget))
            if n == 0:  # after its cached prefix nothing fits: running, its chunk comes next
                break
            seqs.append(ScheduledSeq(request, ids[start : start + n], start))
            budget -= n
        copies = self.kv_manager.take_copies()
        return ScheduledStep(tuple(seqs), tuple(preempted), copies, chunks.bound_s)

    def chain(self, step: ScheduledStep,
              chainable: Callable[[Request], bool]) -> ScheduledStep | None:  # fmt: skip
        """The decode step after `step`, decided before step's tokens are known (its rows'
        tokens come from step's samples on the device): each of step's requests one token
        further, but those that finished since and those whose step token is their last
        (max_tokens, max_model_len). None where the next step must wait for step's results:
        a request waits to be admitted, a row of step is not a sampling decode or not
        `chainable`, or a cache cannot grow without preempting.
        NOTE: step's tokens are not in the requests' output yet: each row is one token ahead of
        its request (the runner feeds it the sample; the engine appends it before this step's)."""
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return None
        seqs: list[ScheduledSeq] = []
        for s in step.seqs:
            request = s.request
            if len(s.token_ids) != 1 or not s.samples:
                return None
            if request.state != RequestState.RUNNING:
                continue
            if not chainable(request):
                return None
            self._cache_computed(request)
            end_pos = s.start_pos + 2  # this step feeds step's sample, at start_pos + 1
            # step's token makes len(output) + 1 (a LENGTH end, if either bound is reached)
            if (len(request.output) + 1 >= request.params.max_tokens
                    or end_pos >= self.config.max_model_len):  # fmt: skip
                continue
            if not self.kv_manager.can_extend(request.cache, end_pos):
                return None
            self.kv_manager.extend(request.cache, end_pos)
            seqs.append(ScheduledSeq(request, [0], s.start_pos + 1, chained=True))
        if not seqs:
            return None
        return ScheduledStep(tuple(seqs), (), self.kv_manager.take_copies())

    def _block_hashes(self, request: Request, ids: list[int] | None = None) -> list[bytes]:
        """The chained hashes of the request's full blocks (kept on it, extended as it grows)."""
        if not self.kv_manager.prefix_caching:
            return []
        bs = self.kv_manager.block_size
        if len(request.block_hashes) < request.num_tokens // bs:
            extend_block_hashes(request.block_hashes, ids or request.all_ids, bs)
        return request.block_hashes

    def _cache_computed(self, request: Request) -> None:
        """Offer the request's blocks that are full of computed tokens to the prefix cache."""
        cache = request.cache
        if cache is None or not self.kv_manager.prefix_caching:
            return
        if cache.num_tokens // self.kv_manager.block_size > cache.num_hashed_blocks:
            self.kv_manager.cache_blocks(cache, self._block_hashes(request))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._cache_computed(request)
        self.kv_manager.free(request.cache)
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
            self._cache_computed(request)
            self.kv_manager.free(request.cache)
            request.cache = None
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.error = error

    @property
    def kv_usage(self) -> float:
        cfg = self.kv_manager.config
        return 1.0 - self.kv_manager.num_free_blocks / cfg.num_blocks


class _ChunkSizer:
    """One step's prompt chunks under its time bound, set by the decode rows scheduled before
    the first chunk (NOTE: schedule() takes decodes first; a step with none has no bound)."""

    def __init__(self, config: SchedulerConfig, cost_model: StepCostModel | None) -> None:
        self.config = config
        self.cost_model = cost_model
        self.bound_s: float | None = None
        self.num_prompt_tokens = 0
        self._decided = False

    def size(self, seqs: list[ScheduledSeq], start: int, wanted: int) -> int:
        """Tokens of a prompt chunk of up to `wanted` after `start` cached ones, given the
        sequences the step holds so far."""
        self._decide(seqs)
        n = wanted
        if self.bound_s is not None:
            n = self.cost_model.prompt_tokens_within(StepShape.of(seqs), start, self.bound_s,
                                                     wanted)  # fmt: skip
            if self.num_prompt_tokens == 0:
                n = max(n, min(self.config.min_chunk_tokens, wanted))
        self.num_prompt_tokens += n
        return n

    def spent(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether the bound leaves no room for another prompt's first token."""
        self._decide(seqs)
        if self.bound_s is None or self.num_prompt_tokens == 0:
            return False
        return self.cost_model.prompt_tokens_within(StepShape.of(seqs), 0, self.bound_s, 1) == 0

    def _decide(self, seqs: list[ScheduledSeq]) -> None:
        if self._decided:
            return
        self._decided = True
        if self.cost_model is None or not seqs:  # no decode rows: the token budget alone
            return
        if self.config.mixed_step_time_ms is not None:
            self.bound_s = self.config.mixed_step_time_ms / 1e3
        else:
            self.bound_s = _mixed_step_bound(self.cost_model, StepShape.of(seqs),
                                             self.config.mixed_step_time_factor)  # fmt: skip


def _mixed_step_bound(cost_model: StepCostModel, decodes: StepShape, factor: float) -> float:
    """A step's time bound for decode rows `decodes` and prompt chunks beside them: the rows'
    eager step plus the larger of (factor - 1) decode steps and what running eagerly costs the
    rows over their decode step (0.0, the floor, before the model has a fit).

    On the CPU decode steps run eagerly too, and the bound is factor x the decode step. On CUDA
    they replay as graphs, several times quicker than any eager step; a mixed step is eager, so
    it costs the decodes that gap whatever its chunk, and a chunk smaller than the gap would
    pay it again and again: the prompt would take hundreds of floor-sized steps, each nearly as
    long as one that carried far more of it."""
    decode_s, eager_s = cost_model.decode_seconds(decodes), cost_model.seconds(decodes)
    if decode_s is None or eager_s is None:
        return 0.0
    return eager_s + max((factor - 1.0) * decode_s, eager_s - decode_s)
