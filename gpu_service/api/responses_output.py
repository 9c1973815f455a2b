"""The output of a /v1/responses request: engine events -> output items and streaming events.

One builder serves both ways (a whole answer is its events drained), so a streamed response
ends as the same Response object a non-streamed one returns. Its events, each with its
sequence_number, in OpenAI's order:

    response.created, response.in_progress                       head()
    per output item, in the order the model writes them:
      response.output_item.added                                 reasoning | message | call
      reasoning: response.content_part.added (reasoning_text), response.reasoning_text.delta*,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added (output_text), response.output_text.delta*,
                 response.output_text.done, response.content_part.done
      call:      response.function_call_arguments.delta*, response.function_call_arguments.done
      response.output_item.done
    response.completed (status completed), or response.incomplete (max_output_tokens), or
    response.failed (status failed, response.error) when the request fails midway

Whitespace the model writes before a message's first visible character is held back (and
dropped if nothing follows), as chat completions drop it beside tool calls.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Callable

from gpu_service.api.chat_output import Delta, OutputReader
from gpu_service.api.errors import ApiError
from gpu_service.api.logprobs import chat_logprobs
from gpu_service.api.tokenizer import ServedTokenizer
from gpu_service.api.tool_parsers.stream import CallDelta
from gpu_service.engine.request import TokenEvent


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseBuilder:
    """echo: the request's fields a Response repeats (instructions, tools, text, ...)."""

    def __init__(self, response_id: str, model: str, echo: dict, reader: OutputReader,
                 tokenizer: ServedTokenizer | None = None,
                 namespaces: dict[str, str] | None = None) -> None:  # fmt: skip
        """tokenizer: given, output_text carries logprobs. namespaces: the namespace of each
        tool that is in one, by name (its calls say it)."""
        self.namespaces = namespaces or {}
        self.id = response_id
        self.model = model
        self.echo = echo
        self.reader = reader
        self.tokenizer = tokenizer
        self.created_at = int(time.time())
        self.status = "in_progress"
        self.error: dict | None = None
        self.incomplete: dict | None = None
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written (the last of items)
        self.calls: dict[int, dict] = {}  # call index -> its item
        self.held = ""  # whitespace before a message's first visible character
        self.seq = 0
        self.on_done: Callable[[dict], None] | None = None  # the finished Response, to keep
        self.num_prompt = self.num_cached = self.num_output = self.num_reasoning = 0

    def response(self) -> dict:
        usage = None
        if self.status != "in_progress":
            usage = {
                "input_tokens": self.num_prompt,
                "input_tokens_details": {"cached_tokens": self.num_cached},
                "output_tokens": self.num_output,
                "output_tokens_details": {"reasoning_tokens": self.num_reasoning},
                "total_tokens": self.num_prompt + self.num_output,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "model": self.model,
            "output": copy.deepcopy(self.items),
            "usage": usage,
            **self.echo,
        }

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def head(self, first: TokenEvent | None = None) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]  # fmt: skip

    def event(self, event: TokenEvent) -> list[dict]:
        self.num_prompt, self.num_cached = event.num_prompt_tokens, event.num_cached_tokens
        self.num_output += len(event.tokens)
        parts = self.reader.feed(event.text) if event.text else Delta()
        if parts.reasoning and not parts.content and not parts.calls:
            self.num_reasoning += len(event.tokens)
        logprobs = None
        if self.tokenizer is not None and event.tokens:
            logprobs = chat_logprobs(self.tokenizer, event.tokens)["content"]
        return self._parts(parts, logprobs)

    def finish(self, event: TokenEvent) -> list[dict]:
        self.num_prompt, self.num_cached = event.num_prompt_tokens, event.num_cached_tokens
        out = self.event(event) if event.tokens or event.text else []
        out += self._parts(self.reader.finish(), None)
        out += self._close()
        kind = "response.completed"
        self.status = "completed"
        if event.finish_reason is not None and event.finish_reason.value == "length":
            kind, self.status = "response.incomplete", "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        response = self.response()
        if self.on_done is not None:
            self.on_done(response)
        return [*out, self._event(kind, response=response)]

    def failed(self, error: ApiError) -> list[dict]:
        out = self._close()
        self.status = "failed"
        self.error = {"code": error.code or "server_error", "message": error.message}
        return [*out, self._event("response.failed", response=self.response())]

    def _parts(self, parts: Delta, logprobs: list | None) -> list[dict]:
        out: list[dict] = []
        if parts.reasoning:
            out += self._text("reasoning", parts.reasoning, None)
        if parts.content:
            text = self.held + parts.content
            if self._kind() != "message" and not text.strip():
                self.held = text
            else:
                self.held = ""
                out += self._text("message", text, logprobs)
        for call in parts.calls:
            out += self._call(call)
        return out

    def _kind(self) -> str | None:
        return self.open["type"] if self.open is not None else None

    def _added(self, item: dict) -> list[dict]:
        out = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        return [*out, self._event("response.output_item.added", output_index=index,
                                  item=copy.deepcopy(item))]  # fmt: skip

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _text(self, kind: str, text: str, logprobs: list | None) -> list[dict]:
        out: list[dict] = []
        if self._kind() != kind:
            if kind == "reasoning":
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "encrypted_content": None, "status": "in_progress"}  # fmt: skip
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}  # fmt: skip
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._added(item)
            item["content"].append(part)
            out.append(self._event("response.content_part.added", **self._where(),
                                   content_index=0, part=copy.deepcopy(part)))  # fmt: skip
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **self._where(),
                                   content_index=0, delta=text))  # fmt: skip
        else:
            logprobs = logprobs or []
            part["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", **self._where(),
                                   content_index=0, delta=text, logprobs=logprobs))  # fmt: skip
        return out

    def _call(self, call: CallDelta) -> list[dict]:
        out: list[dict] = []
        if call.id is not None:
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.id, "name": call.name, "arguments": ""}  # fmt: skip
            if call.name in self.namespaces:
                item["namespace"] = self.namespaces[call.name]
            out += self._added(item)
            self.calls[call.index] = item
        item = self.calls[call.index]
        if call.arguments:
            item["arguments"] += call.arguments
            out.append(self._event("response.function_call_arguments.delta", **self._where(),
                                   delta=call.arguments))  # fmt: skip
        return out

    def _close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", **where,
                                   name=item["name"], arguments=item["arguments"]))  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                       text=part["text"]))  # fmt: skip
            else:
                out.append(self._event("response.output_text.done", **where, content_index=0,
                                       text=part["text"], logprobs=part["logprobs"]))  # fmt: skip
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=copy.deepcopy(part)))  # fmt: skip
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=where["output_index"],
                               item=copy.deepcopy(item)))  # fmt: skip
        self.open = None
        return out
