"""GLM-4.5 / 4.6 / 4.7: each call its name, then one key / value tag pair per argument:

<tool_call>get_weather
<arg_key>city</arg_key>
<arg_value>Paris</arg_value>
<arg_key>days</arg_key>
<arg_value>3</arg_value>
</tool_call>

(GLM-4.7 writes the same without the newlines.) Values: raw text for strings, JSON otherwise
(tagged_args.py reads them by the tool's schema).
"""

from __future__ import annotations

import re

from gpu_service.api.tool_parsers.base import MAX_PARALLEL_CALLS, FunctionSpec, lark_string
from gpu_service.api.tool_parsers.tagged_args import (
    NAME,
    TaggedArgumentsParser,
    arguments_text,
    properties_in_order,
)

START, END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
CALL_TAIL = "\n" + END  # what the grammar writes after the last argument
CLOSED = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)
PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
OPEN_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*)$", re.DOTALL)


def _split_name(body: str) -> tuple[str, str] | None:
    """(name, the argument pairs' text) of a call's body, once the name is surely whole."""
    at = min((i for i in (body.find("\n"), body.find("<")) if i >= 0), default=-1)
    if at < 0:
        return None
    name = body[:at].strip()
    return (name, body[at:]) if NAME.fullmatch(name) else None


def _pairs(text: str) -> tuple[list[tuple[str, str]], str]:
    """(key, raw value) of each complete pair at the start of `text`, and what follows them."""
    pairs, at = [], 0
    while (m := PAIR.match(text, at)) is not None:
        pairs.append((m.group(1).strip(), m.group(2)))
        at = m.end()
    return pairs, text[at:]


class Glm45ToolParser(TaggedArgumentsParser):
    name = "glm45"
    start = START
    markers = (START, END, KEY_START, KEY_END, VALUE_START, VALUE_END)
    value_end = VALUE_END

    @classmethod
    def writes(cls, chat_template: str) -> bool:
        return KEY_START in chat_template and START in chat_template

    def _call(self, body: str) -> tuple[str, str] | None:
        split = _split_name(body + "\n")
        if split is None:
            return None
        name, rest = split
        pairs, left = _pairs(rest)
        if left.strip():
            return None
        return name, arguments_text(self.decoded(name, pairs))

    def calls(self, section: str, final: bool) -> list[tuple[str, str]]:
        bodies = CLOSED.findall(section)
        tail = section[section.rfind(START) + len(START) :]
        if final and END not in tail:
            bodies.append(tail)
        found = [self._call(body) for body in bodies]
        return [call for call in found if call is not None]

    def open_call(self, section: str) -> tuple[str, str] | None:
        tail = section[section.rfind(START) + len(START) :]
        if END in tail:
            return None
        split = _split_name(tail)
        if split is None:
            return None
        name, rest = split
        pairs, left = _pairs(rest)
        opened = OPEN_PAIR.match(left)
        if opened is None:
            return name, self.streamed(name, pairs, None, "")
        return name, self.streamed(name, pairs, opened.group(1).strip(), opened.group(2))

    def after_start(self, functions: list[FunctionSpec], parallel: bool) -> str:
        rules = []
        for i, f in enumerate(functions):
            items = [lark_string(f.name)]
            for j, (key, schema, required) in enumerate(properties_in_order(f)):
                head = lark_string(f"\n{KEY_START}{key}{KEY_END}\n{VALUE_START}")
                value = self.value_rule(schema)
                rules.append(f"arg_{i}_{j}: {head} {value} {lark_string(VALUE_END)}")
                items.append(f"arg_{i}_{j}" + ("" if required else "?"))
            rules.append(f"call_{i}: {' '.join(items)} {lark_string(CALL_TAIL)}")
        more = ""
        if parallel:
            more = f' ("\\n" {lark_string(START)} call){{0,{MAX_PARALLEL_CALLS - 1}}}'
        alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
        head = f"after_start: call{more}\ncall: {alternatives}\n"
        return head + "\n".join(rules) + "\n" + self.value_terminals()
