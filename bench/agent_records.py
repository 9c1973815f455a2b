"""The records of bench/agent_replay.py's requests and its table: per target and N, time to
first token p50/p99, per-request decode tok/s p50/p10, throughput over the run's wall time and
the prefix-cache hit rate, then the first target's ratios over the others'."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from bench.common import Column

COLUMNS = (
    Column("target", 16, "<"), Column("N", 3), Column("requests", 8), Column("failed", 6),
    Column("TTFT p50 s", 10), Column("TTFT p99 s", 10), Column("decode p50 tok/s", 16),
    Column("decode p10 tok/s", 16), Column("tok/s all", 9), Column("tok/s gen", 9),
    Column("cache hit", 9),
)  # fmt: skip


@dataclass
class Record:
    """One request of one session, times in seconds from the run's start."""

    target: str
    num_sessions: int
    session: int
    turn: int
    max_tokens: int
    start_s: float
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    cache_n: int | None = None  # llama-server's timings: prompt tokens from its cache ...
    prompt_n: int | None = None  # ... and computed
    reply: str = ""
    messages: list[dict] = field(default_factory=list, repr=False)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def decode_tok_s(self) -> float | None:
        """Generated tokens after the first over the time after the first."""
        if self.first_token_s is None or self.last_token_s is None or self.completion_tokens < 2:
            return None
        elapsed = self.last_token_s - self.first_token_s
        return (self.completion_tokens - 1) / elapsed if elapsed > 0 else None

    def to_json(self) -> dict:
        out = asdict(self)
        del out["messages"]
        return {**out, "ttft_s": self.ttft_s, "decode_tok_s": self.decode_tok_s}


@dataclass(frozen=True)
class Summary:
    target: str
    num_sessions: int
    num_requests: int
    num_failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    decode_p50_tok_s: float
    decode_p10_tok_s: float
    tokens_per_s: float  # prompt + generated
    generated_per_s: float
    cache_hit_rate: float | None


def percentile(values: list[float], q: float) -> float:
    """numpy's linear percentile; nan where there is no value."""
    return float(np.percentile(values, q)) if values else float("nan")


def timings_hit_rate(records: list[Record]) -> float | None:
    cached = sum(r.cache_n for r in records if r.cache_n is not None)
    computed = sum(r.prompt_n for r in records if r.prompt_n is not None)
    return cached / (cached + computed) if cached + computed else None


def summarize(records: list[Record], wall_s: float, cache_hit_rate: float | None) -> Summary:
    done = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    decodes = [r.decode_tok_s for r in done if r.decode_tok_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    generated = sum(r.completion_tokens for r in done)
    return Summary(
        target=records[0].target,
        num_sessions=records[0].num_sessions,
        num_requests=len(records),
        num_failed=len(records) - len(done),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        decode_p50_tok_s=percentile(decodes, 50),
        decode_p10_tok_s=percentile(decodes, 10),
        tokens_per_s=(prompt + generated) / wall_s,
        generated_per_s=generated / wall_s,
        cache_hit_rate=cache_hit_rate,
    )


def table_rows(summaries: list[Summary]) -> list[list[str]]:
    """A row per summary, then per N a ratio row of the first target over each other one."""
    rows = []
    for s in summaries:
        hit = "n/a" if s.cache_hit_rate is None else f"{s.cache_hit_rate:.1%}"
        rows.append([s.target, str(s.num_sessions), str(s.num_requests), str(s.num_failed),
                     f"{s.ttft_p50_s:.3f}", f"{s.ttft_p99_s:.3f}", f"{s.decode_p50_tok_s:.1f}",
                     f"{s.decode_p10_tok_s:.1f}", f"{s.tokens_per_s:.0f}",
                     f"{s.generated_per_s:.1f}", hit])  # fmt: skip
    first = summaries[0].target
    for base in (s for s in summaries if s.target == first):
        for other in (s for s in summaries if s.target != first):
            if other.num_sessions != base.num_sessions:
                continue
            ttft = base.ttft_p99_s / other.ttft_p99_s
            decode = base.decode_p10_tok_s / other.decode_p10_tok_s
            rows.append([f"{first}/{other.target}", str(base.num_sessions), "", "", "",
                         f"{ttft:.2f}x", "", f"{decode:.2f}x", "", "", ""])  # fmt: skip
    return rows
