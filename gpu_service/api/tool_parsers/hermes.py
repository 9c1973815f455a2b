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
)

CLOSED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAIL = re.compile(r"<tool_call>\s*(\{.*\})\s*$", re.DOTALL)


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
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                continue
            args = arguments_json(obj.get("arguments", obj.get("parameters", {})))
            if args is not None:
                out.append((obj["name"], args))
        return out

    def grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        call = f'"<tool_call>\\n" {lark_json(call_object_schema(functions))} "\\n</tool_call>"'
        calls = f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "call"
        return f"start: {calls}\ncall: {call}\n"
