"""Incremental detokenization with stop strings: text deltas safe to stream.

Text is decoded from all output ids each time (byte-level BPE can merge across tokens) and a
delta is released only when it is final: not ending in a partial UTF-8 character, and not
possibly the beginning of a stop string (the last max(len(stop)) - 1 characters wait).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class Detokenizer:
    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of self.text already released
        self.stopped = False

    def add(self, output_ids: Sequence[int]) -> str:
        """Text newly released after the output grew to `output_ids`; sets `stopped` when a stop
        string appeared (the text is cut before it)."""
        text = self.decode(output_ids)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.text = text[:at]
                self.stopped = True
                return self._release(len(self.text))
        self.text = text
        safe = len(text) - self.holdback
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence so far
            safe = min(safe, len(text.rstrip("\ufffd")))
        return self._release(safe)

    def flush(self) -> str:
        """Everything not yet released (the request ended without a stop string)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta
