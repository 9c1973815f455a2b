"""The runner executes what the scheduler decided: one forward step, the grammar masks of the
requests that have one (grammar.py; computed while the forward runs), then sampling. Given a
DecodeGraphConfig it builds DecodeGraphs (capturing batch 1's graphs now, the others on first
use), and decode steps that fit go through them; everything else runs the model's forward.
A step's copies between KV-cache tiers (prefix blocks evicted to host RAM or brought back) run
first, on the same stream, so the forward reads and overwrites those blocks after them.

A decode step whose rows all sample on the device (samples_on_device) can be started instead of
run: launched with its sampling and the samples' copy to the host enqueued behind it, then
waited for and collected. While it runs, the next step, chained to it (Scheduler.chain), is
prepared; once the device's step is through, the chained one is launched with its tokens taken
from the samples on the device, and only then are the first step's samples read:

    host    start(N)  prepare(N+1)  wait(N) | launch(N+1)  wake  collect(N)  prepare(N+2) ...
    device  [step N ........] [sample N] [step N+1 .........................] [sample N+1]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_service.attention.batch import Batch, SeqInput
from gpu_service.engine.decode_graphs import Bucket, DecodeGraphConfig, DecodeGraphs
from gpu_service.engine.grammar import TokenMasker
from gpu_service.engine.logits_processors import LogitsInput, TokenHistory, to_device
from gpu_service.engine.request import Request
from gpu_service.engine.sampling import SampledToken, Sampler
from gpu_service.engine.scheduler import ScheduledStep
from gpu_service.models.model import CausalLM


@dataclass(frozen=True)
class StepResult:
    tokens: tuple[SampledToken | None, ...]  # per scheduled sequence; None: a prompt chunk
    seconds: float
    graphed: bool = False  # the forward ran as CUDA graphs (DecodeGraphs)
    streamed: bool = False  # its prefill rows' experts streamed through the GPU (stream_prefill)
    sample_seconds: float = 0.0  # logits to token ids (the grammar masks applied, the sync waited)


@dataclass
class Started:
    """A decode step launched on the device with its sampling behind it (Runner.start / launch):
    wait() for the device, then collect() its tokens."""

    step: ScheduledStep
    tokens: torch.Tensor  # [B] int64 on the device: the rows' samples
    host_tokens: torch.Tensor  # [B] int64: their copy to the host (pinned on CUDA)
    copied: torch.cuda.Event | None  # recorded after that copy (None off CUDA)
    launched_at: float
    launch_seconds: float  # the host's call that launched its graph (DecodeGraphs.launch)
    replay_seconds: float = 0.0  # of which the graph's replay() call (0: not a graph replay)
    done_at: float | None = None


@dataclass(frozen=True)
class Prepared:
    """A chained step's inputs, made while the step it continues runs (Runner.prepare)."""

    step: ScheduledStep
    batch: Batch
    bucket: Bucket  # its DecodeGraphs bucket, the host inputs filled
    tokens: torch.Tensor  # [B] the rows' input ids on the device: the last step's samples


def samples_on_device(request: Request) -> bool:
    """Whether the request's next token is sampled from its params alone: no grammar, no
    penalties (their counts follow the output), no logprobs (read beside the token), and
    min_tokens reached (it masks by the output's length, which a chained step's sampling sees
    one token short)."""
    p = request.params
    return (request.matcher is None and not p.penalized and not p.logprobs
            and len(request.output) >= p.min_tokens)  # fmt: skip


class Runner:
    def __init__(self, model: CausalLM, graph_config: DecodeGraphConfig | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:  # fmt: skip
        """graph_config: None runs every step through model.forward. The model's KV cache must
        be the one it serves with: the graphs capture its tensors. eos_token_ids: what a
        request's min_tokens holds back."""
        self.model = model
        self.decode_graphs: DecodeGraphs | None = None
        if graph_config is not None:
            self.decode_graphs = DecodeGraphs(model, graph_config)
            self.decode_graphs.warm_up()
        self.sampler = Sampler(eos_token_ids)
        self.masker = TokenMasker()
        self.vocab_size = model.config.vocab_size

    def close(self) -> None:
        """Drop the decode graphs (their device calls' channels closed): before the KV cache
        they captured goes."""
        if self.decode_graphs is not None:
            self.decode_graphs.close()
            self.decode_graphs = None

    def run(self, step: ScheduledStep) -> StepResult:
        start = time.perf_counter()
        self.model.kv_cache.copy_blocks(step.block_copies)
        if not step.seqs:
            return StepResult((), time.perf_counter() - start)
        batch = _batch(step)
        graphs = self.decode_graphs
        graphed = graphs is not None and graphs.supports(batch.seqs)
        model = graphs if graphed else self.model
        rows = [i for i, s in enumerate(step.seqs) if s.samples]
        requests = [step.seqs[i].request for i in rows]
        matchers = [r.matcher for r in requests]
        masks = None
        if any(m is not None for m in matchers):  # constrained decoding: computed meanwhile
            masks = self.masker.fill(matchers, self.vocab_size, self.model.device.type == "cuda")
        logits = model.forward(batch)[rows]  # [N, V] float32
        forwarded = time.perf_counter()
        if masks is not None:
            self.masker.apply(logits, masks)  # disallowed tokens -inf
        sampled = self.sample(logits, requests) if rows else []
        tokens: list[SampledToken | None] = [None] * len(step.seqs)
        for i, token in zip(rows, sampled):
            tokens[i] = token
        streamed = not graphed and self.model.last_step_streamed
        end = time.perf_counter()
        return StepResult(tuple(tokens), end - start, graphed, streamed, end - forwarded)

    # ------------------------------------------------------------------ started steps
    @property
    def chains(self) -> bool:
        """Whether decode steps are started and chained (DecodeGraphConfig.chain_steps)."""
        return self.decode_graphs is not None and self.decode_graphs.config.chain_steps

    def can_start(self, step: ScheduledStep) -> bool:
        """Whether `step` can go through start() (else run()): a graphed decode step whose
        rows all sample on the device."""
        return (
            self.chains
            and bool(step.seqs)
            and self.decode_graphs.supports(step.seqs)
            and all(s.samples and samples_on_device(s.request) for s in step.seqs)
        )

    def start(self, step: ScheduledStep) -> Started:
        """Launch a step can_start() took (its graphs captured first where they are not yet)."""
        self.model.kv_cache.copy_blocks(step.block_copies)
        batch = _batch(step)
        return self._launch(step, batch, self.decode_graphs.prepare(batch), None)

    def prepare(self, step: ScheduledStep, after: Started) -> Prepared | None:
        """The inputs of `step`, chained to `after`, made while `after` runs: its host inputs
        filled and its tokens (each row's request's sample in `after`) picked on the stream;
        None where its bucket has no graphs yet (a capture runs a step: it waits)."""
        batch = _batch(step)
        bucket = self.decode_graphs.prepare(batch, capture=False)
        if bucket is None:
            return None
        rows = {id(s.request): i for i, s in enumerate(after.step.seqs)}
        index = [rows[id(s.request)] for s in step.seqs]
        if index == list(range(len(index))):
            tokens = after.tokens[: len(index)]
        else:
            tokens = after.tokens[to_device(torch.tensor(index), after.tokens.device)]
        return Prepared(step, batch, bucket, tokens)

    def launch(self, prepared: Prepared) -> Started:
        """Launch a prepared step once the step it continues is waited for."""
        self.model.kv_cache.copy_blocks(prepared.step.block_copies)
        return self._launch(prepared.step, prepared.batch, prepared.bucket, prepared.tokens)

    def _launch(self, step: ScheduledStep, batch: Batch, bucket,
                tokens: torch.Tensor | None) -> Started:  # fmt: skip
        launched_at = time.perf_counter()
        logits = self.decode_graphs.launch(batch, bucket, tokens)  # [B, V] float32
        launch_seconds = time.perf_counter() - launched_at
        requests = [s.request for s in step.seqs]
        rows = LogitsInput([r.params for r in requests], [len(r.output) for r in requests])
        sampled = self.sampler.sample_ids(logits, rows, [r.generator for r in requests])
        copied = None
        if sampled.is_cuda:
            host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            host.copy_(sampled, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = sampled.clone()
        # NOTE: after the sampling is queued: the host's next work (the last step's tokens, the
        # next step's decision) overlaps this step's layers, with the workers woken for them
        self.decode_graphs.wake()
        return Started(step, sampled, host, copied, launched_at, launch_seconds,
                       self.decode_graphs.last_replay_seconds)  # fmt: skip

    def wait(self, started: Started) -> None:
        """Host: until the started step's device work is through (raises what the step failed
        with: DeviceCalls.wait)."""
        self.decode_graphs.wait()
        started.done_at = time.perf_counter()

    def collect(self, started: Started) -> StepResult:
        """The started step's tokens (after wait())."""
        start = time.perf_counter()
        if started.copied is not None:
            started.copied.synchronize()
        tokens = tuple(SampledToken(t) for t in started.host_tokens.tolist())
        end = time.perf_counter()
        return StepResult(tokens, started.done_at - started.launched_at, graphed=True,
                          sample_seconds=end - start)  # fmt: skip

    # ------------------------------------------------------------------ sampling
    def sample(self, logits, requests: list[Request]) -> list[SampledToken]:
        """The rows' tokens; penalized requests keep their counts on the device (history)."""
        params = [r.params for r in requests]
        generators = [r.generator for r in requests]
        num_output = [len(r.output) for r in requests]
        counts = seen = None
        if any(p.penalized for p in params):
            vocab, device = logits.shape[1], logits.device
            zeros = torch.zeros(vocab, device=device)
            for r in requests:
                if r.params.penalized:
                    if r.history is None:
                        r.history = TokenHistory(r.prompt_ids, vocab, device,
                                                 r.params.repetition_penalty != 1)  # fmt: skip
                    r.history.update([t.token_id for t in r.output[r.history.num_counted :]])
            counts = torch.stack([r.history.output_counts if r.history is not None else zeros
                                  for r in requests])  # fmt: skip  # [B, V]
            if any(p.repetition_penalty != 1 for p in params):
                no = zeros.bool()
                seen = torch.stack([r.history.prompt_seen if r.history is not None
                                    and r.history.prompt_seen is not None else no
                                    for r in requests])  # fmt: skip  # [B, V]
        rows = LogitsInput(params, num_output, counts, seen)
        return self.sampler.sample_rows(logits, rows, generators)


def _batch(step: ScheduledStep) -> Batch:
    return Batch(tuple(SeqInput(s.token_ids, s.request.cache, s.start_pos) for s in step.seqs))
