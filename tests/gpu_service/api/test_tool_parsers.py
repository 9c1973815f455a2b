"""Tool-call parsers against the chat templates of their model families (tests/support/
chat_templates.py): a conversation's assistant tool calls, rendered by the family's template,
parse back into the same calls, whole and streamed in random pieces; the grammar of
tool_choice required/named, sampled with random logits, always yields calls that parse and
validate against the functions' schemas (jsonschema)."""

from __future__ import annotations

import inspect
import json
import random

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from gpu_service.api.reasoning import REASONING_PARSERS as REASONING
from gpu_service.api.reasoning import ReasoningSplitter, choose_reasoning_parser
from gpu_service.api.tokenizer import ServedTokenizer
from gpu_service.api.tool_parsers import (
    PARSERS,
    FunctionSpec,
    ToolCallStream,
    ToolParser,
    choose_tool_parser,
    tool_parser,
)
from gpu_service.config import DEMO_MODEL_DIR
from gpu_service.engine.grammar import GrammarCompiler, TokenMasker
from gpu_service.serve_config import REASONING_PARSERS, TOOL_CALL_PARSERS
from tests.support import chat_templates
from tests.support.chat_templates import FAMILIES, parser_name

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                   "b": {"type": "number", "minimum": 0, "maximum": 10}},
    "required": ["a", "b"],
}  # fmt: skip
FUNCTIONS = [FunctionSpec("get_weather", WEATHER), FunctionSpec("add", ADD)]
TOOLS = [{"type": "function", "function": {"name": f.name, "parameters": f.parameters}}
         for f in FUNCTIONS]  # fmt: skip
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 2, "b": 0.5})]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, vocab_size=len(hf_tokenizer), eos_token_ids=[0, 2])


def history(ids: list[str], content: str | None = None, as_text: bool = False) -> list[dict]:
    calls = [
        {"id": i, "type": "function",
         "function": {"name": n, "arguments": json.dumps(a) if as_text else a}}
        for i, (n, a) in zip(ids, CALLS)
    ]  # fmt: skip
    return [
        {"role": "user", "content": "Weather in Paris, and 2 + 0.5?"},
        {
            "role": "assistant",
            "content": content or "",
            "tool_calls": calls,
        },  # as the API passes it
    ]


def rendered_output(hf_tokenizer, family: str, content: str | None = None) -> str:
    """What the model wrote in its turn: the conversation's text after the generation prompt."""
    template, bos, eos = FAMILIES[family]
    ids = ["abcDEF123", "XYZ789uvw"]  # Mistral's templates need 9 letters and digits

    def render(messages, prompt, **kwargs):
        as_text = family == "deepseek_v3"  # its template concatenates the arguments' JSON
        for m in messages:
            for c in m.get("tool_calls") or ():
                if as_text:
                    c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        return hf_tokenizer.apply_chat_template(
            messages, chat_template=template, tools=TOOLS, tokenize=False,
            add_generation_prompt=prompt, bos_token=bos, eos_token=eos, **kwargs,
        )  # fmt: skip

    conversation = history(ids, content)
    # NOTE: GLM-4.7's prompt opens the thinking, which an earlier turn's rendering closes at once
    opened = {"enable_thinking": False} if family == "glm47" else {}
    prompt = render(conversation[:1], True, **opened)
    whole = render(conversation, False)
    if family == "mistral":  # its template has no generation prompt
        prompt = render(conversation[:1], False)
    assert whole.startswith(prompt), (prompt, whole)
    output = whole[len(prompt) :]
    if family in ("hermes", "glm45"):  # Qwen3's, GLM-4.6's: an (empty) thinking first
        reasoning, output = ReasoningSplitter.split(REASONING["qwen3"], output, False)
        assert reasoning == ""
    return output


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("content", [None, "Let me look that up."])
def test_template_rendered_calls_parse_back(hf_tokenizer, family, content):
    output = rendered_output(hf_tokenizer, family, content)
    print(f"{family}: {output!r}")
    parser = tool_parser(parser_name(family))
    found = parser.extract(output)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == CALLS
    assert found.content == (content if family != "mistral" else None)
    assert len({c.id for c in found.calls}) == 2
    if family == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in found.calls)


def joined(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call, its deltas joined as OpenAI clients join them."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ["", "", ""])
        call[0] += d.id or ""
        call[1] += d.name or ""
        call[2] += d.arguments
    return [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_in_random_pieces_gives_the_same_calls(hf_tokenizer, family, seed):
    """Deltas joined give the calls (arguments as written); formats that stream arguments send
    the name first and the arguments in pieces, never a piece of a closing tag."""
    output = rendered_output(hf_tokenizer, family, "Sure.")
    parser = tool_parser(parser_name(family))
    whole = parser.extract(output).calls
    rng = random.Random(seed)
    for _ in range(5):
        stream = ToolCallStream(parser)
        content, deltas, at = "", [], 0
        while at < len(output):
            n = rng.randint(1, 6)
            text, new = stream.feed(output[at : at + n])
            content, deltas, at = content + text, deltas + new, at + n
        text, new = stream.finish()
        content, deltas = content + text, deltas + new
        calls = joined(deltas)
        assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in whole]
        assert [(n, json.loads(a)) for _, n, a in calls] == CALLS
        assert [i for i, _, _ in calls] == [c.id for c in stream.calls]
        assert len(deltas) > len(calls)  # the arguments came in more than one piece
        if family != "mistral":
            assert content.strip() == "Sure."
        for d in deltas:
            assert not any(m in d.arguments for m in parser.markers), d


def test_text_without_calls_is_content_and_a_broken_call_too():
    parser = tool_parser("hermes")
    assert parser.extract("Just words.").calls == ()
    broken = "I will call <tool_call>\n{not json}\n</tool_call>"
    assert parser.extract(broken).content == broken
    stream = ToolCallStream(parser)
    assert stream.feed("a <tool") == ("a ", [])  # the marker's beginning waits
    assert stream.feed("tip> b") == ("<tooltip> b", [])
    stream = ToolCallStream(parser)
    assert stream.feed(broken) == ("I will call ", [])
    assert stream.finish() == ("<tool_call>\n{not json}\n</tool_call>", [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_open_call_arguments_are_prefixes_of_the_complete_ones(hf_tokenizer, family):
    output = rendered_output(hf_tokenizer, family)
    parser = tool_parser(parser_name(family))
    final = {name: args for name, args in parser.calls(output[output.find(parser.start) :], True)}
    seen = set()
    for end in range(len(output)):
        section = output[: end + 1]
        at = section.find(parser.start)
        opened = parser.open_call(section[at:]) if at >= 0 else None
        if opened is not None:
            name, args = opened
            assert final[name].startswith(args), (section, args)
            seen.add(name)
    assert seen == set(final)


def test_unclosed_last_call_counts_at_the_end():
    parser = tool_parser("hermes")
    found = parser.extract('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert [(c.name, c.arguments) for c in found.calls] == [("add", '{"a": 1, "b": 2}')]


def test_deepseek_v31_and_mistral_v11_forms():
    v31 = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    found = tool_parser("deepseek_v3").extract(v31)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [("add", {"a": 1, "b": 2})]
    v11 = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}'
    found = tool_parser("mistral").extract(v11)
    assert [c.name for c in found.calls] == ["add", "get_weather"]


@pytest.mark.parametrize(
    "template, model_type, expected",
    [
        (chat_templates.QWEN3, "qwen3_moe", "hermes"),
        (chat_templates.DEEPSEEK_V3, "deepseek_v3", "deepseek_v3"),
        (chat_templates.MISTRAL_V3, "mixtral", "mistral"),
        ("{{ messages }}", "mixtral", "mistral"),
        ("{{ messages }}", "llama", None),
    ],
)
def test_parser_chosen_from_the_checkpoint(template, model_type, expected):
    assert choose_tool_parser(template, model_type) == expected


def test_reasoning_parser_chosen_from_the_checkpoint():
    assert choose_reasoning_parser(chat_templates.QWEN3, "qwen3_moe") == "qwen3"
    assert choose_reasoning_parser(chat_templates.DEEPSEEK_R1, "deepseek_v3") == "deepseek_r1"
    assert choose_reasoning_parser(chat_templates.DEEPSEEK_V3, "deepseek_v3") is None
    assert choose_reasoning_parser(chat_templates.MISTRAL_V3, "mixtral") is None


def test_flag_choices_are_the_parsers():
    assert set(TOOL_CALL_PARSERS) == set(PARSERS) and set(REASONING_PARSERS) == set(REASONING)


def sample_constrained(compiler, grammar, vocab: int, seed: int, max_tokens: int = 3000):
    """Random logits, masked by the grammar: the weakest model there is."""
    matcher = grammar.matcher()
    gen = torch.Generator().manual_seed(seed)
    masker, out = TokenMasker(), []
    for _ in range(max_tokens):
        logits = torch.randn(1, vocab, generator=gen)
        masker(logits, [matcher])
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        out.append(token)
        assert matcher.accept(token)
        if matcher.done:
            return out
    raise AssertionError("the grammar did not end within max_tokens")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("named", [False, True])
def test_required_grammar_yields_valid_calls_from_random_logits(
    hf_tokenizer, compiler, family, named, seed
):
    parser = tool_parser(parser_name(family))
    functions = FUNCTIONS[1:] if named else FUNCTIONS
    grammar = compiler.compile_lark(parser.grammar(functions, parallel=not named))
    schemas = {f.name: f.parameters for f in FUNCTIONS}
    for i in range(4):
        ids = sample_constrained(compiler, grammar, len(hf_tokenizer), seed + i)
        text = hf_tokenizer.decode(ids, skip_special_tokens=True)
        calls = parser.extract(text).calls
        assert calls, text
        if named:
            assert [c.name for c in calls] == ["add"]
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_grammars_are_compiled_once(compiler):
    text = tool_parser("hermes").grammar(FUNCTIONS, parallel=True)
    before = compiler.num_compiled
    assert compiler.compile_lark(text) is compiler.compile_lark(text)
    assert compiler.num_compiled <= before + 1


def test_deepseek_template_gets_arguments_as_text(hf_tokenizer):
    """Hugging Face templates take arguments as objects; DeepSeek's concatenates the JSON text:
    render_chat tries the first, then the second."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    tokenizer.chat_template = chat_templates.DEEPSEEK_V3
    served = ServedTokenizer(tokenizer, [0])
    messages = history(["c1", "c2"])
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})

    def conversation(as_text: bool) -> list[dict]:
        return json.loads(json.dumps(history(["c1", "c2"], as_text=as_text)))[:2] + messages[2:]

    _, text = served.render_chat(conversation, TOOLS)
    assert '```json\n{"city": "Paris", "days": 3}\n```' in text
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in text


def test_chat_flags_map_onto_chat_config():
    from gpu_service.cli import serve_config
    from gpu_service.serve_config import ChatConfig
    from ktserve.cli import build_parser

    args = ["serve", str(DEMO_MODEL_DIR), "--tool-call-parser", "mistral"]
    args += ["--reasoning-parser", "none", "--grammar-cache-size", "3"]
    config = serve_config(build_parser().parse_args(args))
    assert config.chat == ChatConfig(tool_call_parser="mistral", reasoning_parser="none",
                                     grammar_cache_size=3)  # fmt: skip
    assert serve_config(build_parser().parse_args(["serve"])).chat == ChatConfig()
    with pytest.raises(ValueError, match="grammar-cache-size"):
        ChatConfig(grammar_cache_size=0)


def test_special_markers_are_decoded_as_text():
    """Mistral's [TOOL_CALLS] is a special token in its tokenizers: decoding keeps it (the
    parser reads it) while other special tokens stay hidden."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    served = ServedTokenizer(tokenizer, [0])
    ids = tokenizer("[TOOL_CALLS] [1]<|endoftext|>", add_special_tokens=False).input_ids
    assert served.decode(ids) == " [1]"
    served.keep_tokens(tool_parser("mistral").markers)
    assert served.decode(ids) == "[TOOL_CALLS] [1]"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_auto_grammar_allows_text_or_valid_calls(hf_tokenizer, compiler, family, seed):
    """tool_choice auto with strict tools: any text without the marker; after the marker only
    calls that match (sampled from random logits here)."""
    parser = tool_parser(parser_name(family))
    grammar = compiler.compile_lark(parser.grammar(FUNCTIONS, parallel=True, free_text=True))

    def consumes(text: str) -> tuple[bool, bool]:
        matcher = grammar.matcher()
        ids = hf_tokenizer(text, add_special_tokens=False).input_ids
        return all(matcher.accept(i) for i in ids), matcher.llm.is_accepting()

    marker = parser.start
    assert consumes("Plain answer: 1 < 2 and [x] too.") == (True, True)
    assert consumes("")[1]
    assert consumes(f"Calling {marker[:-1]}") == (True, True)  # a marker's beginning is text
    assert not consumes(f"ok {marker} nonsense")[0]
    schemas = {f.name: f.parameters for f in FUNCTIONS}
    for i in range(3):
        prefix = hf_tokenizer(f"Let me check. {marker}", add_special_tokens=False).input_ids
        matcher = grammar.matcher()
        assert all(matcher.accept(t) for t in prefix)
        gen, masker, ids = torch.Generator().manual_seed(seed + i), TokenMasker(), list(prefix)
        while not matcher.done:
            logits = torch.randn(1, len(hf_tokenizer), generator=gen)
            masker(logits, [matcher])
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            assert matcher.accept(token)
            ids.append(token)
            assert len(ids) < 3000
        found = parser.extract(hf_tokenizer.decode(ids, skip_special_tokens=True))
        assert found.content == "Let me check." and found.calls
        for call in found.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_parser_must_read_and_constrain_its_format():
    """ToolParser is abstract: every registered parser implements calls and after_start, and
    one that forgets either cannot be made (a TypeError naming it, not a call that fails
    mid-request)."""
    for parser in PARSERS.values():
        assert not inspect.isabstract(parser), parser.name
        parser()

    class Unfinished(ToolParser):
        name, start, markers = "unfinished", "<call>", ("<call>",)

        def calls(self, section: str, final: bool) -> list[tuple[str, str]]:
            return []

    with pytest.raises(TypeError, match="after_start"):
        Unfinished()
