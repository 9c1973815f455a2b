"""bench/agent_replay.py: its statistics on hand-made records, its workload's determinism, and a
short replay against `ktserve serve` on the demo model (a subprocess, on the CPU)."""

from __future__ import annotations

import math

import pytest

from bench import agent_replay
from bench.agent_records import (
    COLUMNS,
    Record,
    Summary,
    percentile,
    summarize,
    table_rows,
    timings_hit_rate,
)
from bench.agent_replay import Target
from bench.agent_workload import WorkloadConfig, workload
from bench.common import print_table
from gpu_service.config import DEMO_MODEL_DIR
from tests.support.api_server import CPU_FLAGS, running_server

SERVE_FLAGS = (*CPU_FLAGS, "--max-model-len", "2048", "--kv-cache-tokens", "16384")


def record(ttft: float, decode_s: float, completion: int, ok: bool = True, **fields) -> Record:
    start = 1.0
    return Record("a", 4, 0, 0, completion, start, ok=ok, prompt_tokens=100,
                  completion_tokens=completion, first_token_s=start + ttft,
                  last_token_s=start + ttft + decode_s, **fields)  # fmt: skip


def test_summary_percentiles_and_rates():
    records = [
        record(0.1, 1.0, 11),  # 10 tok/s
        record(0.2, 0.5, 11),  # 20
        record(0.3, 0.25, 11),  # 40
        record(0.4, 0.125, 11),  # 80
        record(9.0, 9.0, 0, ok=False),
    ]
    s = summarize(records, wall_s=2.0, cache_hit_rate=0.5)
    assert (s.num_requests, s.num_failed) == (5, 1)
    assert s.ttft_p50_s == pytest.approx(0.25)
    assert s.ttft_p99_s == pytest.approx(0.1 + 0.99 * 3 * 0.1)
    assert s.decode_p50_tok_s == pytest.approx(30.0)
    assert s.decode_p10_tok_s == pytest.approx(10 + 0.1 * 3 * 10)
    assert s.tokens_per_s == pytest.approx((4 * 100 + 4 * 11) / 2.0)
    assert s.generated_per_s == pytest.approx(4 * 11 / 2.0)
    assert s.cache_hit_rate == 0.5


def test_decode_rate_needs_two_tokens_and_time():
    assert record(0.1, 1.0, 1).decode_tok_s is None
    assert record(0.1, 0.0, 5).decode_tok_s is None
    assert record(0.1, 2.0, 5).decode_tok_s == pytest.approx(2.0)
    assert math.isnan(percentile([], 50))


def test_timings_hit_rate_is_cached_over_all_prompt_tokens():
    records = [record(0.1, 1.0, 2, cache_n=30, prompt_n=10), record(0.1, 1.0, 2, cache_n=0,
               prompt_n=60), record(0.1, 1.0, 2)]  # fmt: skip
    assert timings_hit_rate(records) == pytest.approx(0.3)
    assert timings_hit_rate([record(0.1, 1.0, 2)]) is None


def test_ratio_rows_put_the_first_target_over_the_others():
    def summary(target: str, n: int, ttft_p99: float, decode_p10: float) -> Summary:
        return Summary(target, n, 8, 0, 0.1, ttft_p99, 50.0, decode_p10, 100.0, 10.0, None)

    summaries = [summary("kt", 1, 0.2, 30.0), summary("kt", 4, 0.5, 20.0),
                 summary("llama", 1, 0.8, 10.0), summary("llama", 4, 1.0, 40.0)]  # fmt: skip
    rows = table_rows(summaries)
    assert len(rows) == 6 and all(len(row) == len(COLUMNS) for row in rows)
    assert rows[0][-1] == "n/a"
    assert rows[4][:2] == ["kt/llama", "1"] and (rows[4][5], rows[4][7]) == ("0.25x", "3.00x")
    assert rows[5][:2] == ["kt/llama", "4"] and (rows[5][5], rows[5][7]) == ("0.50x", "0.50x")


def test_workload_is_deterministic_for_a_seed(seed):
    config = WorkloadConfig(seed=seed, turns=4)
    sessions = workload(config, 4)
    assert sessions == workload(config, 4)
    assert sessions != workload(WorkloadConfig(seed=seed + 1, turns=4), 4)
    assert len({s.turns for s in sessions}) == 4  # every session its own history ...
    assert len({s.system for s in sessions}) == 1  # ... after one system prompt
    assert workload(config, 1)[0].turns != sessions[0].turns  # runs of each N apart
    for s in sessions:
        assert [t.kind for t in s.turns][0] == "first" and len(s.turns) == 4
        assert all(100 <= t.max_tokens <= 300 for t in s.turns)
        assert all(t.tool_call is not None for t in s.turns if t.kind == "tool")


def test_replay_against_ktserve_on_the_demo_model(seed, capsys):
    config = WorkloadConfig(seed=seed, start_tokens=(64, 64), turn_tokens=(24, 48),
                            gen_tokens=(8, 8), turns=2, think_s=(0.0, 0.0))  # fmt: skip
    with running_server(DEMO_MODEL_DIR, *SERVE_FLAGS) as server:
        summaries, records = agent_replay.run_all(
            [Target("ktserve", server.url)], config, [1, 2], model=None, api_key="unused"
        )
    assert len(records) == (1 + 2) * 2
    assert all(r.ok for r in records), [r.error for r in records]
    assert all(r.completion_tokens == r.max_tokens == 8 for r in records)
    for s in summaries:
        assert s.num_failed == 0 and s.ttft_p99_s > 0 and s.decode_p10_tok_s > 0
    for first, second in zip(records[::2], records[1::2], strict=True):
        assert (first.session, first.turn, second.session, second.turn) == (
            first.session, 0, first.session, 1)  # fmt: skip
        grown = len(first.messages)
        assert second.messages[:grown] == first.messages  # the history is resent ...
        assert second.messages[grown]["content"] == first.reply  # ... with the reply ...
        assert len(second.messages) > grown + 1  # ... and new text
        assert second.prompt_tokens > first.prompt_tokens
    # N=1 runs first on a fresh server and its one session's first turn shares no cached block
    # (the warm-up shares no prefix): its hits are the second turn's reuse of the history.
    assert summaries[0].num_sessions == 1 and summaries[0].cache_hit_rate > 0
    assert summaries[1].cache_hit_rate > 0
    print_table(COLUMNS, table_rows(summaries))
    header = capsys.readouterr().out.splitlines()[0]
    for column in COLUMNS:
        assert column.title in header
