"""The size of a prompt's chunk in a step beside running decodes: the scheduler asks, the step
cost models answer.

A prompt with P tokens left, fed n at a time beside decode rows D, takes about P / n steps of
t(D + n) each, where the decodes alone would take t_dec(D) a step:

    the prompt's prefill time   ~ P / n * t(D + n)
    what the decodes lose       ~ P / n * (t(D + n) - t_dec(D))

t is the step as it will run: its prefill rows' experts streamed through the GPU where they
reach the streaming threshold (stream_prefill), computed by the CPU workers otherwise, each way
with its own cost model fitted online from the steps the engine measured (step_cost.py); t_dec
is the decode rows' own step (a graph replay on CUDA). The attention a prompt scores is the
same however it is cut, so the chunk size matters through the step's cost per prompt token, its
chunk's attention left out, and what the decodes pay of it:

    l(n) = t(D + n) / n                    the prompt's time per token
    c(n) = (t(D + n) - t_dec(D)) / n       what the decodes lose per prompt token

The policy takes the smallest chunk whose l and c are both within EFFICIENCY_SLACK of the least
over the chunks it may take (shorter steps for the decodes at little cost to either), streamed
ones only where a streamed one has the least l (a prompt is never cut below the streaming
threshold when streaming is the faster way). With --max-decode-stall-ms the chunk is also no
larger than keeps t(D + n) - t_dec(D) within the target, though never below the floor
(KTSERVE_MIN_PREFILL_CHUNK_TOKENS) nor, where streaming is faster, the streaming threshold.

Before the cost model of the way a chunk would run has a fit, the chunk is what the token budget
allows (those steps are what it learns from), or the floor under a stall target.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_service.engine.step_cost import StepCostModel, StepShape

EFFICIENCY_SLACK = 0.1  # the chosen chunk's costs per token are at most this much over the least
GRID_STEP = 2**0.25  # candidate chunk sizes: the floor times powers of this, and the bounds


@dataclass(frozen=True)
class StepCostModels:
    """The step cost models the engine feeds: steps through the CPU workers (`cpu`, decode-only
    steps included) and steps that streamed their prefill rows' experts (`streamed`), with the
    fewest prefill rows a step streams (None: no step streams)."""

    cpu: StepCostModel
    streamed: StepCostModel
    stream_threshold: int | None = None

    def streams(self, num_prefill_rows: int) -> bool:
        return self.stream_threshold is not None and num_prefill_rows >= self.stream_threshold

    def model_for(self, num_prefill_rows: int) -> StepCostModel:
        return self.streamed if self.streams(num_prefill_rows) else self.cpu


@dataclass(frozen=True)
class _Chunk:
    num_tokens: int
    per_token_s: float  # l(n): the step's time per prompt token
    decode_loss_per_token_s: float  # c(n): the step's time over the decodes' own, per token
    streamed: bool


class ChunkPolicy:
    """One step's prompt chunks. NOTE: schedule() takes the decode rows first; the rows in the
    step when the first chunk is asked for are the decodes the chunks are weighed against."""

    def __init__(self, models: StepCostModels, stall_target_s: float | None,
                 floor: int) -> None:  # fmt: skip
        self.models = models
        self.stall_target_s = stall_target_s
        self.floor = floor
        self.num_prefill_rows = 0  # prompt tokens the step holds so far
        self._decodes: StepShape | None = None  # the decode rows, once a chunk was asked for
        self._decode_s: float | None = None

    @property
    def decode_seconds(self) -> float | None:
        """The decode rows' own step time as predicted (None: no decode rows, or no fit)."""
        return self._decode_s

    def size(self, seqs, start: int, wanted: int) -> int:
        """Tokens of a prompt chunk of up to `wanted` after `start` cached ones, beside the
        sequences the step holds so far."""
        n = self._choose(StepShape.of(seqs), start, wanted)
        self.num_prefill_rows += n
        return n

    def spent(self, seqs) -> bool:
        """Whether a stall target leaves no room for another prompt's first token."""
        if self.stall_target_s is None or self.num_prefill_rows == 0:
            return False
        self._weigh_decodes(StepShape.of(seqs))
        if self._decode_s is None:
            return True  # the floor was this step's one chunk
        model = self.models.model_for(self.num_prefill_rows + 1)
        limit = self._decode_s + self.stall_target_s
        return model.prompt_tokens_within(StepShape.of(seqs), 0, limit, 1) == 0

    def _weigh_decodes(self, base: StepShape) -> None:
        if self._decodes is not None:
            return
        self._decodes = base
        if base.num_tokens and self.models.cpu.ready:
            self._decode_s = self.models.cpu.decode_seconds(base)

    def _choose(self, base: StepShape, start: int, wanted: int) -> int:
        self._weigh_decodes(base)
        if wanted <= 1 or self._decodes.num_tokens == 0:
            return wanted  # no decodes beside it: the token budget alone
        streamable = self.models.streams(self.num_prefill_rows + wanted)
        cpu_limit = wanted
        if streamable:  # chunks that would stream, and those that would not
            cpu_limit = min(wanted, self.models.stream_threshold - self.num_prefill_rows - 1)
        candidates = self._candidates(base, start, wanted, cpu_limit)
        if candidates is None:  # a way it could run has no fit yet
            if self.stall_target_s is None:
                return wanted
            return min(self.floor, wanted) if self.num_prefill_rows == 0 else 0  # once a step
        least_l = min(c.per_token_s for c in candidates)
        least_c = min(c.decode_loss_per_token_s for c in candidates)
        streamed_best = any(c.streamed for c in candidates if c.per_token_s == least_l)
        eligible = [c.num_tokens for c in candidates
                    if c.per_token_s <= least_l * (1 + EFFICIENCY_SLACK)
                    and c.decode_loss_per_token_s <= least_c * (1 + EFFICIENCY_SLACK)
                    and (c.streamed or not streamed_best)]  # fmt: skip
        n = min(eligible, default=wanted)
        if self.stall_target_s is not None:
            n = min(n, self._within_target(base, start, wanted, streamed_best))
        return n

    def _candidates(self, base: StepShape, start: int, wanted: int,
                    cpu_limit: int) -> list[_Chunk] | None:  # fmt: skip
        """The chunks of a grid of sizes up to `wanted`, costed; None where the way one would
        run has no fit yet."""
        sizes = {wanted}
        if 0 < cpu_limit < wanted:
            sizes |= {cpu_limit, self.models.stream_threshold - self.num_prefill_rows}
        size = float(max(self.floor, 1))
        while size < wanted:
            sizes.add(int(size))
            size *= GRID_STEP
        found = []
        for n in sorted(sizes):
            streamed = n > cpu_limit
            model = self.models.streamed if streamed else self.models.cpu
            if not model.ready:
                return None
            if self._decode_s is None:
                return None
            # the chunk's rows without its attention pairs: those cost the same however cut
            rows = StepShape(base.num_tokens + n, base.num_attention_pairs)
            step_s = max(model.seconds(rows), self._decode_s)
            found.append(_Chunk(n, step_s / n, (step_s - self._decode_s) / n, streamed))
        return found

    def _within_target(self, base: StepShape, start: int, wanted: int, streamed: bool) -> int:
        """The largest chunk whose step stays within the stall target (the floor at least;
        where streaming is the faster way, the streaming threshold at least)."""
        limit = self._decode_s + self.stall_target_s
        if streamed:
            least = self.models.stream_threshold - self.num_prefill_rows
            n = self.models.streamed.prompt_tokens_within(base, start, limit, wanted)
            return max(n, least)
        cpu_limit = wanted
        if self.models.stream_threshold is not None:
            cpu_limit = min(wanted, self.models.stream_threshold - self.num_prefill_rows - 1)
        n = self.models.cpu.prompt_tokens_within(base, start, limit, max(cpu_limit, 1))
        return max(n, min(self.floor, wanted)) if self.num_prefill_rows == 0 else n
