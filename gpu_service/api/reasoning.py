"""Reasoning parsers: the model's thinking (between <think> and </think>) goes to
`reasoning_content`, the rest to `content`.

    deepseek_r1   the output starts inside the thinking, opening tag or not (R1's template opens
                  it in the prompt); no </think> at all: everything was thinking
    qwen3         thinking only if the output opens it (or the prompt did, as Qwen3-2507's
                  template does); with enable_thinking false the template closes it in the prompt

The split streams: `ReasoningSplitter.feed` returns (reasoning, content) deltas, holding back
what may be the beginning of a tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    always_thinks: bool  # the output is thinking from its first token, opening tag or not


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_thinks=True),
    "qwen3": ReasoningFormat("qwen3", always_thinks=False),
}


def choose_reasoning_parser(chat_template: str | None, model_type: str | None) -> str | None:
    """From the checkpoint: a template that writes <think> thinks; DeepSeek's (its turn markers)
    in R1's way, any other in Qwen3's."""
    template = chat_template or ""
    if START not in template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"


def thinking_grammar(lark: str, thinks: bool) -> str:
    """A grammar (its rule `start`) with a thinking allowed before it: required when the output
    starts inside one (thinks), else one the output opens itself. The thinking is free text
    that ends at the first </think> (included in the output)."""
    body = re.sub(r"^start:", "answer:", lark, flags=re.MULTILINE)
    thinking = "thinking answer_start" if thinks else '("<think>" thinking answer_start)?'
    return (
        f"start: {thinking} answer\n"
        f'thinking[suffix="{END}"]: /(.|\\n)*/\n'
        # NOTE: the blank lines models write after </think> belong to neither part
        "answer_start: /\\n*/\n" + body
    )


def prompt_opens_thinking(prompt: str) -> bool:
    """The rendered prompt ends inside an open <think> (the template opened it)."""
    tail = prompt.rstrip()
    return tail.endswith(START)


class ReasoningSplitter:
    def __init__(self, fmt: ReasoningFormat, prompt_opened: bool) -> None:
        self.thinking_by_default = fmt.always_thinks or prompt_opened
        self.state = "start"  # start -> thinking -> answer, or start -> answer
        self._buf = ""
        self.thought = False  # the output went through thinking
        self._answer_started = False
        self._reasoning_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self._buf.lstrip()
            if head.startswith(START):
                self.state, self._buf = "thinking", head[len(START) :]
            elif START.startswith(head):
                return "", ""  # it may still be the opening tag
            else:
                self.state = "thinking" if self.thinking_by_default else "answer"
        if self.state == "thinking":
            self.thought = True
            at = self._buf.find(END)
            if at >= 0:
                reasoning, self._buf = self._buf[:at], self._buf[at + len(END) :]
                self.state = "answer"
            else:
                keep = _partial_suffix(self._buf, END)
                cut = len(self._buf) - keep
                reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        if self.state == "answer":
            content, self._buf = self._answer(self._buf), ""
        return self._reasoning(reasoning), content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self.state == "start":
            self.state = "thinking" if self.thinking_by_default else "answer"
            rest = rest.lstrip() if self.state == "thinking" else rest
        if self.state == "thinking":
            self.thought = True
            return self._reasoning(rest), ""
        return "", self._answer(rest)

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip("\n")  # the newline models write after <think>
            self._reasoning_started = bool(text)
        return text

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            if self.thought:
                text = text.lstrip("\n")  # the blank line models write after </think>
            self._answer_started = bool(text)
        return text

    @staticmethod
    def split(fmt: ReasoningFormat, text: str, prompt_opened: bool) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        splitter = ReasoningSplitter(fmt, prompt_opened)
        r1, c1 = splitter.feed(text)
        r2, c2 = splitter.finish()
        return ((r1 + r2).rstrip() if splitter.thought else None), c1 + c2


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-n:])), 0)  # fmt: skip
