"""Where a MoE call's time goes inside the worker: per-part timings of a channel's last calls.

Each call leaves six CLOCK_MONOTONIC stamps (ns; time.monotonic_ns's clock, shared by the
processes of a host), taken in C where they happen (ktshm Channel.call_stamps, MoEKernel
.last_forward)::

    visible     the producer published the request (its commit; 0: not stamped)
    ready       the channel thread first looked for it (its first recv_request after its last call)
    awake       it found the request (its wait returned)
    kernel_start, kernel_end    the kernel's C part (routing, then the thread pool's run)
    published   the reply's word was stored (a sleeping producer is woken after)

and the parts (PARTS), in the order a call goes through them::

    queued      ready - visible when the request came before the worker was ready for it, else 0
    wake        awake - max(visible, ready): the wait's spin, or its wake-up from the semaphore
    dispatch    kernel_start - awake: slot metadata decoded into arrays, checks, the reply's
                layout, the Python call into the kernel
    kernel      kernel_end - kernel_start
    publish     published - kernel_end
    bookkeeping the next call's ready - published: waking a sleeping producer, stats, metrics,
                the serving loop (-1 for a
                channel's last call: not known yet)

queued + wake + dispatch + kernel + publish = published - visible: the call as the worker saw
it. Bookkeeping runs after the reply, so it costs a caller only when its next request comes
before it ends (then it shows as that request's queued).
"""

from __future__ import annotations

from collections import deque

import numpy as np

PARTS = ("queued", "wake", "dispatch", "kernel", "publish", "bookkeeping")
_VISIBLE, _READY, _AWAKE, _KSTART, _KEND, _PUBLISHED, _CHAINED = range(7)


class CallTimings:
    """The stamps of one channel's last `capacity` kernel calls (oldest dropped). Its thread
    records; anyone reads (NOTE: deque append and list(deque) are atomic under the GIL)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._rows: deque[tuple[int, ...]] = deque(maxlen=capacity)
        self._chained = 0  # 1: the previous call on the channel is the last row

    def record(self, stamps: tuple[int, int, int, int], kernel_ns: tuple[int, int]) -> None:
        """A kernel call: stamps from Channel.call_stamps(), kernel_ns from the kernel's
        last_forward()[:2]."""
        visible, ready, awake, published = stamps
        self._rows.append((visible, ready, awake, kernel_ns[0], kernel_ns[1], published,
                           self._chained))  # fmt: skip
        self._chained = 1

    def skip(self) -> None:
        """A call that is not recorded (a ping, an error reply) ran after the last row: that
        row's bookkeeping ends at a ready this ring never sees."""
        self._chained = 0

    def parts(self) -> dict[str, np.ndarray]:
        """Each part's nanoseconds per recorded call, oldest first (PARTS; bookkeeping -1 where
        not known)."""
        rows = np.array(list(self._rows), dtype=np.int64).reshape(-1, 7)
        return parts_of(rows)


def parts_of(rows: np.ndarray) -> dict[str, np.ndarray]:
    """PARTS of stamp rows [N, 7] (see CallTimings)."""
    visible, ready, awake = rows[:, _VISIBLE], rows[:, _READY], rows[:, _AWAKE]
    kstart, kend, published = rows[:, _KSTART], rows[:, _KEND], rows[:, _PUBLISHED]
    # a call's bookkeeping ends where the next call's ready is, when that call followed it
    ready_next = np.full(len(rows), -1, dtype=np.int64)
    follows = rows[1:, _CHAINED] == 1
    ready_next[:-1] = np.where(follows, ready[1:], -1)
    stamped = visible > 0
    start = np.where(stamped, np.maximum(visible, ready), ready)
    return {
        "queued": np.where(stamped, np.maximum(ready - visible, 0), 0),
        "wake": awake - start,
        "dispatch": kstart - awake,
        "kernel": kend - kstart,
        "publish": published - kend,
        "bookkeeping": np.where(ready_next >= 0, ready_next - published, -1),
    }
