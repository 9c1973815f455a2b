"""Mistral / Mixtral: `[TOOL_CALLS]` then the calls.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]     (v3 tokenizers:
                                                   Mistral-7B-Instruct-v0.3, Mixtral-8x22B)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                              (v11 and later)

Mistral's templates require tool-call ids of 9 letters and digits, so the ids made here are.
The v3 form's calls stream (name, then arguments); the v11 form's each whole.
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
    call_object,
    call_object_schema,
    lark_json,
    open_call_object,
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
        calls, _ = self._listed(section)
        return calls

    def open_call(self, section: str) -> tuple[str, str] | None:
        if ARGS in section:
            return None  # the v11 form streams each call whole
        _, tail = self._listed(section)
        return open_call_object(tail, "]") if tail is not None else None

    def _listed(self, section: str) -> tuple[list[tuple[str, str]], str | None]:
        """The v3 form: the complete call objects of `[{...}, {...}` (a single object without
        the list too), and the text of the one being written (None: none is)."""
        body = section[len(TOOL_CALLS) :].lstrip()
        at = 1 if body.startswith("[") else 0
        decoder, calls = json.JSONDecoder(), []
        while True:
            at += len(body[at:]) - len(body[at:].lstrip(" \n\t,"))
            if at >= len(body) or body[at] != "{":
                return calls, None
            try:
                _, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return calls, body[at:]
            call = call_object(body[at:end])
            if call is None:
                return calls, None
            calls.append(call)
            at = end

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
