"""Incremental detokenization with stop strings: text deltas safe to stream.

Each new token decodes a short window, not the whole output: byte-level BPE and SentencePiece can
merge across tokens, so the window starts at the tokens already turned into text last time
(`_prefix`), and the new text is decode(window) minus decode(the window's already-read part).
Text is taken only once it does not end in a partial UTF-8 character; the sum of the taken parts
is decode(all output ids). A delta is released only when it cannot be the beginning of a stop
string (the last max(len(stop)) - 1 characters wait). Stop strings are looked for only once the
output has min_tokens tokens (as vLLM does), in the text not yet released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
PARTIAL = "\ufffd"  # what decode gives for bytes that are not yet a whole UTF-8 character


class Detokenizer:
    def __init__(self, decode: Decode, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self._exempt = 0  # characters of text decoded before min_tokens (no stop looked for)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of self.text already released
        self.stopped = False
        self.stopped_by: str | None = None  # the stop string that ended the output
        self._prefix = 0  # output ids [_prefix, _read) were decoded into text last time
        self._read = 0
        self._decoded = ""  # decode(output ids [0, _read))
        self._last_ids: Sequence[int] = ()

    def add(self, output_ids: Sequence[int]) -> str:
        """Text newly released after the output grew to `output_ids`; sets `stopped` when a stop
        string appeared (the text is cut before it)."""
        text = self._advance(output_ids, final=False)
        if len(output_ids) < self.min_tokens:
            self._exempt = len(text)  # NOTE: never searched, even once min_tokens is reached
        for s in self.stop if len(output_ids) >= self.min_tokens else ():
            at = text.find(s, max(0, max(self.sent, self._exempt) - len(s) + 1))
            if at >= 0:
                self.text = text[:at]
                self.stopped, self.stopped_by = True, s
                return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self.holdback)

    def flush(self) -> str:
        """Everything not yet released (the request ended without a stop string), an unfinished
        character at the end included."""
        if not self.stopped:
            self.text = self._advance(self._last_ids, final=True)
        return self._release(len(self.text))

    def _advance(self, output_ids: Sequence[int], final: bool) -> str:
        """decode(output_ids), computed from the last window on."""
        self._last_ids = output_ids
        if len(output_ids) > self._read:
            before = self.decode(output_ids[self._prefix : self._read])
            window = self.decode(output_ids[self._prefix :])
            if final or (len(window) > len(before) and not window.endswith(PARTIAL)):
                self._decoded += window[len(before) :]
                self._prefix, self._read = self._read, len(output_ids)
        return self._decoded

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta
