"""Hermes / Qwen2.5 / Qwen3: each call a JSON object between tags, one after another:

<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

import re

from gpu_service.api.tool_parsers.base import (
    MAX_PARALLEL_CALLS,
    FunctionSpec,
    ToolParser,
    call_object,
    call_object_schema,
    lark_json,
    open_call_object,
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
            call = call_object(body)
            if call is not None:
                out.append(call)
        return out

    def open_call(self, section: str) -> tuple[str, str] | None:
        tail = section[section.rfind(self.start) + len(self.start) :]
        if "</tool_call>" in tail:
            return None
        return open_call_object(tail, "</tool_call>")

    def after_start(self, functions: list[FunctionSpec], parallel: bool) -> str:
        first = '"\\n" call_object "\\n</tool_call>"'
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return (
            f"after_start: {first}{more}\n"
            'call: "<tool_call>\\n" call_object "\\n</tool_call>"\n'
            f"call_object: {lark_json(call_object_schema(functions))}\n"
        )
