"""Tool calls found while the text streams, sent as OpenAI's tool-call deltas.

Content passes through until the parser's marker (a possible beginning of it at the end
waits). Then each call goes out as its model writes it: a first delta with its index, id and
name (arguments ""), once the parser knows the name (`open_call`); argument text as far as it
surely goes (never what may be a closing tag); the rest when the call is complete. Formats
without `open_call` send each call whole, in one delta, once complete. At the end a section in
which no call parsed goes out as content.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_service.api.tool_parsers.base import ToolCall, ToolParser


@dataclass
class CallDelta:
    index: int
    id: str | None  # the first delta of a call: its id and name
    name: str | None
    arguments: str

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class _Open:
    index: int
    id: str
    sent: str  # argument text sent so far


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []  # complete ones
        self._open: _Open | None = None
        self._pending = ""  # content held back: it may be the marker's beginning
        self._section: str | None = None

    @property
    def num_started(self) -> int:
        return len(self.calls) + (self._open is not None)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """(content to send, call deltas) after `text` more output."""
        if self._section is not None:
            self._section += text
            return "", self._deltas(final=False)
        self._pending += text
        start = self.parser.start
        at = self._pending.find(start)
        if at >= 0:
            content, self._section = self._pending[:at], self._pending[at:]
            self._pending = ""
            return content, self._deltas(final=False)
        keep = next((n for n in range(min(len(start) - 1, len(self._pending)), 0, -1)
                     if start.startswith(self._pending[-n:])), 0)  # fmt: skip
        cut = len(self._pending) - keep
        content, self._pending = self._pending[:cut], self._pending[cut:]
        return content, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._section is None:
            content, self._pending = self._pending, ""
            return content, []
        deltas = self._deltas(final=True)
        if not self.num_started:
            section, self._section = self._section, ""
            return section, []
        return "", deltas

    def _deltas(self, final: bool) -> list[CallDelta]:
        out: list[CallDelta] = []
        section = self._section or ""
        found = self.parser.calls(section, final)
        if self.max_calls is not None:
            found = found[: self.max_calls]
        for index in range(len(self.calls), len(found)):
            name, args = found[index]
            if self._open is not None and self._open.index == index:
                call_id, sent = self._open.id, self._open.sent
                rest = args[len(sent) :] if args.startswith(sent) else ""
                if rest:
                    out.append(CallDelta(index, None, None, rest))
                self._open = None
            else:
                call_id = self.parser.new_id()
                out.append(CallDelta(index, call_id, name, args))
            self.calls.append(ToolCall(name, args, call_id))
        room = self.max_calls is None or len(self.calls) < self.max_calls
        opened = self.parser.open_call(section) if not final and room else None
        if opened is not None:
            name, args = opened
            if self._open is None:
                self._open = _Open(len(self.calls), self.parser.new_id(), "")
                out.append(CallDelta(self._open.index, self._open.id, name, ""))
            sent = self._open.sent
            if len(args) > len(sent) and args.startswith(sent):
                out.append(CallDelta(self._open.index, None, None, args[len(sent) :]))
                self._open.sent = args
        return _merged(out)


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """One delta per call: a call's argument pieces joined to its first delta."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out
