"""Synthetic ChatML dialogues from documentation pages: a section heading becomes the user's
question and the section's opening prose the assistant's answer.

The rendering matches demo_model's chat template exactly (training.train_tokenizer.CHAT_TEMPLATE),
so `apply_chat_template(..., add_generation_prompt=True)` yields a prefix the model has seen.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Protocol

from training.html_text import Block

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
QUESTION_TEMPLATES = (
    "What is {topic}?",
    "Tell me about {topic}.",
    "Explain {topic}.",
    "Can you describe {topic}?",
    "What should I know about {topic}?",
    "{topic}",
)
MAX_ANSWER_CHARS = 700
MIN_ANSWER_CHARS = 60
_SECTION_NUMBER = re.compile(r"^(\d+\.)+\d*\s*")


class HasBlocks(Protocol):
    blocks: tuple[Block, ...]


def render_chatml(messages: Sequence[tuple[str, str]]) -> str:
    """ChatML text for (role, content) pairs, each message closed by IM_END and a newline."""
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)


def _topic(heading: str) -> str:
    return _SECTION_NUMBER.sub("", heading).strip()


def _answer(paragraphs: list[str]) -> str:
    """Opening prose, cut at a sentence end so it stays under MAX_ANSWER_CHARS."""
    text = " ".join(paragraphs)
    if len(text) <= MAX_ANSWER_CHARS:
        return text
    cut = text.rfind(". ", 0, MAX_ANSWER_CHARS)
    return text[: cut + 1] if cut >= MIN_ANSWER_CHARS else text[:MAX_ANSWER_CHARS].rstrip()


def chat_dialogues(docs: Sequence[HasBlocks], seed: int) -> list[str]:
    """One dialogue per heading that is directly followed by prose; question wording is seeded."""
    rng = random.Random(seed)
    dialogues = []
    for doc in docs:
        blocks = doc.blocks
        for i, block in enumerate(blocks):
            if block.kind != "heading":
                continue
            prose = []
            for nxt in blocks[i + 1 : i + 3]:
                if nxt.kind != "text":
                    break
                prose.append(nxt.text)
            topic, answer = _topic(block.text), _answer(prose)
            if len(topic) < 3 or len(answer) < MIN_ANSWER_CHARS:
                continue
            question = rng.choice(QUESTION_TEMPLATES).format(topic=topic)
            dialogues.append(render_chatml([("user", question), ("assistant", answer)]))
    return dialogues
