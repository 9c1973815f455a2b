"""Seeded coding-agent sessions for bench/agent_replay.py: what each session sends, turn by turn.

A session opens with a system prompt (the same for every session, as one agent harness sends it)
and a first task, together about `start_tokens` long, with the tool definitions (TOOLS, sent as
`tools`) beside them; every later turn adds the model's reply to the history, then new text: a
tool call and its result (numbered source lines) or a user message. Every turn resends the whole
history, as agents do. Sizes are drawn from the config's ranges and counted in words (about
TOKENS_PER_WORD tokens each); the servers' usage gives the real counts. The replies are the
served model's, so only they differ between targets.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

TOKENS_PER_WORD = 1.3
# NOTE: the system prompt's share of the shortest start; the first task fills the rest.
SYSTEM_SHARE = 0.5

TOOLS = (
    {"type": "function",
     "function": {"name": "read_file", "description": "Read a file of the repository.",
                  "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                 "required": ["path"]}}},
    {"type": "function",
     "function": {"name": "run_shell", "description": "Run a shell command in the repository.",
                  "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                 "required": ["command"]}}},
    {"type": "function",
     "function": {"name": "apply_patch", "description": "Apply a unified diff to the repository.",
                  "parameters": {"type": "object", "properties": {"patch": {"type": "string"}},
                                 "required": ["patch"]}}},
)  # fmt: skip

WORDS = ("path", "file", "read", "write", "search", "query", "result", "error", "line", "code",
         "function", "return", "value", "string", "number", "list", "object", "patch", "test",
         "build", "shell", "command", "output", "status", "diff", "commit", "branch", "config",
         "server", "request", "cache", "token", "session", "module", "import", "class")  # fmt: skip


@dataclass(frozen=True)
class WorkloadConfig:
    """The sizes of every session, as ranges (low, high) drawn uniformly."""

    seed: int = 0
    start_tokens: tuple[int, int] = (2000, 8000)
    turn_tokens: tuple[int, int] = (300, 800)
    gen_tokens: tuple[int, int] = (100, 300)
    turns: int = 6
    think_s: tuple[float, float] = (0.5, 3.0)

    def __post_init__(self) -> None:
        for name in ("start_tokens", "turn_tokens", "gen_tokens", "think_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range 0 <= low <= high, got {low}-{high}")
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON


@dataclass(frozen=True)
class Turn:
    """What a turn adds before its request (nothing for the first) and what it asks for.

    A tool turn answers the previous reply's tool calls (the scripted one where the model made
    none) with `text`; a user turn sends `text` as a user message."""

    kind: str  # "first", "tool" or "user"
    text: str
    tool_call: ToolCall | None
    max_tokens: int
    think_s: float  # the simulated user's (or tool's) time before this turn's request


@dataclass(frozen=True)
class SessionScript:
    system: str
    turns: tuple[Turn, ...]


def words_text(rng: random.Random, num_tokens: int, kind: str) -> str:
    """About num_tokens tokens: prose ("prose") or tool output shaped as numbered source lines
    ("file")."""
    num_words = max(1, round(num_tokens / TOKENS_PER_WORD))
    lines: list[str] = []
    count = 0
    while count < num_words:
        a, b, c, d = rng.sample(WORDS, 4)
        if kind == "file":
            line = f"{len(lines) + 1:4d}: {a}_{b} = {c}({d}, {rng.randrange(1000)})"
        else:
            line = f"Please {a} the {b} {c} and {d} it."
        lines.append(line)
        count += len(line.split())
    return "\n".join(lines)


def system_prompt(config: WorkloadConfig) -> str:
    rng = random.Random(f"{config.seed}/system")
    num_tokens = round(config.start_tokens[0] * SYSTEM_SHARE)
    opening = "You are a coding agent working in a repository.\n"
    return opening + words_text(rng, num_tokens, "prose")


def session_script(config: WorkloadConfig, num_sessions: int, index: int) -> SessionScript:
    """Session `index` of a run of `num_sessions`: runs of different sizes share only the system
    prompt, so one run's histories are never another's cache hits."""
    rng = random.Random(f"{config.seed}/{num_sessions}/{index}")
    system = system_prompt(config)
    first_tokens = rng.randint(*config.start_tokens) - round(config.start_tokens[0] * SYSTEM_SHARE)
    turns = [Turn("first", words_text(rng, first_tokens, "prose"), None,
                  rng.randint(*config.gen_tokens), 0.0)]  # fmt: skip
    for number in range(1, config.turns):
        kind = rng.choice(("tool", "tool", "user"))
        call = None
        if kind == "tool":
            function = rng.choice(TOOLS)["function"]
            (parameter,) = function["parameters"]["required"]
            arguments = {parameter: f"src/{rng.choice(WORDS)}_{rng.randrange(100)}.py"}
            call = ToolCall(f"call_{index}_{number}", function["name"], json.dumps(arguments))
        text = words_text(rng, rng.randint(*config.turn_tokens), "file" if call else "prose")
        think = rng.uniform(*config.think_s)
        turns.append(Turn(kind, text, call, rng.randint(*config.gen_tokens), think))
    return SessionScript(system, tuple(turns))


def workload(config: WorkloadConfig, num_sessions: int) -> list[SessionScript]:
    return [session_script(config, num_sessions, i) for i in range(num_sessions)]


def first_messages(script: SessionScript) -> list[dict]:
    return [{"role": "system", "content": script.system},
            {"role": "user", "content": script.turns[0].text}]  # fmt: skip


def next_messages(turn: Turn, reply: str, reply_calls: list[dict]) -> list[dict]:
    """What follows the history before `turn`'s request: the previous reply (its text and the
    tool calls the model made, or on a tool turn the scripted call where it made none), the
    results of those calls (`turn.text` for the first, "ok" for the others), then on a user turn
    the user's message."""
    calls = reply_calls
    if not calls and turn.tool_call is not None:
        call = turn.tool_call
        calls = [{"id": call.id, "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}}]  # fmt: skip
    assistant: dict = {"role": "assistant", "content": reply}
    if calls:
        assistant["tool_calls"] = calls
    out = [assistant]
    for i, call in enumerate(calls):
        result = turn.text if i == 0 and turn.kind == "tool" else "ok"
        out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    if turn.kind == "user":
        out.append({"role": "user", "content": turn.text})
    return out
