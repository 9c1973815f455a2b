"""GLM-4.5/4.6/4.7's and Qwen3-Coder's tool calls (one tag pair per argument) against their real
chat templates (tests/fixtures/chat_templates/, as llama.cpp ships them): arguments of every
JSON type rendered by the template and read back by the schema, whole and streamed a character
at a time; GLM's thinking split off first. The formats' shared checks (round trip, streaming in
random pieces, grammars) run with the others in test_tool_parsers.py."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from gpu_service.api.reasoning import REASONING_PARSERS, ReasoningSplitter, choose_reasoning_parser
from gpu_service.api.tool_parsers import (
    FunctionSpec,
    ToolCallStream,
    choose_tool_parser,
    tool_parser,
)
from gpu_service.config import DEMO_MODEL_DIR
from tests.support.chat_templates import GLM_46, GLM_47, QWEN3_CODER

EDIT = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "zip": {"type": "string"},
        "lines": {"type": "array", "items": {"type": "integer"}},
        "options": {"type": "object"},
        "force": {"type": "boolean"},
        "ratio": {"type": "number"},
        "note": {"type": ["string", "null"]},
    },
}
FUNCTIONS = [FunctionSpec("edit_file", EDIT)]
TOOLS = [{"type": "function", "function": {"name": "edit_file", "parameters": EDIT}}]
# a string that reads as JSON ("007", declared a string), Python's True in Qwen3-Coder's
# rendering, text with the tags' characters, quotes and a newline
ARGUMENTS = {"path": "dir/a b.txt", "zip": "007", "lines": [1, 2], "options": {"x": "y<z"},
             "force": True, "ratio": 0.25, "note": 'two\nlines, "quoted"'}  # fmt: skip
TEMPLATES = {"GLM-4.6": (GLM_46, "glm45"), "GLM-4.7-Flash": (GLM_47, "glm45"),
             "Qwen3-Coder": (QWEN3_CODER, "qwen3_coder")}  # fmt: skip


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def turn(hf_tokenizer, template: str, reasoning: str | None = None,
         **prompt_kwargs: object) -> tuple[str, str]:  # fmt: skip
    """(prompt, the assistant's turn after it) of a conversation whose assistant message calls
    edit_file with ARGUMENTS, rendered by the template."""
    assistant = {"role": "assistant", "content": "On it.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "edit_file", "arguments": ARGUMENTS}}]}  # fmt: skip
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    messages = [{"role": "user", "content": "Fix the file."}, assistant]

    def render(msgs, prompt, **kwargs):
        return hf_tokenizer.apply_chat_template(msgs, chat_template=template, tools=TOOLS,
                                                tokenize=False, add_generation_prompt=prompt,
                                                **kwargs)  # fmt: skip

    prompt = render(messages[:1], True, **prompt_kwargs)
    whole = render(messages, False)
    assert whole.startswith(prompt), (prompt, whole)
    return prompt, whole[len(prompt) :]


def streamed(parser, text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, (name, arguments) of each call) of text fed a character at a time."""
    stream = ToolCallStream(parser)
    content, calls = "", {}
    for ch in [*text, None]:
        piece, deltas = stream.feed(ch) if ch is not None else stream.finish()
        content += piece
        for d in deltas:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.name or ""), args + d.arguments)
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_arguments_of_every_type_come_back_by_their_schema(hf_tokenizer, name):
    template, parser_name = TEMPLATES[name]
    # NOTE: GLM-4.7's prompt opens the thinking; an earlier turn's rendering closes it at once
    kwargs = {"enable_thinking": False} if name == "GLM-4.7-Flash" else {}
    _, output = turn(hf_tokenizer, template, **kwargs)
    if parser_name == "glm45":
        _, output = ReasoningSplitter.split(REASONING_PARSERS["qwen3"], output, False)
    print(f"{name}: {output!r}")
    parser = tool_parser(parser_name).for_tools(FUNCTIONS)
    found = parser.extract(output)
    assert found.content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [("edit_file", ARGUMENTS)]
    content, calls = streamed(parser, output)
    assert content.strip() == "On it."
    assert calls == [(c.name, c.arguments) for c in found.calls]


def test_a_value_is_json_unless_the_schema_says_string():
    glm = tool_parser("glm45")
    text = "<tool_call>f\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n" \
           "<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n</tool_call>"  # fmt: skip
    declared = [FunctionSpec("f", {"type": "object", "properties": {"zip": {"type": "string"}}})]
    assert json.loads(glm.for_tools(declared).extract(text).calls[0].arguments) == {
        "zip": "75001", "n": 7}  # fmt: skip
    assert json.loads(glm.extract(text).calls[0].arguments) == {"zip": 75001, "n": 7}
    assert glm.extract("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>x").calls == ()
    coder = tool_parser("qwen3_coder")
    text = "<tool_call>\n<function=f>\n<parameter=on>\nFalse\n</parameter>\n" \
           "<parameter=s>\nplain words\n</parameter>\n</function>\n</tool_call>"  # fmt: skip
    assert json.loads(coder.extract(text).calls[0].arguments) == {"on": False, "s": "plain words"}
    assert coder.extract("<tool_call>\n<function=f>\n<parameter=on>\nTr").calls == ()


@pytest.mark.parametrize("name", ["GLM-4.6", "GLM-4.7-Flash"])
def test_glm_thinking_is_split_before_its_calls(hf_tokenizer, name):
    template, _ = TEMPLATES[name]
    prompt, output = turn(hf_tokenizer, template, reasoning="The file needs one edit.")
    opened = prompt.rstrip().endswith("<think>")  # GLM-4.7's prompt opens the thinking
    assert opened == (name == "GLM-4.7-Flash")
    print(f"{name}: prompt ends {prompt[-20:]!r}, output {output!r}")
    fmt = REASONING_PARSERS[choose_reasoning_parser(template, "glm4_moe")]
    parser = tool_parser(choose_tool_parser(template, "glm4_moe")).for_tools(FUNCTIONS)
    splitter, reasoning, answer = ReasoningSplitter(fmt, opened), "", ""
    for ch in output:
        r, c = splitter.feed(ch)
        reasoning, answer = reasoning + r, answer + c
    r, c = splitter.finish()
    reasoning, answer = reasoning + r, answer + c
    assert reasoning == "The file needs one edit."
    content, calls = streamed(parser, answer)
    assert content.strip() == "On it."
    assert [(n, json.loads(a)) for n, a in calls] == [("edit_file", ARGUMENTS)]


def test_parsers_chosen_from_the_real_templates():
    assert choose_tool_parser(GLM_46, "glm4_moe") == "glm45"
    assert choose_tool_parser(GLM_47, "glm4_moe") == "glm45"
    assert choose_tool_parser(QWEN3_CODER, "qwen3_moe") == "qwen3_coder"
    assert choose_tool_parser("{{ messages }}", "glm4_moe") == "glm45"
    assert choose_reasoning_parser(GLM_46, "glm4_moe") == "qwen3"
    assert choose_reasoning_parser(QWEN3_CODER, "qwen3_moe") is None
