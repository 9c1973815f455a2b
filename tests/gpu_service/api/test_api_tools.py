"""Tool calling, structured outputs and reasoning through the HTTP API, with real clients: the
openai SDK (chat.completions.create and .parse) and an agent framework (openai-agents), against
`ktserve serve` on the demo model (its chat template writes tools in the Hermes format) as a
subprocess. The demo model is small: tool_choice required / named and response_format are what
make its output valid (constrained decoding), which is what these tests check."""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from gpu_service.config import DEMO_MODEL_DIR
from tests.support import chat_templates
from tests.support.api_server import CPU_FLAGS, openai_client, running_server

FLAGS = (*CPU_FLAGS, "--max-model-len", "2048", "--kv-cache-tokens", "16384")
MODEL = "demo"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
}  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function",
     "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def serve(model_dir, *flags):
    return running_server(model_dir, *FLAGS, "--served-model-name", MODEL, *flags)


@pytest.fixture(scope="module")
def server():
    with serve(DEMO_MODEL_DIR) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": MODEL, "messages": ASK, **kwargs})


def check_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_valid_calls(client, seed, parallel):
    for i in range(3):
        r = chat(client, tools=TOOLS, tool_choice="required", seed=seed + i, max_tokens=400,
                 parallel_tool_calls=parallel)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_named_tool_choice_calls_that_function(client, seed):
    named = {"type": "function", "function": {"name": "add"}}
    for i in range(3):
        r = chat(client, tools=TOOLS, tool_choice=named, seed=seed + i, max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1
        check_calls(calls, names=("add",))


def test_streamed_tool_calls_are_the_non_streamed_ones(client):
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400)
    whole = chat(client, **kwargs).choices[0]
    calls: dict[int, dict] = {}
    reasons, pieces = [], 0
    for chunk in chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:  # a call's first delta: id, type and name come first
                assert d.id and d.type == "function" and d.function.name
            pieces += bool(d.function.arguments)
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and reasons.count(None) == len(reasons) - 1
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"] for c in calls.values())
    assert pieces > len(calls)  # the arguments streamed in pieces


def test_constrained_and_free_requests_share_batches(client, seed):
    """Grammar masks apply to their own rows only: a plain greedy answer is the same alone and
    decoded in the same steps as constrained requests, which stay valid."""
    plain = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    alone = chat(client, **plain).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    with ThreadPoolExecutor(6) as pool:
        free = [pool.submit(chat, client, **plain) for _ in range(2)]
        tools = [
            pool.submit(
                chat,
                client,
                tools=TOOLS,
                tool_choice="required",
                seed=seed + i,
                max_tokens=200,
                parallel_tool_calls=False,
            )
            for i in range(2)
        ]
        formats = [pool.submit(chat, client, response_format=fmt, seed=seed + i, max_tokens=100)
                   for i in range(2)]  # fmt: skip
        assert [f.result().choices[0].message.content for f in free] == [alone, alone]
        for f in tools:
            check_calls(f.result().choices[0].message.tool_calls)
        for f in formats:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), WEATHER)


def test_auto_tool_choice_lets_the_model_answer(client):
    r = chat(client, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str)


STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]


def test_strict_tools_with_auto_choice(client, seed):
    """Strict tools under tool_choice auto: text, or calls that match (a grammar allows both)."""
    for i in range(3):
        choice = chat(client, tools=STRICT_TOOLS, seed=seed + i, max_tokens=60).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls)
        else:
            assert "<tool_call>" not in choice.message.content


def test_strict_tools_with_a_response_format(client, seed):
    """Both: the answer in the format, or calls of the strict tools."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    for i in range(3):
        r = chat(client, tools=STRICT_TOOLS, response_format=fmt, seed=seed + i, max_tokens=200)
        message = r.choices[0].message
        if message.tool_calls:
            check_calls(message.tool_calls)
        else:
            jsonschema.validate(json.loads(message.content), WEATHER)


def test_tool_history_is_rendered_whole(client):
    """A conversation with an assistant's calls and the tools' results costs exactly the prompt
    tokens the checkpoint's template gives it (with the tools): nothing is dropped."""
    calls = [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "You are helpful."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "3"},
    ]
    r = chat(client, messages=messages, tools=TOOLS, max_tokens=1)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    local = json.loads(json.dumps(messages))
    local[2]["content"] = ""
    for c in local[2]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    text = tokenizer.apply_chat_template(local, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"the add tool"' in text
    assert r.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)


def test_json_schema_response_validates(client, seed):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 24},
            "sunny": {"type": "boolean"},
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["answer", "sunny", "score", "tags"],
    }
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema, "strict": True},
    }
    for i in range(3):
        r = chat(client, response_format=fmt, seed=seed + i, max_tokens=300)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_response_is_json(client, seed):
    fmt = {"type": "json_object"}
    r = chat(client, response_format=fmt, seed=seed, max_tokens=40, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in r)
    assert text.startswith("{")
    # NOTE: a free object need not end within max_tokens on this small model; what it wrote is
    # the beginning of a JSON object (the grammar allows nothing else).


class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    sunny: bool
    days: int = Field(ge=1, le=7)


def test_openai_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Forecast,
                                      max_tokens=100)  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast), r.choices[0].message


def test_openai_parse_with_a_pydantic_tool(client):
    tool = openai.pydantic_function_tool(Forecast, name="forecast")
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool],
                                      tool_choice="required", parallel_tool_calls=False,
                                      max_tokens=200)  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, Forecast) for c in calls)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages.0.role"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_bad_tool_and_format_requests_are_400(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
    status, err = server.post("/v1/chat/completions", body)
    assert status == 400, err
    assert err["error"]["param"] == param, err


def test_openai_agents_calls_two_tools_and_answers(server, seed):
    """openai-agents with two tools: a call with valid arguments, its result back through
    role "tool", then the final answer; the same streamed."""
    agents = pytest.importorskip("agents")
    called: list[tuple[str, dict]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo"], days: Literal[1, 2, 3]) -> str:
        """The forecast of a city."""
        called.append(("get_weather", {"city": city, "days": days}))
        return f"sunny in {city} for {days} days"

    @agents.function_tool
    def add(a: Literal[1, 2, 3], b: Literal[1, 2, 3]) -> int:
        """a + b."""
        called.append(("add", {"a": a, "b": b}))
        return a + b

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    agent = agents.Agent(
        name="helper",
        instructions="Use the tools.",
        tools=[get_weather, add],
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", max_tokens=64, extra_body={"seed": seed}
        ),
    )

    async def run_both():
        result = await agents.Runner.run(agent, "Weather in Paris? And 1 + 2?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "Weather in Tokyo?", max_turns=4)
        kinds = [e.type async for e in streamed.stream_events()]
        await client.close()
        return result, streamed, kinds

    result, streamed, kinds = asyncio.run(run_both())
    for run in (result, streamed):
        items = [type(i).__name__ for i in run.new_items]
        assert "ToolCallItem" in items and "ToolCallOutputItem" in items, items
        assert items[-1] == "MessageOutputItem", items
        assert isinstance(run.final_output, str)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert called and all(name in ("get_weather", "add") for name, _ in called)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """The demo model with Qwen3's template (it writes <think>, takes enable_thinking) and the
    deepseek_r1 reasoning parser: this model never closes a thinking, so all it writes is
    reasoning."""
    model_dir = tmp_path_factory.mktemp("thinking") / "demo"
    shutil.copytree(DEMO_MODEL_DIR, model_dir)
    (model_dir / "chat_template.jinja").write_text(chat_templates.QWEN3)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with serve(model_dir, "--reasoning-parser", "deepseek_r1") as proc:
        yield proc


def test_reasoning_content_in_message_and_stream(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.base_url, api_key="none", max_retries=0)
    kwargs = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    whole = chat(client, **kwargs).choices[0].message
    assert whole.content == ""
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning
    streamed = [c.choices[0].delta for c in chat(client, stream=True, **kwargs) if c.choices]
    deltas = [(d.model_extra or {}).get("reasoning_content") or "" for d in streamed]
    assert "".join(deltas).rstrip() == reasoning
    assert not "".join(d.content or "" for d in streamed)


def test_chat_template_kwargs_reach_the_template(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.base_url, api_key="none", max_retries=0)
    on = chat(client, max_tokens=1).usage.prompt_tokens
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    off = chat(client, max_tokens=1, extra_body=kwargs)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    closed = len(tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids)
    assert off.usage.prompt_tokens == on + closed


def test_thinking_model_may_think_before_a_constrained_answer(thinking_server):
    """With a reasoning parser, a json_schema request compiles a grammar that starts with the
    thinking: this model thinks all along, so what it writes is reasoning (the grammar itself
    is checked in test_reasoning.py)."""
    client = openai.OpenAI(base_url=thinking_server.base_url, api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    choice = chat(client, response_format=fmt, max_tokens=8, temperature=0).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.model_extra["reasoning_content"] and not choice.message.content
