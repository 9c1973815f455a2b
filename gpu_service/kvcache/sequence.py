"""One sequence's share of the KV cache: the handle the manager hands out (manager.py), which
steps carry to the model as data."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidSequenceCache(ValueError):
    """A handle that this cache did not hand out, or that was already freed."""


@dataclass
class SeqCache:
    """One sequence's share of the cache. `num_tokens`: positions [0, num_tokens) hold K/V.
    `num_hashed_blocks`: its first blocks already offered to the prefix cache."""

    seq_id: int
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    freed: bool = False
    num_hashed_blocks: int = 0

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end)."""
        bs = self.block_size
        return [self.block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def check_not_freed(self) -> None:
        if self.freed:
            raise InvalidSequenceCache(f"sequence cache {self.seq_id} was freed")
