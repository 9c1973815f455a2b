"""DeepSeek-V3 / R1 (and V3.1's shorter form): calls between special markers.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 writes `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`.
Several calls follow each other (a newline between them) inside one begin/end pair.
"""

from __future__ import annotations

import re

from gpu_service.api.tool_parsers.base import (
    MAX_PARALLEL_CALLS,
    FunctionSpec,
    ToolParser,
    arguments_json,
    lark_json,
    lark_string,
    parameters_schema,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.DOTALL
)
FENCED = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    start = CALLS_BEGIN
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def calls(self, section: str, final: bool) -> list[tuple[str, str]]:
        out = []
        for head, body in CALL.findall(section):
            head = head.strip()
            if head == "function" and "\n" in body:  # V3 / R1: type, then name and fenced JSON
                name, _, body = body.partition("\n")
            else:  # V3.1: name, then JSON
                name = head
            fenced = FENCED.match(body)
            args = arguments_json(fenced.group(1) if fenced else body.strip())
            if name.strip() and args is not None:
                out.append((name.strip(), args))
        return out

    def grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        rules = [
            f"call_{i}: {lark_string(CALL_BEGIN + 'function' + SEP + f.name + chr(10) + '```json' + chr(10))} "
            f"{lark_json(parameters_schema(f))} {lark_string(chr(10) + '```' + CALL_END)}"
            for i, f in enumerate(functions)
        ]
        calls = 'call ("\\n" call){0,%d}' % (MAX_PARALLEL_CALLS - 1) if parallel else "call"
        return (
            f"start: {lark_string(CALLS_BEGIN)} {calls} {lark_string(CALLS_END)}\n"
            f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}\n"
            + "\n".join(rules)
            + "\n"
        )
