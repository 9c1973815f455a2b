"""What rank 0 tells each follower, over the follower's stdin (a pipe only rank 0 writes).

    frame    = length (8 bytes, little-endian) | pickle of one message
    Setup    first: the rank, the group's rendezvous (a TCPStore on rank 0) and what to load
    Cache    the KV cache to run the next steps on (sent whenever rank 0's cache object changes:
             the memory plan's profiling caches, then the serving one)
    Step     one forward: per sequence its tokens, start, cached length and cache blocks
    Stop     leave the group and exit (end of file: the same, rank 0 is gone)

The steps ride a pipe, not a collective: a follower waits for the next step as long as the
service is idle without any collective timing out, and learns of rank 0's death by end of file.
Step inputs are a few hundred bytes for a decode step of 16 sequences.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.batch import Batch
from gpu_service.kvcache.sequence import SeqCache
from gpu_service.layers.weight_formats import LinearQuantConfig

_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class Setup:
    rank: int
    world_size: int
    store_port: int
    backend: str  # "nccl" or "gloo"
    timeout_s: float
    model_dir: str
    device: str
    dtype: torch.dtype
    linear_quant: LinearQuantConfig
    attention: AttentionBackend


@dataclass(frozen=True)
class Cache:
    max_num_tokens: int
    dtype: torch.dtype
    block_size: int


@dataclass(frozen=True)
class SeqStep:
    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    num_cached: int  # the tokens its cache held before the step
    block_ids: tuple[int, ...]

    def cache(self, block_size: int) -> SeqCache:
        return SeqCache(self.seq_id, block_size, list(self.block_ids), self.num_cached)


@dataclass(frozen=True)
class Step:
    seqs: tuple[SeqStep, ...]
    all_positions: bool

    @classmethod
    def of(cls, batch: Batch, all_positions: bool) -> Step:
        seqs = tuple(
            SeqStep(
                s.cache.seq_id,
                tuple(s.token_ids),
                s.start_pos,
                s.cache.num_tokens,
                tuple(s.cache.block_ids),
            )  # fmt: skip
            for s in batch.seqs
        )
        return cls(seqs, all_positions)


@dataclass(frozen=True)
class Stop:
    pass


Message = Setup | Cache | Step | Stop


def encode(message: Message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def read_message(stream: BinaryIO) -> Message | None:
    """The next message, or None at end of file (rank 0 closed the pipe or died)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    body = stream.read(length)
    if len(body) < length:
        return None
    return pickle.loads(body)
