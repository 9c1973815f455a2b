"""What every tool-call parser shares: the calls it finds, and the grammar helpers.

A model writes its calls after a marker (`start`): text before it is the message's content, the
section from it on holds the calls. `calls(section, final)` returns the calls complete so far
(final: the output ended; an unclosed last call counts if its JSON is whole). A section in which
no call parses is content after all (the model wrote the marker, then something else).
"""

from __future__ import annotations

import abc
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar

from gpu_service.engine.grammar import JSON_STYLE

# NOTE: a weak model may call tools without end; parallel calls stop at this many.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class FunctionSpec:
    """One tool as the request declared it: its name and its arguments' JSON schema."""

    name: str
    parameters: dict


@dataclass(frozen=True)
class Extracted:
    content: str | None
    calls: tuple[ToolCall, ...]


class ToolParser(abc.ABC):
    """One family's format; a parser defines the class variables and the abstract methods."""

    name: ClassVar[str]
    start: ClassVar[str]  # the text that opens the tool-call section
    markers: ClassVar[tuple[str, ...]]  # every tag it reads (tokens the decoder must keep)

    def new_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    @classmethod
    def writes(cls, chat_template: str) -> bool:
        """Whether a chat template writes calls in this format (by default: it has `start`)."""
        return cls.start in chat_template

    def for_tools(self, functions: list[FunctionSpec]) -> ToolParser:
        """The parser for one request's tools: itself, unless how it reads arguments depends on
        their declared types (tagged_args.py)."""
        return self

    @abc.abstractmethod
    def calls(self, section: str, final: bool) -> list[tuple[str, str]]:
        """(name, arguments JSON) of each complete call in `section` (it starts with `start`)."""

    def open_call(self, section: str) -> tuple[str, str] | None:
        """(name, arguments so far) of the call being written at the end of `section`, once its
        name is known; the arguments only as far as they surely go (never what may turn out to
        be the call's closing tag), a prefix of what `calls` returns once it is complete. None:
        no call open, or a format whose calls stream whole (the default)."""
        return None

    @abc.abstractmethod
    def after_start(self, functions: list[FunctionSpec], parallel: bool) -> str:
        """Lark rules (llguidance's dialect) whose rule `after_start` is what follows `start` in
        a section calling one of `functions` (several, when parallel) with arguments that
        match their schemas."""

    def grammar(
        self, functions: list[FunctionSpec], parallel: bool, free_text: bool = False
    ) -> str:
        """A Lark grammar of tool calls: the section alone (tool_choice required or named), or
        with free_text (tool_choice auto with strict tools) text without the marker, or text
        then the marker and a section whose calls match."""
        rules = self.after_start(functions, parallel)
        if not free_text:
            return f"start: {lark_string(self.start)} after_start\n{rules}"
        plain, prefix = _without(self.start)
        return f"start: PLAIN | PREFIX after_start\nPLAIN: /{plain}/\nPREFIX: /{prefix}/\n{rules}"

    def extract(self, text: str) -> Extracted:
        """The whole output split into content and calls."""
        at = text.find(self.start)
        if at < 0:
            return Extracted(text, ())
        found = self.calls(text[at:], final=True)
        if not found:
            return Extracted(text, ())
        content = text[:at].rstrip() or None
        return Extracted(content, tuple(ToolCall(n, a, self.new_id()) for n, a in found))


def raw_arguments(text: str) -> str | None:
    """Arguments as the model wrote them (stripped), if they are a JSON object."""
    text = text.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return text if isinstance(value, dict) else None


def safe_prefix(text: str, closing: str) -> str:
    """`text` without what may be `closing` (or its beginning) at its end, nor the blank before
    it: the part of a call's arguments that surely belongs to them."""
    at = text.find(closing)
    if at >= 0:
        text = text[:at]
    keep = next((n for n in range(min(len(closing) - 1, len(text)), 0, -1)
                 if closing.startswith(text[-n:])), 0)  # fmt: skip
    return text[: len(text) - keep].rstrip()


# NOTE: {"name": ..., "arguments": ...} in the order templates write and models keep; another
# order parses (call_object) but does not stream (open_call_object)
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def call_object(text: str) -> tuple[str, str] | None:
    """(name, arguments as written) of a call object `{"name": ..., "arguments": {...}, ...}`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    head = CALL_HEAD.match(text)
    if head is not None and isinstance(obj.get("arguments"), dict):
        _, end = json.JSONDecoder().raw_decode(text, head.end())
        return obj["name"], text[head.end() : end]
    args = arguments_json(obj.get("arguments", obj.get("parameters", {})))
    return (obj["name"], args) if args is not None else None


def open_call_object(text: str, closing: str) -> tuple[str, str] | None:
    """(name, arguments so far) of a call object being written (see ToolParser.open_call):
    once the arguments' JSON is whole, exactly it (whatever follows in the object)."""
    head = CALL_HEAD.match(text)
    if head is None:
        return None
    name = json.loads(f'"{head.group(1)}"')
    rest = text[head.end() :]
    try:
        _, end = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        return name, safe_prefix(rest, closing)
    return name, rest[:end]


def arguments_json(value: Any) -> str | None:
    """Arguments as JSON text: an object as is, JSON text checked; None if not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def closed(schema: Any) -> Any:
    """The schema with every object that lists properties closed (additionalProperties false
    unless it says otherwise): a narrowing, so what matches it matches the original too."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else closed(v))
           for k, v in schema.items()}  # fmt: skip
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def parameters_schema(spec: FunctionSpec) -> dict:
    return closed(spec.parameters or {"type": "object", "properties": {}})


def call_object_schema(functions: list[FunctionSpec]) -> dict:
    """{"name": <one of the functions>, "arguments": <its parameters>}, as Hermes and Mistral
    write a call."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": parameters_schema(f)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def lark_json(schema: dict) -> str:
    """A `%json` item of llguidance's Lark dialect, in JSON_STYLE."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def text_without(marker: str) -> str:
    """A regex (Rust's syntax) of text in which `marker` does not occur."""
    return _without(marker)[0]


def _char(c: str) -> str:
    return f"\\x{{{ord(c):X}}}"


def _without(marker: str) -> tuple[str, str]:
    """Regexes (Rust's syntax) of text in which `marker` does not occur, and of such text
    followed by the marker. Needs the marker's first character nowhere else in it (true of
    every format here); built as the automaton reads: a try at the marker that breaks off."""
    m0, rest = marker[0], marker[1:]
    assert m0 not in rest, marker

    def other(*chars: str) -> str:
        return "[^" + "".join(_char(c) for c in chars) + "]"

    broken = other(m0, rest[-1])  # after m0 and rest[:k], a character that is neither
    for k in range(len(rest) - 2, -1, -1):
        broken = f"{other(m0, rest[k])}|{_char(rest[k])}(?:{broken})"
    begun = ""  # a proper beginning of rest, possibly empty
    for k in range(len(rest) - 2, -1, -1):
        begun = f"{_char(rest[k])}(?:{begun})?" if begun else _char(rest[k])
    again = f"(?:{begun})?{_char(m0)}"  # a try broken off by m0 itself: a new try
    item = f"(?:{other(m0)}|{_char(m0)}(?:{again})*(?:{broken}))"
    plain = f"{item}*(?:{_char(m0)}(?:{again})*(?:{begun})?)?"
    prefix = f"{item}*{_char(m0)}(?:{again})*" + "".join(_char(c) for c in rest)
    return plain, prefix
