"""What a chat request asks of its output, and the output read back into a message.

    plan_output(ctx, req)       a ChatRequest's (chat_request.py) tools / tool_choice /
                                parallel_tool_calls / response_format checked against each
                                other (400s) -> OutputPlan: the grammar
                                to compile (if any), the tool parser, the reasoning format
    OutputReader(plan)          text as it streams -> reasoning / content / tool-call deltas;
                                finish() -> the rest, and finish_reason "tool_calls" when the
                                output called tools; `calls`: the complete calls (a whole
                                answer is read the same way, in one piece)

A constrained output (tool_choice required or named, response_format json) of a model that
thinks may think first: its grammar lets a thinking (free text up to </think>) come before the
constrained part, as reasoning.thinking_grammar writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gpu_service.api.context import ApiContext
from gpu_service.api.errors import invalid
from gpu_service.api.reasoning import (
    REASONING_PARSERS,
    ReasoningFormat,
    ReasoningSplitter,
    thinking_grammar,
)
from gpu_service.api.tool_parsers import FunctionSpec, ToolCall, ToolCallStream, ToolParser
from gpu_service.api.tool_parsers.base import closed, lark_json, lark_string
from gpu_service.api.tool_parsers.stream import CallDelta
from gpu_service.api.tool_schemas import NamedToolChoice, ResponseFormat, Tool

JSON_OBJECT = {"type": "object"}


class OutputRequest(Protocol):
    """What plan_output reads of a request (chat_request.ChatRequest has it)."""

    tools: list[Tool]
    tool_choice: Any
    parallel_tool_calls: bool | None
    response_format: ResponseFormat | None
    format_param: str


@dataclass(frozen=True)
class GrammarSpec:
    lark: str  # a Lark grammar in llguidance's dialect
    param: str  # the request field it comes from (named by compile errors)


@dataclass(frozen=True)
class OutputPlan:
    tool_parser: ToolParser | None  # None: calls are not read (no tools, or tool_choice none)
    max_calls: int | None
    reasoning: ReasoningFormat | None
    grammar: GrammarSpec | None


def plan_output(ctx: ApiContext, body: OutputRequest, prompt_opened: bool) -> OutputPlan:
    """prompt_opened: the rendered prompt ends inside an open <think>."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise invalid("tool_choice needs tools", param="tool_choice")
    if body.parallel_tool_calls is not None and not tools:
        raise invalid("parallel_tool_calls needs tools", param="parallel_tool_calls")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools: two tools have the same name", param="tools")
    parallel = body.parallel_tool_calls is not False
    parser = None
    if choice != "none":
        if ctx.tool_parser is None:
            raise invalid(
                "this model has no tool-call format: start the server with --tool-call-parser",
                param="tools",
            )
        functions = [FunctionSpec(t.function.name, t.function.parameters or {}) for t in tools]
        parser = ctx.tool_parser.for_tools(functions)  # NOTE: arguments typed by their schemas
    grammar = None
    if choice == "required" or isinstance(choice, NamedToolChoice):
        functions = [FunctionSpec(t.function.name, t.function.parameters or {}) for t in tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f.name == choice.function.name]
            if not functions:
                raise invalid(
                    f"tool_choice names the function {choice.function.name!r}, which is not "
                    "among tools",
                    param="tool_choice",
                )
            parallel = False
        grammar = GrammarSpec(parser.grammar(functions, parallel), "tools")
    strict = choice == "auto" and any(t.function.strict for t in tools)
    if strict:
        # strict tools: the model may answer in text, but a call it makes matches its schema
        functions = [FunctionSpec(t.function.name, t.function.parameters or {}) for t in tools]
        grammar = GrammarSpec(parser.grammar(functions, parallel, free_text=True), "tools")
    fmt, fmt_param = body.response_format, body.format_param
    if fmt is not None and fmt.type != "text":
        if grammar is not None and not strict:
            raise invalid(
                f"{fmt_param} cannot be combined with tool_choice required or a named "
                "function (both constrain the whole output)",
                param=fmt_param,
            )
        if fmt.type == "json_object":
            grammar = GrammarSpec(f"start: {lark_json(JSON_OBJECT)}\n", fmt_param)
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise invalid(
                    f"{fmt_param} json_schema needs json_schema.schema",
                    param=f"{fmt_param}.json_schema",
                )
            # NOTE: closed objects (base.closed): what matches them matches the schema too
            schema = closed(fmt.json_schema.schema_)
            grammar = GrammarSpec(f"start: {lark_json(schema)}\n", fmt_param)
        if strict:  # the answer in the format, or calls of the strict tools
            answer = grammar.lark.removeprefix("start: ")
            section = f"{lark_string(parser.start)} after_start"
            rules = parser.after_start(functions, parallel)
            grammar = GrammarSpec(f"start: answer | {section}\nanswer: {answer}{rules}", "tools")
    if grammar is not None and ctx.grammars is None:
        raise invalid("constrained decoding is not available on this server", param="tool_choice")
    reasoning = None
    if ctx.reasoning_parser is not None:
        reasoning = REASONING_PARSERS[ctx.reasoning_parser]
        if grammar is not None:
            thinks = reasoning.always_thinks or prompt_opened
            grammar = GrammarSpec(thinking_grammar(grammar.lark, thinks), grammar.param)
    return OutputPlan(parser, None if parallel else 1, reasoning, grammar)


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class OutputReader:
    def __init__(self, plan: OutputPlan, prompt_opened: bool) -> None:
        self.plan = plan
        self.splitter = ReasoningSplitter(plan.reasoning, prompt_opened) if plan.reasoning else None
        self.tools = ToolCallStream(plan.tool_parser, plan.max_calls) if plan.tool_parser else None

    def feed(self, text: str) -> Delta:
        if self.splitter is not None:
            reasoning, content = self.splitter.feed(text)
        else:
            reasoning, content = "", text
        return self._content(Delta(reasoning=reasoning), content, final=False)

    def finish(self) -> Delta:
        reasoning, content = self.splitter.finish() if self.splitter is not None else ("", "")
        return self._content(Delta(reasoning=reasoning), content, final=True)

    def _content(self, delta: Delta, content: str, final: bool) -> Delta:
        if self.tools is None:
            delta.content = content
            return delta
        delta.content, delta.calls = self.tools.feed(content)
        if final:
            rest, calls = self.tools.finish()
            delta.content += rest
            delta.calls += calls
        return delta

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls read so far."""
        return self.tools.calls if self.tools is not None else []

    def finish_reason(self, reason: str) -> str:
        called = self.tools is not None and self.tools.num_started
        return "tool_calls" if called and reason == "stop" else reason
