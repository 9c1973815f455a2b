"""Qwen3-Coder: each call a function tag holding one tag per parameter, its value on lines of
its own:

<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
<parameter=days>
3
</parameter>
</function>
</tool_call>

Values: raw text for strings, JSON for objects and arrays, Python's spelling for other scalars
(tagged_args.py reads them by the tool's schema); the newline after the opening tag and the one
before the closing tag belong to the format, not the value.
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
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_END = "\n" + PARAMETER_END
CLOSED = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)
FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)(?:</function>\s*|$)", re.DOTALL)
PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
OPEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>(.*)$", re.DOTALL)


def _value(raw: str) -> str:
    """The value without the newlines the format puts around it."""
    raw = raw.removeprefix("\n")
    return raw.removesuffix("\n")


def _parameters(text: str) -> tuple[list[tuple[str, str]], str]:
    """(name, value) of each complete parameter at the start of `text`, and what follows them."""
    pairs, at = [], 0
    while (m := PARAMETER.match(text, at)) is not None:
        pairs.append((m.group(1).strip(), _value(m.group(2))))
        at = m.end()
    return pairs, text[at:]


class Qwen3CoderToolParser(TaggedArgumentsParser):
    name = "qwen3_coder"
    start = START
    markers = (START, END, FUNCTION_START, FUNCTION_END, PARAMETER_START, PARAMETER_END)
    value_end = VALUE_END

    @classmethod
    def writes(cls, chat_template: str) -> bool:
        return FUNCTION_START in chat_template and PARAMETER_START in chat_template

    def _call(self, body: str) -> tuple[str, str] | None:
        m = FUNCTION.fullmatch(body.rstrip() + "\n")
        if m is None or not NAME.fullmatch(m.group(1).strip()):
            return None
        name = m.group(1).strip()
        pairs, left = _parameters(m.group(2))
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
        head = tail.lstrip()
        if END in tail or not head.startswith(FUNCTION_START) or ">" not in head:
            return None
        name, _, rest = head[len(FUNCTION_START) :].partition(">")
        if not NAME.fullmatch(name.strip()):
            return None
        name = name.strip()
        pairs, left = _parameters(rest)
        opened = OPEN_PARAMETER.match(left)
        if opened is None or "\n" not in opened.group(2):  # NOTE: the name is whole at its ">"
            return name, self.streamed(name, pairs, None, "")
        return name, self.streamed(name, pairs, opened.group(1).strip(),
                                   opened.group(2).removeprefix("\n"))  # fmt: skip

    def after_start(self, functions: list[FunctionSpec], parallel: bool) -> str:
        rules = []
        for i, f in enumerate(functions):
            items = [lark_string(f"\n{FUNCTION_START}{f.name}>\n")]
            for j, (key, schema, required) in enumerate(properties_in_order(f)):
                head = lark_string(f"{PARAMETER_START}{key}>\n")
                tail = lark_string(f"{VALUE_END}\n")
                rules.append(f"param_{i}_{j}: {head} {self.value_rule(schema)} {tail}")
                items.append(f"param_{i}_{j}" + ("" if required else "?"))
            closing = lark_string(f"{FUNCTION_END}\n{END}")
            rules.append(f"call_{i}: {' '.join(items)} {closing}")
        more = ""
        if parallel:
            more = f' ("\\n" {lark_string(START)} call){{0,{MAX_PARALLEL_CALLS - 1}}}'
        alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
        head = f"after_start: call{more}\ncall: {alternatives}\n"
        return head + "\n".join(rules) + "\n" + self.value_terminals()
