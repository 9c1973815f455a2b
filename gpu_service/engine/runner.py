"""The runner executes what the scheduler decided: one forward step, the grammar masks of the
requests that have one (grammar.py; computed while the forward runs), then sampling. Given a
DecodeGraphConfig it builds DecodeGraphs (capturing batch 1's graphs now, the others on first
use), and decode steps that fit go through them; everything else runs the model's forward.
A step's copies between KV-cache tiers (prefix blocks evicted to host RAM or brought back) run
first, on the same stream, so the forward reads and overwrites those blocks after them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_service.engine.decode_graphs import DecodeGraphConfig, DecodeGraphs
from gpu_service.engine.grammar import TokenMasker
from gpu_service.engine.logits_processors import LogitsInput, TokenHistory
from gpu_service.engine.request import Request
from gpu_service.engine.sampling import SampledToken, Sampler
from gpu_service.engine.scheduler import ScheduledStep
from gpu_service.models.batch import Batch, SeqInput
from gpu_service.models.model import CausalLM


@dataclass(frozen=True)
class StepResult:
    tokens: tuple[SampledToken | None, ...]  # per scheduled sequence; None: a prompt chunk
    seconds: float
    graphed: bool = False  # the forward ran as CUDA graphs (DecodeGraphs)
    streamed: bool = False  # its prefill rows' experts streamed through the GPU (stream_prefill)
    sample_seconds: float = 0.0  # logits to token ids (the grammar masks applied, the sync waited)


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
        batch = Batch(tuple(SeqInput(s.token_ids, s.request.cache, s.start_pos) for s in step.seqs))
        graphs = self.decode_graphs
        graphed = graphs is not None and graphs.supports(batch)
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
