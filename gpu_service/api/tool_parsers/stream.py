"""Tool calls found while the text streams: content passes through until the parser's marker
(a possible beginning of it at the end waits), then each call is released once it is complete,
as one delta carrying its id, name and whole arguments (OpenAI's delta format; clients join
deltas by index). At the end a section in which no call parsed goes out as content."""

from __future__ import annotations

from gpu_service.api.tool_parsers.base import ToolCall, ToolParser


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._pending = ""  # content held back: it may be the marker's beginning
        self._section: str | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send, calls completed) after `text` more output."""
        if self._section is not None:
            self._section += text
            return "", self._new(final=False)
        self._pending += text
        start = self.parser.start
        at = self._pending.find(start)
        if at >= 0:
            content, self._section = self._pending[:at], self._pending[at:]
            self._pending = ""
            return content, self._new(final=False)
        keep = next((n for n in range(min(len(start) - 1, len(self._pending)), 0, -1)
                     if start.startswith(self._pending[-n:])), 0)  # fmt: skip
        cut = len(self._pending) - keep
        content, self._pending = self._pending[:cut], self._pending[cut:]
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._section is None:
            content, self._pending = self._pending, ""
            return content, []
        new = self._new(final=True)
        if not self.calls:
            section, self._section = self._section, ""
            return section, []
        return "", new

    def _new(self, final: bool) -> list[ToolCall]:
        found = self.parser.calls(self._section or "", final)
        if self.max_calls is not None:
            found = found[: self.max_calls]
        new = [ToolCall(n, a, self.parser.new_id()) for n, a in found[len(self.calls) :]]
        self.calls.extend(new)
        return new
