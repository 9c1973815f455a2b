"""The output of a /v1/messages request: engine events -> content blocks and Anthropic's stream.

One builder serves both ways (a whole answer is its events drained), so a stream adds up to the
message a non-streamed request returns. Its events:

    message_start (the message, content [], usage so far), ping          head()
    per block, in the order the model writes them (thinking, text, tool_use):
      content_block_start, content_block_delta* (thinking_delta | text_delta |
      input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop
    a failure midway: an error event ({"type": "error", "error": {...}}), and the stream ends

stop_reason: tool_use (the output called tools), max_tokens, stop_sequence (stop_sequence says
which), else end_turn. usage: input_tokens are the prompt's tokens not found in the prefix cache,
cache_read_input_tokens those found (Anthropic's split; their sum is the prompt).
"""

from __future__ import annotations

import copy
import json
import secrets

from gpu_service.api.chat_output import Delta, OutputReader
from gpu_service.api.errors import ApiError
from gpu_service.api.tool_parsers.stream import CallDelta
from gpu_service.engine.request import TokenEvent


class MessageBuilder:
    def __init__(self, model: str, reader: OutputReader) -> None:
        self.id = f"msg_{secrets.token_hex(12)}"
        self.model = model
        self.reader = reader
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the block being written (the last of blocks)
        self.calls: dict[int, dict] = {}  # call index -> its tool_use block
        self.arguments: dict[int, str] = {}  # call index -> its input as JSON text so far
        self.held = ""  # whitespace before a text block's first visible character
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.num_prompt = self.num_cached = self.num_output = 0

    def usage(self) -> dict:
        return {
            "input_tokens": self.num_prompt - self.num_cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.num_cached,
            "output_tokens": self.num_output,
        }

    def message(self) -> dict:
        blocks = copy.deepcopy(self.blocks)
        position = {id(b): i for i, b in enumerate(self.blocks)}
        for index, block in self.calls.items():  # NOTE: the input whole, as an object
            blocks[position[id(block)]]["input"] = _object(self.arguments[index])
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(),
        }

    def head(self, first: TokenEvent) -> list[dict]:
        self.num_prompt, self.num_cached = first.num_prompt_tokens, first.num_cached_tokens
        start = self.message()
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def event(self, event: TokenEvent) -> list[dict]:
        self.num_prompt, self.num_cached = event.num_prompt_tokens, event.num_cached_tokens
        self.num_output += len(event.tokens)
        return self._parts(self.reader.feed(event.text) if event.text else Delta())

    def finish(self, event: TokenEvent) -> list[dict]:
        self.num_prompt, self.num_cached = event.num_prompt_tokens, event.num_cached_tokens
        out = self.event(event) if event.tokens or event.text else []
        out += self._parts(self.reader.finish())
        out += self._close()
        reason = event.finish_reason.value if event.finish_reason is not None else "stop"
        if self.calls:
            self.stop_reason = "tool_use"
        elif reason == "length":
            self.stop_reason = "max_tokens"
        elif event.stop_string is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", event.stop_string
        else:
            self.stop_reason = "end_turn"
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [*out, {"type": "message_delta", "delta": delta, "usage": self.usage()},
                {"type": "message_stop"}]  # fmt: skip

    def failed(self, error: ApiError) -> list[dict]:
        return [error.anthropic_body()]

    def _parts(self, parts: Delta) -> list[dict]:
        out: list[dict] = []
        if parts.reasoning:
            out += self._text("thinking", parts.reasoning)
        if parts.content:
            text = self.held + parts.content
            if self._kind() != "text" and not text.strip():
                self.held = text
            else:
                self.held = ""
                out += self._text("text", text)
        for call in parts.calls:
            out += self._call(call)
        return out

    def _kind(self) -> str | None:
        return self.open["type"] if self.open is not None else None

    def _start(self, block: dict) -> list[dict]:
        out = self._close()
        self.blocks.append(block)
        self.open = block
        index = len(self.blocks) - 1
        return [*out, {"type": "content_block_start", "index": index,
                       "content_block": copy.deepcopy(block)}]  # fmt: skip

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _text(self, kind: str, text: str) -> list[dict]:
        out: list[dict] = []
        if self._kind() != kind:
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})  # fmt: skip
            out += self._start(block)
        self.open[kind] += text
        delta_kind = "thinking_delta" if kind == "thinking" else "text_delta"
        return [*out, self._delta({"type": delta_kind, kind: text})]

    def _call(self, call: CallDelta) -> list[dict]:
        out: list[dict] = []
        if call.id is not None:
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            out += self._start(block)
            self.calls[call.index] = block
            self.arguments[call.index] = ""
        if call.arguments:
            self.arguments[call.index] += call.arguments
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return out

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _object(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
