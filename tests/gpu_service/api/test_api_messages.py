"""POST /v1/messages and /v1/messages/count_tokens with the real anthropic SDK (messages.create,
messages.stream, count_tokens) against `ktserve serve` on the demo model, with an API key (the
SDK sends it as x-api-key). Tool calls are made valid by constrained decoding (tool_choice any or
tool), which is what makes a small random model's answers checkable."""

from __future__ import annotations

import json
import shutil
import urllib.request

import jsonschema
import pytest
from transformers import AutoTokenizer

from gpu_service.config import DEMO_MODEL_DIR
from tests.support import chat_templates
from tests.support.api_server import CPU_FLAGS, running_server

anthropic = pytest.importorskip("anthropic")

MODEL = "demo"
KEY = "messages-key"
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
TOOLS = [{"name": "get_weather", "description": "the forecast", "input_schema": WEATHER},
         {"name": "add", "description": "a + b", "input_schema": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def server():
    with running_server(DEMO_MODEL_DIR, *FLAGS, env={"KTSERVE_API_KEY": KEY}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def create(client, **kwargs):
    """messages.create; temperature goes in the body (this SDK no longer takes it)."""
    if "temperature" in kwargs:
        extra = {**kwargs.pop("extra_body", {}), "temperature": kwargs.pop("temperature")}
        kwargs["extra_body"] = extra
    return client.messages.create(**{"model": MODEL, "messages": ASK, "max_tokens": 8, **kwargs})


def stream(client, **kwargs):
    body = {"temperature": kwargs.pop("temperature")} if "temperature" in kwargs else None
    return client.messages.stream(**{"model": MODEL, "messages": ASK, **kwargs}, extra_body=body)


def test_text_message_and_its_usage(client):
    m = create(client, system="Be brief.", temperature=0)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    again = create(client, system="Be brief.", temperature=0)
    assert again.content == m.content  # greedy: the same answer
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    assert again.usage.cache_read_input_tokens > 0  # the prompt's full blocks, cached


def test_stream_adds_up_to_the_message(client):
    whole = create(client, temperature=0, max_tokens=12)
    with stream(client, max_tokens=12, temperature=0) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens >= 1


def test_stop_sequence_ends_the_message_and_says_which(client):
    text = create(client, temperature=0, max_tokens=24).content[0].text
    stop = text[len(text) // 2 :][:2]
    m = create(client, temperature=0, max_tokens=24, stop_sequences=["\u2603", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def check_tool_use(block, names=("get_weather", "add")):
    assert block.type == "tool_use" and block.id and block.name in names
    schema = next(t["input_schema"] for t in TOOLS if t["name"] == block.name)
    jsonschema.validate(block.input, schema)


def test_tool_use_round_trip(client, seed):
    m = create(client, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=200,
               temperature=1.0)  # fmt: skip
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses
    for block in uses:
        check_tool_use(block)
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny"} for b in uses]
    results[0]["is_error"] = True
    said = [b.model_dump() for b in m.content]
    thanks = [*results, {"type": "text", "text": "Thanks."}]
    history = [*ASK, {"role": "assistant", "content": said}, {"role": "user", "content": thanks}]
    answer = create(client, messages=history, tools=TOOLS, tool_choice={"type": "none"})
    assert all(b.type == "text" for b in answer.content)
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted.input_tokens


def test_named_tool_streamed(client):
    named = {"type": "tool", "name": "add", "disable_parallel_tool_use": True}
    with stream(client, max_tokens=200, tools=TOOLS, tool_choice=named) as s:
        events = list(s)
        final = s.get_final_message()
    (block,) = final.content
    check_tool_use(block, names=("add",))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    partial = "".join(d.partial_json for d in deltas if d.type == "input_json_delta")
    assert json.loads(partial) == block.input and final.stop_reason == "tool_use"


def test_errors_are_anthropic_shaped_and_the_key_is_x_api_key(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, max_tokens=0)
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        create(wrong)
    assert denied.value.body["error"]["type"] == "authentication_error"
    refused = (([{"type": "web_search_20250305", "name": "web_search"}], "'web_search_20250305'"),
               ([{"name": "x", "input_schema": {}, "defer": 1}], "tools.0.defer"))  # fmt: skip
    for tools, named in refused:
        body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": tools}
        status, err = server.post("/v1/messages?beta=true", body,
                                  headers={"x-api-key": KEY, "anthropic-beta": "x"})  # fmt: skip
        assert status == 400 and err["type"] == "error" and named in err["error"]["message"]
    accepted = {"context_management": {"edits": []}, "output_config": {"effort": "high"},
                "metadata": {"user_id": "u"}, "service_tier": "auto"}  # fmt: skip
    m = create(client, extra_body=accepted,
               extra_headers={"anthropic-beta": "context-management-2025-06-27"})  # fmt: skip
    assert m.content
    for method in ("GET", "HEAD"):  # no key needed: a client's check that the server answers
        with urllib.request.urlopen(urllib.request.Request(server.url + "/", method=method),
                                    timeout=30) as response:  # fmt: skip
            assert response.status == 200


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """The demo model with Qwen3's template (it writes <think>, takes enable_thinking) and the
    deepseek_r1 reasoning parser: this model never closes a thinking, so all it writes is
    thinking."""
    model_dir = tmp_path_factory.mktemp("thinking") / "demo"
    shutil.copytree(DEMO_MODEL_DIR, model_dir)
    (model_dir / "chat_template.jinja").write_text(chat_templates.QWEN3)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with running_server(model_dir, *FLAGS, "--reasoning-parser", "deepseek_r1") as proc:
        yield proc


def test_thinking_blocks_and_the_thinking_switch(thinking_server):
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0)
    on = {"type": "enabled", "budget_tokens": 1024}
    m = create(client, thinking=on, temperature=0, max_tokens=10)
    assert m.content[0].type == "thinking" and m.content[0].thinking
    assert "</think>" not in m.content[0].thinking
    with stream(client, max_tokens=10, temperature=0, thinking=on) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].thinking == m.content[0].thinking
    # disabled: the template closes the thinking in the prompt (enable_thinking false)
    count = {"model": MODEL, "messages": ASK}
    enabled = client.messages.count_tokens(**count, thinking=on).input_tokens
    disabled = client.messages.count_tokens(**count, thinking={"type": "disabled"}).input_tokens
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    closed = len(tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids)
    assert disabled == enabled + closed
    # a thinking given back renders as the assistant's reasoning (Qwen3 keeps the last one's)
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Paris is sunny.", "signature": ""},
        {"type": "text", "text": "Sunny."}]}, {"role": "user", "content": "And Lima?"}]  # fmt: skip
    assert client.messages.count_tokens(model=MODEL, messages=history).input_tokens > enabled
