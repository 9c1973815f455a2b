"""The scheduler decides; it never runs the model.

Each step it picks what runs: every running request feeds the tokens not yet in its cache (one,
when it decodes), and waiting requests are admitted (first come, first served) while the KV cache
has blocks for their prompt and max_num_seqs allows. A step holds at most max_num_batched_tokens
tokens: a prompt longer than what is left is fed in chunks over several steps (chunked prefill),
and only the step that feeds its last token samples. A running request whose next tokens find no
KV block preempts the youngest running request, which goes back to the front of the queue and
is recomputed from its prompt and output later.

Mixed steps: while requests decode, a prompt's chunk beside them is sized by chunk_policy.py
from the step cost models the engine fits online (step_cost.py: one for steps through the CPU
workers, one for steps that stream their prefill rows' experts to the GPU): the smallest chunk
that costs about as little per token as any, which makes both the prompt and the decodes finish
soonest, never cut below the streaming threshold where streaming is faster, and within
max_decode_stall_ms where the user set one. A step without decode rows is bounded by
max_num_batched_tokens alone.

Prompts are fed shortest first: a waiting prompt shorter than what a running prompt has left
to prefill is admitted before that prompt's next chunk, so a session's long prompt does not hold
back the others' first tokens (the long one gets what the token budget leaves). Preemption frees
a request's blocks to the prefix cache first: recomputed, it starts after its cached prefix.

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
from gpu_service.engine.chunk_policy import ChunkPolicy, StepCostModels
from gpu_service.engine.errors import EngineError
from gpu_service.engine.request import FinishReason, Request, RequestState
from gpu_service.engine.step_cost import StepCostModel
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
    # the predicted time of its decode rows alone, which its prompt chunks were weighed
    # against (None: no prompt chunk beside decode rows, or no fit yet)
    decode_s: float | None = None

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
        # fed the measured steps by the engine; the threshold set where prefill streams
        self.cost_models = StepCostModels(StepCostModel(), StepCostModel())

    def add(self, request: Request) -> None:
        """Queue a request that passed validation (it fits the context and the KV cache)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        for request in self.running:
            self._cache_computed(request)
        policy = ChunkPolicy(self.cost_models, self.config.max_decode_stall_s,
                             self.config.min_chunk_tokens)  # fmt: skip
        step = _StepBuilder(self.config.max_num_batched_tokens, policy)
        # decodes first (one token each), then the prompts' chunks, shortest first: a running
        # prompt's next chunk after the waiting prompts shorter than what it has left
        decoding = [r for r in self.running if r.num_tokens - r.num_cached == 1]
        prefilling = sorted((r for r in self.running if r.num_tokens - r.num_cached > 1),
                            key=lambda r: r.num_tokens - r.num_cached)  # fmt: skip
        for request in decoding:
            self._feed(step, request)
        for request in prefilling:
            while self._admit_shorter_than(step, request.num_tokens - request.num_cached):
                pass
            if step.budget > 0 and request.state == RequestState.RUNNING:
                self._feed(step, request)
        while self._admit_shorter_than(step, None):
            pass
        copies = self.kv_manager.take_copies()
        decode_s = step.chunks.decode_seconds if step.num_prompt_chunks else None
        return ScheduledStep(tuple(step.seqs), tuple(step.preempted), copies, decode_s)

    def _feed(self, step: _StepBuilder, request: Request) -> None:
        """Schedule a running request's tokens not yet in its cache (a decode's one, or a
        prompt's chunk), preempting the youngest request not in this step while its cache
        cannot grow."""
        if request.state != RequestState.RUNNING:
            return
        start = request.num_cached
        unprocessed = request.num_tokens - start
        n = 1 if unprocessed == 1 else step.chunk(start, min(unprocessed, step.budget))
        if n == 0:
            return
        while not self.kv_manager.can_extend(request.cache, start + n):
            scheduled = {id(s.request) for s in step.seqs}
            victim = [r for r in self.running if id(r) not in scheduled][-1]
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return
        self.kv_manager.extend(request.cache, start + n)
        step.add(ScheduledSeq(request, request.ids(start, start + n), start))

    def _admit_shorter_than(self, step: _StepBuilder, num_tokens: int | None) -> bool:
        """Admit the queue's first request, its first chunk in this step, if its prompt (plus
        output after a preemption) is shorter than num_tokens (None: whatever its length) and
        the step, the cache and max_num_seqs have room; whether it was admitted."""
        if (not self.waiting or step.preempted or step.budget <= 0 or step.chunks.spent(step.seqs)
                or len(self.running) >= self.config.max_num_seqs):  # fmt: skip
            return False
        request = self.waiting[0]
        ids = request.all_ids
        if num_tokens is not None and len(ids) >= num_tokens:
            return False
        hashes = self._block_hashes(request, ids)
        if not self.kv_manager.can_allocate(len(ids), hashes):
            return False
        self.waiting.popleft()
        request.cache = self.kv_manager.allocate(len(ids), hashes)
        request.state = RequestState.RUNNING
        self.running.append(request)
        start = request.cache.num_tokens  # the cached prefix
        if request.num_cached_prompt_tokens is None:
            request.num_cached_prompt_tokens = start
        n = step.chunk(start, min(len(ids) - start, step.budget))
        if n == 0:  # after its cached prefix nothing fits: running, its chunk comes next
            return False
        step.add(ScheduledSeq(request, ids[start : start + n], start))
        return True

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


class _StepBuilder:
    """The step being scheduled: its sequences, what the token budget leaves, its chunks'
    policy and the requests it preempted."""

    def __init__(self, budget: int, chunks: ChunkPolicy) -> None:
        self.seqs: list[ScheduledSeq] = []
        self.preempted: list[Request] = []
        self.budget = budget
        self.chunks = chunks
        self.num_prompt_chunks = 0

    def chunk(self, start: int, wanted: int) -> int:
        return self.chunks.size(self.seqs, start, wanted)

    def add(self, seq: ScheduledSeq) -> None:
        self.seqs.append(seq)
        self.budget -= len(seq.token_ids)
        self.num_prompt_chunks += len(seq.token_ids) > 1
