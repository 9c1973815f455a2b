"""POST /v1/responses with real clients: the openai SDK's responses.create (plain, streamed, a
function-tool round trip, previous_response_id, text.format json_schema) and the OpenAI Agents
SDK on its default (Responses) provider, against `ktserve serve` on the demo model. Tool calls
and formats are made valid by constrained decoding (tool_choice required, a json_schema), which
is what makes a small random model's answers checkable."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from gpu_service.config import DEMO_MODEL_DIR
from tests.support.api_server import CPU_FLAGS, openai_client, running_server

MODEL = "demo"
FLAGS = (*CPU_FLAGS, "--max-model-len", "2048", "--kv-cache-tokens", "16384",
         "--served-model-name", MODEL)  # fmt: skip
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the forecast",
          "parameters": WEATHER}]  # fmt: skip
ASK = "What is the weather in Paris for 3 days?"


@pytest.fixture(scope="module")
def server():
    with running_server(DEMO_MODEL_DIR, *FLAGS) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def create(client, **kwargs):
    return client.responses.create(**{"model": MODEL, "input": ASK, **kwargs})


def test_plain_response_counts_the_prompt_as_chat_does(client):
    r = create(client, max_output_tokens=6, extra_body={"ignore_eos": True})
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 6
    chat = client.chat.completions.create(model=MODEL, max_tokens=1,
                                          messages=[{"role": "user", "content": ASK}])  # fmt: skip
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    again = create(client, max_output_tokens=1)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the prompt's full blocks


def test_instructions_and_message_items_render_as_chat_messages(client):
    text = [{"type": "input_text", "text": ASK}]
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": text}]  # fmt: skip
    r = create(client, input=items, max_output_tokens=1)
    s = create(client, instructions="Be brief.", max_output_tokens=1)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=1,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
    )  # fmt: skip
    assert r.usage.input_tokens == s.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_add_up_to_the_response(client, seed):
    kwargs = dict(max_output_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = create(client, **kwargs)
    events = list(create(client, stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[3] == "response.content_part.added" and kinds[-1] == "response.incomplete"
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == 10


def check_call(item, names=("get_weather",)):
    assert item.type == "function_call" and item.name in names and item.call_id
    jsonschema.validate(json.loads(item.arguments), WEATHER)


def test_function_tool_round_trip(client, seed):
    r = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=200, extra_body={"seed": seed})  # fmt: skip
    assert r.status == "completed", r
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    check_call(calls[0])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
    history = [{"role": "user", "content": ASK}, *[o.model_dump() for o in r.output], result]
    answer = create(client, input=history, tools=TOOLS, max_output_tokens=8, tool_choice="none")
    assert answer.output[0].type == "message"
    # the same turn through previous_response_id: the stored conversation is the same prompt
    chained = create(client, previous_response_id=r.id, input=[result], tools=TOOLS,
                     max_output_tokens=8, tool_choice="none")  # fmt: skip
    assert chained.usage.input_tokens == answer.usage.input_tokens > r.usage.input_tokens
    assert client.responses.retrieve(r.id).output[0].call_id == calls[0].call_id


def test_streamed_function_call_events(client, seed):
    events = list(create(client, tools=TOOLS, tool_choice="required", stream=True,
                         parallel_tool_calls=False, max_output_tokens=200,
                         extra_body={"seed": seed}))  # fmt: skip
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and all(e.item.type == "function_call" for e in added)
    for e in added:
        pieces = [d.delta for d in events if d.type == "response.function_call_arguments.delta"
                  and d.item_id == e.item.id]  # fmt: skip
        (done,) = [d for d in events if d.type == "response.function_call_arguments.done"
                   and d.item_id == e.item.id]  # fmt: skip
        assert "".join(pieces) == done.arguments
    final = events[-1].response
    assert events[-1].type == "response.completed"
    for item in final.output:
        check_call(item)


def test_text_format_json_schema(client, seed):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for i in range(2):
        r = create(client, text={"format": fmt}, max_output_tokens=200,
                   extra_body={"seed": seed + i})  # fmt: skip
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), WEATHER)
        assert r.text.format.type == "json_schema"


def test_logprobs_through_include(client):
    r = create(client, max_output_tokens=4, top_logprobs=2, extra_body={"ignore_eos": True},
               include=["message.output_text.logprobs"])  # fmt: skip
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "code_interpreter", "container": "auto"}]}, "tools.0.container"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": [{"type": "message", "role": "user",
                     "content": [{"type": "input_image"}]}]}, "input.0.content"),
        ({"input": [{"type": "message", "role": "user",
                     "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.image_url"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0.type"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.json_schema"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 2**40}, "max_output_tokens"),
        ({"seed": 2**64}, "seed"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(server, extra, param):
    status, err = server.post("/v1/responses", {"model": MODEL, "input": ASK, **extra})
    assert status == 400, err
    assert err["error"]["param"] == param, err


def test_openai_agents_default_provider_calls_two_tools(server, seed):
    """openai-agents on its default provider (the Responses API) with two tools: a call with
    valid arguments, its output back as function_call_output, then the final answer; the same
    streamed. NOTE: the Agents SDK fails a response that ran into max_output_tokens (status
    incomplete), so the final answer must end by itself: EOS made likely (logit_bias, the
    extension) after a first token (min_tokens)."""
    eos = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).eos_token_id
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
    agents.set_default_openai_client(client, use_for_tracing=False)  # NOTE: the default provider
    assert isinstance(agents.OpenAIProvider().get_model(MODEL), agents.OpenAIResponsesModel)
    agent = agents.Agent(
        name="helper",
        instructions="Use the tools.",
        tools=[get_weather, add],
        model=MODEL,
        model_settings=agents.ModelSettings(
            tool_choice="required",
            max_tokens=64,
            extra_body={"seed": seed, "logit_bias": {str(eos): 12}, "min_tokens": 1},
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
