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
    lark_json,
    lark_string,
    parameters_schema,
    raw_arguments,
    safe_prefix,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.DOTALL
)
FENCED = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
FENCE_OPEN = re.compile(r"\s*```(?:json)?[ \t]*\n\s*")


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
            args = raw_arguments(fenced.group(1) if fenced else body)
            if name.strip() and args is not None:
                out.append((name.strip(), args))
        return out

    def open_call(self, section: str) -> tuple[str, str] | None:
        tail = section[section.rfind(CALL_BEGIN) + len(CALL_BEGIN) :]
        if CALL_BEGIN not in section or CALL_END in tail or SEP not in tail:
            return None
        head, _, body = tail.partition(SEP)
        if head.strip() != "function":  # V3.1: the name, then the JSON
            return head.strip(), safe_prefix(body.lstrip(), CALL_END)
        if "\n" not in body:
            return None
        name, _, rest = body.partition("\n")
        fence = FENCE_OPEN.match(rest)
        if fence is not None:
            return name.strip(), safe_prefix(rest[fence.end() :], "\n```")
        if "```json\n".startswith(rest.lstrip()) or rest.lstrip().startswith("```"):
            return name.strip(), ""  # the fence is being written
        return name.strip(), safe_prefix(rest.lstrip(), CALL_END)

    def after_start(self, functions: list[FunctionSpec], parallel: bool) -> str:
        rules = []
        for i, f in enumerate(functions):
            head = lark_string(f"{CALL_BEGIN}function{SEP}{f.name}\n```json\n")
            tail = lark_string(f"\n```{CALL_END}")
            rules.append(f"call_{i}: {head} {lark_json(parameters_schema(f))} {tail}")
        calls = f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "call"
        alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
        return (
            f"after_start: {calls} {lark_string(CALLS_END)}\ncall: {alternatives}\n"
            + "\n".join(rules)
            + "\n"
        )
