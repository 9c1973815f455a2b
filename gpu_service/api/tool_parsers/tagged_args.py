"""Arguments written one tag pair per argument (GLM-4.5's <arg_key>/<arg_value>, Qwen3-Coder's
<parameter=P>), read back into OpenAI's arguments JSON.

The templates write a string argument as its raw text and any other value as JSON (Qwen3-Coder:
Python's spelling for scalars, True / False / None), so a value's type comes from the tool's
schema: an argument declared a string stays text; any other (or one not declared) is the JSON
value it parses as, else text. A parser learns the schemas per request (ToolParser.for_tools).

Arguments JSON is built pair by pair, `{"k1": v1, "k2": v2}`, so the text of the pairs complete
so far, and of a string value being written, is a prefix of the whole: what a stream sends.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from gpu_service.api.tool_parsers.base import (
    FunctionSpec,
    ToolParser,
    closed,
    lark_json,
    lark_string,
    safe_prefix,
    text_without,
)

PYTHON_LITERALS = {"True": True, "False": False, "None": None}
NAME = re.compile(r"[^\s<>]+")


def declares_string(schema: dict | None) -> bool:
    """Whether an argument's schema makes it a string (type string, or enum / const of strings)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        return kinds == ["string"]
    if kind is not None:
        return kind == "string"
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return bool(options) and all(isinstance(o, str) for o in options)


def decode_value(text: str, schema: dict | None) -> Any:
    if declares_string(schema):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return PYTHON_LITERALS.get(text.strip(), text)


def pair_text(key: str, value: Any) -> str:
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def arguments_text(pairs: list[tuple[str, Any]]) -> str:
    return "{" + ", ".join(pair_text(k, v) for k, v in pairs) + "}"


def open_arguments_text(
    pairs: list[tuple[str, Any]], open_key: str | None, open_text: str, schema: dict | None
) -> str:
    """What surely begins arguments_text of a call whose `pairs` are complete and whose next
    argument `open_key` (None: none begun) has `open_text` written so far (its closing tag
    possibly begun: cut by the caller); a string value streams, others wait until complete."""
    done = [pair_text(k, v) for k, v in pairs]
    if open_key is not None and declares_string(schema):
        value = json.dumps(open_text, ensure_ascii=False)[:-1]  # NOTE: no closing quote yet
        done.append(f"{json.dumps(open_key, ensure_ascii=False)}: {value}")
    return "{" + ", ".join(done) if done else ""


class TaggedArgumentsParser(ToolParser):
    """A format with one tag pair per argument: its arguments' types from the request's tools."""

    value_end: str  # the text that ends a value (the grammar's free text stops before it)

    def __init__(self) -> None:
        self.schemas: dict[str, dict[str, dict]] = {}  # function -> argument -> its schema

    def for_tools(self, functions: list[FunctionSpec]) -> TaggedArgumentsParser:
        bound = copy.copy(self)
        bound.schemas = {f.name: dict((f.parameters or {}).get("properties") or {})
                         for f in functions}  # fmt: skip
        return bound

    def schema_of(self, function: str, key: str) -> dict | None:
        return self.schemas.get(function, {}).get(key)

    def decoded(self, function: str, pairs: list[tuple[str, str]]) -> list[tuple[str, Any]]:
        return [(k, decode_value(v, self.schema_of(function, k))) for k, v in pairs]

    def streamed(self, function: str, pairs: list[tuple[str, str]], open_key: str | None,
                 open_text: str) -> str:  # fmt: skip
        """open_arguments_text of a call being written, the open value's closing tag cut."""
        schema = None if open_key is None else self.schema_of(function, open_key)
        text = safe_prefix(open_text, self.value_end) if open_key is not None else ""
        return open_arguments_text(self.decoded(function, pairs), open_key, text, schema)

    def value_rule(self, schema: dict) -> str:
        """Lark for one value as the format writes it: a string as raw text (its enum / const
        as alternatives), anything else as JSON matching the schema."""
        if not declares_string(schema):
            return lark_json(closed(schema))
        options = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if options:
            return "(" + " | ".join(lark_string(o) for o in options) + ")"
        return "VALUE_TEXT"

    def value_terminals(self) -> str:
        return f"VALUE_TEXT: /{text_without(self.value_end)}/\n"


def properties_in_order(spec: FunctionSpec) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of each declared argument, in the schema's order."""
    params = spec.parameters or {}
    required = set(params.get("required") or ())
    return [(k, v, k in required) for k, v in (params.get("properties") or {}).items()]
