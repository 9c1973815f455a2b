"""N concurrent coding-agent sessions replayed against served models over HTTP, one target after
the other with the identical workload (bench/agent_workload.py), one table row per target and N.

Each session is a thread of the openai SDK's client driving `/v1/chat/completions` with
`stream: true` and `stream_options.include_usage`; its generated length is forced with
max_tokens and `ignore_eos` (which ktserve and llama-server both take). Think times between a
session's turns are the simulated user's. Per target and N: time to first token (the first
chunk that carries generated text or a tool call) p50/p99, per-request decode tok/s (generated
tokens after the first over the time after the first) p50/p10, throughput (prompt + generated,
and generated alone, per second of the run's wall time), and the prefix-cache hit rate: from
ktserve's /metrics counters before and after (ktserve_prefix_cache_hits over _queries), else
from llama-server's `timings` (cache_n over cache_n + prompt_n), else n/a. With two targets or
more, ratio rows give the first target's TTFT p99 and decode p10 over each other's.

    python bench/agent_replay.py --target ktserve=http://127.0.0.1:8000 \\
        --target llama=http://127.0.0.1:8002 [--sessions 1,4,16] [--turns 6] [--json FILE]

The two servers on the same checkpoint, on the GPU host (llama.cpp's scripts:
../shared/peers/llamacpp/README.md; its `serve` listens on 8002 and serves the model as `model`):

    ktserve serve HF_DIR --format int4 --port 8000 &
    ../shared/peers/llamacpp/run_peer.sh build SRC.tar.gz WORK/build cuda
    ../shared/peers/llamacpp/run_peer.sh convert SRC.tar.gz HF_DIR WORK/model-bf16.gguf
    QUANTS=Q4_0 ../shared/peers/llamacpp/run_peer.sh quantize WORK/build WORK/model-bf16.gguf WORK
    CTX=262144 ../shared/peers/llamacpp/run_peer.sh serve WORK/build WORK/model-Q4_0.gguf 8002 &

(SRC.tar.gz is prune_src.sh's output. llama-server's 16 slots share CTX tokens of KV cache, 65536
by default: 16 sessions at the default sizes hold up to ~220k, hence CTX; ktserve's KV cache is
sized from the GPU memory left, --kv-cache-tokens.)

Requests use each target's first served model unless --model names it. --api-key (default
$KTSERVE_API_KEY) goes to every target, /metrics included. --json FILE writes every request's
record (without the messages it sent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

from bench.agent_records import COLUMNS, Record, Summary, summarize, table_rows, timings_hit_rate
from bench.agent_workload import (
    TOOLS,
    SessionScript,
    WorkloadConfig,
    first_messages,
    next_messages,
    workload,
)
from bench.common import print_table


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # without /v1


def prefix_cache_counters(target: Target, api_key: str) -> tuple[float, float] | None:
    """ktserve's prefix-cache (queried, hit) prompt tokens since its start, every tier's hits
    together; None where /metrics has no such counters (another server) or cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(
        target.url + "/metrics", headers={"Authorization": f"Bearer {api_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("ktserve_prefix_cache_queries", "ktserve_prefix_cache_hits"):
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    if len(totals) < 2:
        return None
    return totals["ktserve_prefix_cache_queries"], totals["ktserve_prefix_cache_hits"]


def stream_turn(client, model: str, record: Record, t0: float, ignore_eos: bool) -> list[dict]:
    """Sends record.messages, fills the record in as the stream goes; returns the reply's tool
    calls (OpenAI's message shape)."""
    stream = client.chat.completions.create(
        model=model,
        messages=record.messages,
        tools=list(TOOLS),
        max_tokens=record.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if ignore_eos else None,
    )
    text: list[str] = []
    calls: dict[int, dict] = {}
    for chunk in stream:
        now = time.perf_counter() - t0
        timings = (chunk.model_extra or {}).get("timings")
        if timings:
            record.cache_n, record.prompt_n = timings.get("cache_n"), timings.get("prompt_n")
        if chunk.usage is not None:
            record.prompt_tokens = chunk.usage.prompt_tokens
            record.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            delta = choice.delta
            reasoning = (delta.model_extra or {}).get("reasoning_content")
            if delta.content or reasoning or delta.tool_calls:
                if record.first_token_s is None:
                    record.first_token_s = now
                record.last_token_s = now
            if choice.finish_reason is not None:
                record.last_token_s = now
            text.append(delta.content or "")
            for call in delta.tool_calls or ():
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += call.id or ""
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
    record.reply = "".join(text)
    record.ok = True
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())]  # fmt: skip


def run_session(client, model: str, target: Target, script: SessionScript, num_sessions: int,
                index: int, t0: float, ignore_eos: bool) -> list[Record]:  # fmt: skip
    """The session's turns in order, each after its think time; a failed request ends it."""
    records: list[Record] = []
    messages = first_messages(script)
    last_calls: list[dict] = []
    for number, turn in enumerate(script.turns):
        if records:
            time.sleep(turn.think_s)  # NOTE: the workload's simulated user, not a wait
            last = records[-1]
            messages = messages + next_messages(turn, last.reply, last_calls)
        record = Record(target.name, num_sessions, index, number, turn.max_tokens,
                        start_s=time.perf_counter() - t0, messages=messages)  # fmt: skip
        records.append(record)
        try:
            last_calls = stream_turn(client, model, record, t0, ignore_eos)
        except Exception as exc:  # a failed request is a record of the run, not its end
            record.error = f"{type(exc).__name__}: {exc}"
            break
    return records


def served_model(client) -> str:
    return client.models.list().data[0].id


def make_client(target: Target, api_key: str):
    import openai

    return openai.OpenAI(base_url=target.url + "/v1", api_key=api_key, max_retries=0,
                         timeout=600)  # fmt: skip


def warm_up(client, model: str, ignore_eos: bool) -> None:
    """One short request that shares no prefix with the workload."""
    body = {"model": model, "messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 4}
    client.chat.completions.create(**body, extra_body={"ignore_eos": True} if ignore_eos else None)


def replay(target: Target, config: WorkloadConfig, num_sessions: int, model: str, api_key: str,
           ignore_eos: bool = True) -> tuple[Summary, list[Record]]:  # fmt: skip
    """One run: num_sessions sessions at once against target."""
    client = make_client(target, api_key)
    scripts = workload(config, num_sessions)
    before = prefix_cache_counters(target, api_key)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(num_sessions) as pool:
        futures = [pool.submit(run_session, client, model, target, script, num_sessions, i, t0,
                               ignore_eos) for i, script in enumerate(scripts)]  # fmt: skip
        records = [r for f in futures for r in f.result()]
    wall_s = time.perf_counter() - t0
    after = prefix_cache_counters(target, api_key)
    if before is not None and after is not None and after[0] > before[0]:
        hit_rate = (after[1] - before[1]) / (after[0] - before[0])
    else:
        hit_rate = timings_hit_rate(records)
    return summarize(records, wall_s, hit_rate), records


def parse_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    return float(low), float(high or low)


def int_range(text: str) -> tuple[int, int]:
    low, high = parse_range(text)
    return int(low), int(high)


def parse_target(text: str) -> Target:
    name, sep, url = text.partition("=")
    if not sep or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"a target is NAME=URL, got {text!r}")
    return Target(name, url.rstrip("/").removesuffix("/v1"))


def run_all(
    targets: list[Target],
    config: WorkloadConfig,
    sizes: list[int],
    model: str | None,
    api_key: str,
    ignore_eos: bool = True,
) -> tuple[list[Summary], list[Record]]:
    """Every N against each target in turn (the first target's runs first), each target warmed
    up by one request before its runs."""
    summaries, records = [], []
    for target in targets:
        client = make_client(target, api_key)
        name = model or served_model(client)
        warm_up(client, name, ignore_eos)
        for num_sessions in sizes:
            summary, run_records = replay(target, config, num_sessions, name, api_key, ignore_eos)
            errors = [r.error for r in run_records if not r.ok]
            first_error = f", {len(errors)} failed, first: {errors[0]}" if errors else ""
            print(f"{target.name} N={num_sessions}: {summary.num_requests} requests{first_error}",
                  file=sys.stderr)  # fmt: skip
            summaries.append(summary)
            records += run_records
    return summaries, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=parse_target, action="append", required=True,
                        help="NAME=URL, once per server, in order")  # fmt: skip
    parser.add_argument("--sessions", default="1,4,16", help="comma-separated N")
    defaults = WorkloadConfig()
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--start-tokens", type=int_range, default=defaults.start_tokens)
    parser.add_argument("--turn-tokens", type=int_range, default=defaults.turn_tokens)
    parser.add_argument("--gen-tokens", type=int_range, default=defaults.gen_tokens)
    parser.add_argument("--turns", type=int, default=defaults.turns)
    parser.add_argument("--think-s", type=parse_range, default=defaults.think_s)
    parser.add_argument("--model", default=None, help="default: each target's first model")
    parser.add_argument("--api-key", default=os.environ.get("KTSERVE_API_KEY", "unused"))
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="for a server that refuses the ignore_eos field")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="per-request records")
    args = parser.parse_args()
    config = WorkloadConfig(args.seed, args.start_tokens, args.turn_tokens, args.gen_tokens,
                            args.turns, args.think_s)  # fmt: skip
    summaries, records = run_all(args.target, config, [int(n) for n in args.sessions.split(",")],
                                 args.model, args.api_key, args.ignore_eos)  # fmt: skip
    print_table(COLUMNS, table_rows(summaries))
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_json() for r in records], indent=1))


if __name__ == "__main__":
    main()
