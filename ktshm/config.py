"""Channel configuration."""

from __future__ import annotations

from dataclasses import dataclass

MAX_SLOTS = 4096


@dataclass(frozen=True)
class ChannelConfig:
    """Sizes and timing of one channel; the producer's sizes are what the segment is built with.

    num_slots: requests that can be in flight at once.
    region_bytes: payload bytes of one request (and, separately, of one reply).
    spin_us: how long a waiter spins before it blocks on the semaphore.
    peer_timeout_s: a peer whose heartbeat is older than this is declared dead.
    heartbeat_period_s: how often each side stamps its heartbeat.
    default_timeout_s: deadline of a wait given no timeout.
    """

    num_slots: int = 8
    region_bytes: int = 1 << 20
    spin_us: float = 200.0
    peer_timeout_s: float = 0.5
    heartbeat_period_s: float = 0.02
    default_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in [1, {MAX_SLOTS}], got {self.num_slots}")
        if self.region_bytes <= 0:
            raise ValueError(f"region_bytes must be positive, got {self.region_bytes}")
        if self.spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {self.spin_us}")
        if self.default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be positive, got {self.default_timeout_s}")
        if self.heartbeat_period_s <= 0 or self.peer_timeout_s <= 2 * self.heartbeat_period_s:
            raise ValueError(
                "need heartbeat_period_s > 0 and peer_timeout_s > 2 * heartbeat_period_s, got "
                f"{self.heartbeat_period_s} and {self.peer_timeout_s}"
            )
