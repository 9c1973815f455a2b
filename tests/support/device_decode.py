"""Greedy decode steps through DecodeGraphs against a real expert worker."""

from __future__ import annotations

import socket

import torch

from gpu_service.engine.decode_graphs import DecodeGraphs
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.models import Batch, SeqInput
from ktserve.worker_token import TOKEN_ENV
from tests.support.expert_procs import ExpertProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(path, port: int, token: str | None = None) -> ExpertProcess:
    """token: the one a worker before it on this port had (default: a fresh one)."""
    env = {TOKEN_ENV: token} if token else None
    return ExpertProcess("--model", str(path), "--format", "bf16", "--listen",
                         f"127.0.0.1:{port}", env=env)  # fmt: skip


class Decoder:
    """Greedy decode of a few sequences in `model` through `graphs`, step by step."""

    def __init__(self, model, graphs: DecodeGraphs, prompts: list[list[int]]) -> None:
        self.model, self.graphs = model, graphs
        self.kv = KVCacheManager(model.kv_cache.config)
        self.caches = [self.kv.allocate(len(p)) for p in prompts]
        self.pos = [len(p) for p in prompts]
        logits = model.forward(Batch(tuple(SeqInput(p, c, 0) for p, c in
                                           zip(prompts, self.caches))))  # fmt: skip
        self.tokens = logits.argmax(-1).tolist()

    def step(self, tokens: list[int] | None = None) -> torch.Tensor:
        tokens = self.tokens if tokens is None else tokens
        for cache, p in zip(self.caches, self.pos):
            self.kv.extend(cache, p + 1)
        batch = Batch(tuple(SeqInput([t], c, p) for t, c, p in
                            zip(tokens, self.caches, self.pos)))  # fmt: skip
        logits = self.graphs.forward(batch).clone()
        self.pos = [p + 1 for p in self.pos]
        self.tokens = logits.argmax(-1).tolist()
        return logits
