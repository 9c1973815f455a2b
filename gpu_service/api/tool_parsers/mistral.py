"""Mistral / Mixtral: `[TOOL_CALLS]` then the calls.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]     (v3 tokenizers:
                                                   Mistral-7B-Instruct-v0.3, Mixtral-8x22B)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                              (v11 and later)

Mistral's templates require tool-call ids of 9 letters and digits, so the ids made here are.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from gpu_service.api.tool_parsers.base import (
    MAX_PARALLEL_CALLS,
    FunctionSpec,
    ToolParser,
    arguments_json,
    call_object_schema,
    lark_json,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAMED = re.compile(r"\[TOOL_CALLS\]\s*([^\[\]\s{]+?)\s*(?:\[CALL_ID\]\s*\w+\s*)?\[ARGS\]")
ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    start = TOOL_CALLS
    markers = (TOOL_CALLS, ARGS, "[CALL_ID]")

    def new_id(self) -> str:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))

    def calls(self, section: str, final: bool) -> list[tuple[str, str]]:
        if ARGS in section:
            return self._named(section, final)
        body = section[len(TOOL_CALLS) :].strip()
        try:
            value, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return []
        out = []
        for obj in value if isinstance(value, list) else [value]:
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = arguments_json(obj.get("arguments", {}))
                if args is not None:
                    out.append((obj["name"], args))
        return out

    def _named(self, section: str, final: bool) -> list[tuple[str, str]]:
        heads = list(NAMED.finditer(section))
        out = []
        decoder = json.JSONDecoder()
        for head in heads:
            rest = section[head.end() :].lstrip()
            try:
                value, _ = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                continue
            args = arguments_json(value)
            if args is not None:
                out.append((head.group(1), args))
        return out

    def after_start(self, functions: list[FunctionSpec], parallel: bool) -> str:
        array = {"type": "array", "items": call_object_schema(functions), "minItems": 1}
        array["maxItems"] = MAX_PARALLEL_CALLS if parallel else 1
        return f'after_start: " " {lark_json(array)}\n'
