"""Hermes / Qwen2.5 / Qwen3: each call a JSON object between tags, one after another:

<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

import json
import re

from gpu_service.api.tool_parsers.base import (
    MAX_PARALLEL_CALLS,
    FunctionSpec,
    ToolParser,
    arguments_json,
    call_object_schema,
    lark_json,
    raw_arguments,
    safe_prefix,
)

CLOSED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAIL = re.compile(r"<tool_call>\s*(\{.*\})\s*$", re.DOTALL)
# NOTE: the order templates write and models keep; another order parses whole, unstreamed
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")

    def calls(self, section: str, final: bool) -> list[tuple[str, str]]:
        bodies = CLOSED.findall(section)
        if final:
            tail = OPEN_TAIL.search(section[section.rfind(self.start) :])
            if tail and "</tool_call>" not in tail.group(0):
                bodies.append(tail.group(1))
        out = []
        for body in bodies:
            call = _as_written(body) or _parsed(body)
            if call is not None:
                out.append(call)
        return out

    def open_call(self, section: str) -> tuple[str, str] | None:
        tail = section[section.rfind(self.start) + len(self.start) :]
        head = HEAD.match(tail)
        if "</tool_call>" in tail or head is None:
            return None
        args = safe_prefix(tail[head.end() :], "</tool_call>")
        if args.endswith("}"):  # perhaps the call object's own end
            args = args[:-1].rstrip()
        return json.loads(f'"{head.group(1)}"'), args

    def after_start(self, functions: list[FunctionSpec], parallel: bool) -> str:
        first = '"\\n" call_object "\\n</tool_call>"'
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return (
            f"after_start: {first}{more}\n"
            'call: "<tool_call>\\n" call_object "\\n</tool_call>"\n'
            f"call_object: {lark_json(call_object_schema(functions))}\n"
        )


def _as_written(body: str) -> tuple[str, str] | None:
    """(name, arguments as written) of `{"name": ..., "arguments": {...}}`."""
    head = HEAD.match(body)
    rest = body[head.end() :].rstrip() if head else ""
    if not rest.endswith("}"):
        return None
    args = raw_arguments(rest[:-1])
    return (json.loads(f'"{head.group(1)}"'), args) if args is not None else None


def _parsed(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = arguments_json(obj.get("arguments", obj.get("parameters", {})))
    return (obj["name"], args) if args is not None else None
