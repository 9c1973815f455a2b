"""Reasoning parsers: thinking to reasoning_content, the answer to content, whole and streamed in
random pieces; R1's missing opening tag; Qwen3 without thinking; templates' enable_thinking."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from gpu_service.api.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    prompt_opens_thinking,
)
from gpu_service.api.tokenizer import ServedTokenizer
from gpu_service.config import DEMO_MODEL_DIR
from tests.support import chat_templates

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
CASES = [
    # format, the prompt opened <think>, output, reasoning, content
    (R1, True, "Let me think.\n</think>\n\nIt is 4.", "Let me think.", "It is 4."),
    (R1, False, "<think>\nHmm.</think>The answer.", "Hmm.", "The answer."),
    (R1, False, "Still thinking when cut off", "Still thinking when cut off", ""),
    (QWEN3, False, "<think>\nSo 2+2.\n</think>\n\n4", "So 2+2.", "4"),
    (QWEN3, False, "No thinking at all.", None, "No thinking at all."),
    (QWEN3, False, "<thin", None, "<thin"),
    (QWEN3, True, "thinking opened by the template</think>ok", "thinking opened by the template",
     "ok"),
    (QWEN3, False, "  <think>a < b </thinker> c</think>d", "a < b </thinker> c", "d"),
]  # fmt: skip


@pytest.mark.parametrize("fmt, opened, output, reasoning, content", CASES)
def test_split_whole(fmt, opened, output, reasoning, content):
    assert ReasoningSplitter.split(fmt, output, opened) == (reasoning, content)


@pytest.mark.parametrize("fmt, opened, output, reasoning, content", CASES)
def test_split_streamed_in_random_pieces(fmt, opened, output, reasoning, content, seed):
    rng = random.Random(seed)
    for _ in range(10):
        splitter = ReasoningSplitter(fmt, opened)
        got_r, got_c, at = "", "", 0
        while at < len(output):
            n = rng.randint(1, 4)
            r, c = splitter.feed(output[at : at + n])
            got_r, got_c, at = got_r + r, got_c + c, at + n
        r, c = splitter.finish()
        got_r, got_c = got_r + r, got_c + c
        assert got_c == content
        assert got_r.rstrip() == (reasoning or "")


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_enable_thinking_reaches_the_template():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    tokenizer.chat_template = chat_templates.QWEN3
    served = ServedTokenizer(tokenizer, [0])
    messages = [{"role": "user", "content": "2+2?"}]
    _, thinking = served.render_chat(lambda _: messages)
    _, direct = served.render_chat(lambda _: messages, None, {"enable_thinking": False})
    assert thinking.endswith("<|im_start|>assistant\n")
    assert direct.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking(direct)


def test_thinking_then_a_tool_call_read_in_pieces(seed):
    """Qwen3 thinks, then calls a tool: reasoning, no content, one call, finish_reason
    tool_calls, however the text is cut into stream deltas."""
    from gpu_service.api.chat_output import OutputPlan, OutputReader
    from gpu_service.api.tool_parsers import tool_parser

    output = (
        "<think>\nThe user wants the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    plan = OutputPlan(tool_parser("hermes"), None, QWEN3, None)
    rng = random.Random(seed)
    for _ in range(10):
        reader = OutputReader(plan, prompt_opened=False)
        reasoning, content, calls, at = "", "", [], 0
        while at < len(output):
            n = rng.randint(1, 7)
            delta = reader.feed(output[at : at + n])
            reasoning, content, at = reasoning + delta.reasoning, content + delta.content, at + n
            calls += delta.calls
        delta = reader.finish()
        reasoning, content, calls = (
            reasoning + delta.reasoning,
            content + delta.content,
            calls + delta.calls,
        )
        assert reasoning.rstrip() == "The user wants the weather."
        assert content.strip() == ""
        assert [(c.name, c.arguments) for c in reader.calls] == [
            ("get_weather", '{"city": "Paris"}')
        ]
        assert calls[0].name == "get_weather" and calls[0].id == reader.calls[0].id
        assert "".join(c.arguments for c in calls) == '{"city": "Paris"}'
        assert reader.finish_reason("stop") == "tool_calls"
        assert reader.finish_reason("length") == "length"


@pytest.mark.parametrize("thinks", [True, False])
def test_constrained_output_may_think_first(thinks, seed):
    """A thinking model's constrained output: free thinking up to </think>, then only what the
    grammar allows (here a JSON object, sampled from random logits after the thinking)."""
    import json

    import torch

    from gpu_service.api.reasoning import thinking_grammar
    from gpu_service.api.tool_parsers.base import lark_json
    from gpu_service.engine.grammar import GrammarCompiler, TokenMasker

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [0, 2])
    grammar = compiler.compile_lark(thinking_grammar(f"start: {lark_json(schema)}\n", thinks))
    thought = "Is it ok? <b>Yes</b> it is.</think>\n\n"
    prefix = thought if thinks else "<think>" + thought
    ids = tokenizer(prefix, add_special_tokens=False).input_ids
    matcher = grammar.matcher()
    assert all(matcher.accept(i) for i in ids)
    masker, gen = TokenMasker(), torch.Generator().manual_seed(seed)
    for _ in range(50):
        logits = torch.randn(1, len(tokenizer), generator=gen)
        masker(logits, [matcher])
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert matcher.accept(token)
        ids.append(token)
        if matcher.done:
            break
    text = tokenizer.decode(ids, skip_special_tokens=True)
    fmt = R1 if thinks else QWEN3
    reasoning, content = ReasoningSplitter.split(fmt, text, prompt_opened=thinks)
    assert reasoning == "Is it ok? <b>Yes</b> it is."
    assert json.loads(content) in ({"ok": True}, {"ok": False})
    if not thinks:  # the thinking is optional: the answer alone is fine too
        direct = grammar.matcher()
        assert all(direct.accept(i) for i in tokenizer('{"ok": true}').input_ids)
        assert direct.llm.is_accepting()
