"""Load on `ktserve serve` over loopback: requests/s and latency at several concurrencies.

Starts `ktserve serve` (the demo model by default; its own expert worker, supervised) and runs,
for each concurrency C, C clients in a closed loop for --seconds: each sends a streamed
/v1/completions of --tokens new tokens (ignore_eos) and waits for its [DONE] before the next.
Prints one table: requests finished, failed (by status or error code), requests/s, tokens/s,
end-to-end latency p50/p99 and time to first token p50/p99. `--kill-worker` adds one run at the
last concurrency in which the expert worker is killed (SIGKILL) mid-way: the supervisor restarts
it and the requests wait (--worker-timeout), so none is lost.

    python bench/bench_load.py [--model demo_model] [--concurrency 1,8,32,128] [--seconds 20]
                               [--tokens 16] [--kill-worker]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import DEMO_MODEL, Column, default_device, print_table
from tests.support.api_server import ServerProcess

DEADLINE_S = 300.0  # one request's, client side: past it, it counts as lost


@dataclass
class Level:
    concurrency: int
    label: str = ""
    seconds: float = 0.0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def one_request(host: str, port: int, body: bytes) -> tuple[str | None, float, float, int]:
    """(failure or None, seconds to the first token, seconds to [DONE], tokens)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=DEADLINE_S)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            code = json.loads(response.read() or b"{}").get("error", {}).get("code")
            return f"{response.status} {code}", 0.0, 0.0, 0
        first, tokens, done = 0.0, 0, False
        for line in response.fp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return f"stream {chunk['error'].get('code')}", 0.0, 0.0, tokens
            if chunk["choices"] and chunk["choices"][0]["text"]:
                tokens += 1
                first = first or time.perf_counter() - start
        if not done:
            return "cut (no [DONE])", 0.0, 0.0, tokens
        return None, first, time.perf_counter() - start, tokens
    except OSError as exc:
        return f"{type(exc).__name__}", 0.0, 0.0, 0
    finally:
        conn.close()


def run_level(server: ServerProcess, level: Level, seconds: float, body: bytes,
              midway=None) -> Level:  # fmt: skip
    """C closed-loop clients for `seconds` (each finishes the request it is in); midway(): called
    once, halfway through."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    stop_at = time.perf_counter() + seconds

    def client() -> None:
        while time.perf_counter() < stop_at:
            failure, ttft, e2e, tokens = one_request(host, int(port), body)
            with level.lock:
                if failure is None:
                    level.e2e.append(e2e)
                    level.ttft.append(ttft)
                    level.tokens += tokens
                else:
                    level.failed[failure] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(level.concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    if midway is not None:
        time.sleep(seconds / 2)
        midway()
    for t in threads:
        t.join(seconds + DEADLINE_S)
    level.seconds = time.perf_counter() - start
    return level


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--seconds", type=float, default=20.0, help="per concurrency")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per request")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--format", default="int8")
    parser.add_argument("--threads", type=int, default=1, help="expert worker threads")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--kill-worker",
        action="store_true",
        help="one more run at the last concurrency, the worker killed mid-way",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    body = json.dumps(
        {
            "model": Path(args.model).name,
            "prompt": "The history of the city",
            "max_tokens": args.tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    flags = ["--device", args.device, "--format", args.format, "--threads", str(args.threads),
             "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "256",
             "--max-waiting-requests", str(max(levels))]  # fmt: skip
    env = {k: "" for k in ("KTSERVE_API_KEY", "KTSERVE_API_KEY_FILE")}  # /health's details
    server = ServerProcess(args.model, *flags, env=env, timeout=600)
    results: list[Level] = []
    try:
        run_level(server, Level(1), 2.0, body)  # warm-up
        for c in levels:
            results.append(run_level(server, Level(c, "ok"), args.seconds, body))
        if args.kill_worker:
            pid = server.health()[1]["workers"][0]["pid"]
            killed = Level(levels[-1], "worker killed")
            results.append(run_level(server, killed, args.seconds, body,
                                     midway=lambda: os.kill(pid, signal.SIGKILL)))  # fmt: skip
            restarts = server.health()[1]["workers"][0]["restarts"]
            killed.label = f"worker killed ({restarts} restart)"
        code = server.terminate()
    finally:
        server.close()
    print(f"load on ktserve serve: {Path(args.model).name} on {args.device}, 1 expert worker "
          f"({args.format}, {args.threads} threads), --max-num-seqs {args.max_num_seqs}, "
          f"{args.tokens} new tokens per streamed request, {args.seconds:g} s per level, "
          f"{os.cpu_count()} CPUs; server exit code {code}")  # fmt: skip
    columns = [Column("run", 26, "<"), Column("conc", 4), Column("done", 5), Column("failed", 6),
               Column("req/s", 7), Column("tok/s", 7), Column("p50 s", 6), Column("p99 s", 6),
               Column("ttft p50", 8), Column("ttft p99", 8),
               Column("failures", 20, "<")]  # fmt: skip
    rows = []
    for r in results:
        failures = ", ".join(f"{k}: {n}" for k, n in r.failed.items()) or "-"
        rows.append([r.label, str(r.concurrency), str(len(r.e2e)), str(sum(r.failed.values())),
                     f"{len(r.e2e) / r.seconds:.2f}", f"{r.tokens / r.seconds:.1f}",
                     f"{percentile(r.e2e, 50):.3f}", f"{percentile(r.e2e, 99):.3f}",
                     f"{percentile(r.ttft, 50):.3f}", f"{percentile(r.ttft, 99):.3f}",
                     failures])  # fmt: skip
    print_table(columns, rows, rule=False)


if __name__ == "__main__":
    main()
