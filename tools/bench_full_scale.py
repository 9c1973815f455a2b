"""A model at full scale through `ktserve serve`, one configuration after another (issue 18).

Each --config NAME=FLAGS starts `ktserve serve CHECKPOINT FLAGS` (a subprocess, as users run
it; e.g. tensor-parallel sizes, worker placements) and measures, over its HTTP API:
  load      seconds from start to serving, and each expert worker's resident memory (RSS)
  decode    tok/s at each --batch: that many greedy streams (ignore_eos, 16-token prompts of
            random ids), counted over the window in which all of them decode
  prefill   tok/s of one --prefill-token prompt of random ids: its length / time to first token
beside the CPU bound at batch 1: the routed experts' bytes one token reads (top-k experts of
every MoE layer, in --format) over the DRAM read bandwidth, measured on every NUMA node at
once (a reader pinned to each node's CPUs, its buffer first-touched there) before each config
and at the end; medians. Ratios are against the first config.

CHECKPOINT: a Hugging Face checkpoint, or for shapes whose experts no disk holds,
`python bench/real_checkpoint.py OUT --shape deepseek --experts synthetic` (the GPU part on
disk; the workers fill their packed experts from its seed, which this benchmark allows them).

    python tools/bench_full_scale.py CHECKPOINT [--config NAME="--flag ..."]... [--format int4]
        [--batch 1,4,16] [--prefill 512,2048,8192] [--tokens 32] [--dram-gb 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import Column, print_table  # noqa: E402
from expert_service import synthetic_experts  # noqa: E402
from ktserve.checkpoint import HFConfig, ModelSpec  # noqa: E402
from ktserve.numa import read_topology  # noqa: E402
from ktserve.packed_layout import tensor_specs  # noqa: E402
from tests.support.api_server import ServerProcess  # noqa: E402

PROMPT_TOKENS = 16


def dram_per_node(gb: float) -> dict[int, float]:
    """GB/s read on each node, all nodes at once: one reader process pinned to each."""
    code = ("import os, sys; os.sched_setaffinity(0, {cpus}); "
            "from bench.common import stream_read_gbs; "
            "print(stream_read_gbs({threads}, {gb}, True))")  # fmt: skip
    procs = {
        node: subprocess.Popen(
            [sys.executable, "-c", code.format(cpus=set(cpus), threads=len(cpus), gb=gb)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        for node, cpus in ((n.node_id, n.cpus) for n in read_topology().nodes)
    }
    out = {}
    for node, proc in procs.items():
        text, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the DRAM reader on node {node} failed ({proc.returncode})")
        out[node] = float(text.strip().splitlines()[-1])
    return out


def routed_bytes_per_token(spec: ModelSpec, fmt: str) -> int:
    """Bytes of the top-k experts of every MoE layer in `fmt` (packed, scales included)."""
    specs = tensor_specs(fmt, spec.hidden_size, spec.moe_intermediate_size)
    per_expert = sum(d.itemsize * n for d, n in specs.values())
    return per_expert * spec.num_experts_per_tok * len(spec.moe_layers)


def worker_rss_gib(server_pid: int) -> list[float]:
    """Resident memory of each `ktserve expert` process below the server."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = [], list(children.get(server_pid, []))
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, []))
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if b"expert" in cmd:
            rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
            found.append(rss_kib / 2**20)
    return sorted(found, reverse=True)


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int,
                      times: list[float]) -> None:  # fmt: skip
    """POST a streamed completion; appends each token chunk's arrival time to `times`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"completion failed: {response.status} {response.read()[:500]!r}")
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    finally:
        conn.close()


def decode_rate(url: str, model: str, batch: int, tokens: int, vocab: int, rng) -> float:
    """tok/s of `batch` concurrent greedy streams, over the window in which all decode."""
    times: list[list[float]] = [[] for _ in range(batch)]
    threads = [threading.Thread(target=stream_completion, args=(
        url, model, [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)], tokens, times[i]))
        for i in range(batch)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(len(t) < 2 for t in times):
        raise SystemExit(f"a stream of batch {batch} returned fewer than 2 tokens")
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    inside = sum(start < x <= end for t in times for x in t)
    return inside / (end - start) if end > start else float("nan")


def prefill_rate(url: str, model: str, n: int, vocab: int, rng) -> tuple[float, float]:
    """(tok/s, seconds to the first token) of one n-token prompt."""
    times: list[float] = []
    start = time.perf_counter()
    stream_completion(url, model, [rng.randrange(vocab) for _ in range(n)], 1, times)
    ttft = times[0] - start
    return n / ttft, ttft


def run_config(args, name: str, flags: list[str], spec: ModelSpec, rng) -> dict:
    env = {synthetic_experts.ENV: "1"}  # NOTE: a benchmark: synthetic experts are let through
    start = time.perf_counter()
    server = ServerProcess(args.checkpoint, "--served-model-name", "bench", "--format",
                           args.format, "--no-prefix-caching", *flags, env=env,
                           timeout=args.load_timeout)  # fmt: skip
    try:
        loaded = time.perf_counter() - start
        rss = worker_rss_gib(server.proc.pid)
        print(f"[{name}] serving after {loaded:.1f} s; workers' RSS "
              + ", ".join(f"{r:.1f}" for r in rss) + " GiB", flush=True)  # fmt: skip
        decode = {}
        for b in args.batches:
            decode[b] = decode_rate(server.url, "bench", b, args.tokens, args.vocab, rng)
            print(f"[{name}] decode batch {b}: {decode[b]:.2f} tok/s", flush=True)
        prefill = {}
        for n in args.prefills:
            prefill[n] = prefill_rate(server.url, "bench", n, args.vocab, rng)
            print(f"[{name}] prefill {n}: {prefill[n][0]:.0f} tok/s", flush=True)
        if server.terminate() != 0:
            raise SystemExit(f"[{name}] the server did not exit cleanly:\n"
                             + server.stderr()[-3000:])  # fmt: skip
    finally:
        server.close()
    return {"load_s": loaded, "rss_gib": rss, "decode": decode, "prefill": prefill}


def print_results(args, spec, results: dict, dram: list[dict[int, float]]) -> None:
    per_node = {n: statistics.median(s[n] for s in dram) for n in dram[0]}
    host_gbs = sum(per_node.values())
    per_token = routed_bytes_per_token(spec, args.format)
    bound = host_gbs * 1e9 / per_token
    base_name, base = next(iter(results.items()))
    print(f"\n{args.checkpoint.name}: {len(spec.moe_layers)} MoE layers, {spec.num_experts} "
          f"experts, top-{spec.num_experts_per_tok}, {args.format} experts")  # fmt: skip
    columns = [Column("config", 14, "<"), Column("what", 13, "<"), Column("tok/s", 10),
               Column("TTFT s", 8), Column("CPU bound", 10), Column("% bound", 8),
               Column(f"vs {base_name}", 10)]  # fmt: skip
    rows = []
    for name, r in results.items():
        for b, rate in r["decode"].items():
            at_bound = b == 1
            rows.append((name, f"decode {b}", f"{rate:.2f}", "",
                         f"{bound:.2f}" if at_bound else "",
                         f"{rate / bound:.0%}" if at_bound else "",
                         f"{rate / base['decode'][b]:.2f}"))  # fmt: skip
        for n, (rate, ttft) in r["prefill"].items():
            rows.append((name, f"prefill {n}", f"{rate:.0f}", f"{ttft:.3f}", "", "",
                         f"{rate / base['prefill'][n][0]:.2f}"))  # fmt: skip
    print_table(columns, rows)
    print()
    load_columns = [Column("config", 14, "<"), Column("load s", 8),
                    Column("workers' RSS GiB", 30, "<")]  # fmt: skip
    rss = {n: ", ".join(f"{x:.1f}" for x in r["rss_gib"]) for n, r in results.items()}
    print_table(load_columns, [(n, f"{r['load_s']:.1f}", rss[n]) for n, r in results.items()])
    samples = "; ".join(", ".join(f"node {n} {g:.1f}" for n, g in s.items()) for s in dram)
    print(f"\nDRAM read GB/s per sample: {samples}. Medians: "
          + ", ".join(f"node {n} {g:.1f}" for n, g in per_node.items())
          + f"; host {host_gbs:.1f} GB/s. CPU bound at batch 1 = host GB/s / "
          f"{per_token / 1e9:.3f} GB read per token.")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--config", action="append", metavar="NAME=FLAGS",
                        help="a configuration: its name and `ktserve serve` flags (repeat; "
                        "default: one named default with no flags)")  # fmt: skip
    parser.add_argument("--format", default="int4", choices=("bf16", "int8", "int4"))
    parser.add_argument("--batch", default="1,4,16")
    parser.add_argument("--prefill", default="512,2048,8192", help="prompt lengths ('' none)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per decode stream")
    parser.add_argument("--dram-gb", type=float, default=4.0, help="GB each node's reader reads")
    parser.add_argument("--load-timeout", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batch.split(",") if b]
    args.prefills = [int(n) for n in args.prefill.split(",") if n]
    configs = {}
    for item in args.config or ["default="]:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--config takes NAME=FLAGS, got {item!r}")
        configs[name] = shlex.split(flags)
    spec = ModelSpec.from_checkpoint(args.checkpoint)
    args.vocab = HFConfig.from_checkpoint(args.checkpoint).data["vocab_size"]
    rng = random.Random(args.seed)
    dram, results = [dram_per_node(args.dram_gb)], {}
    for name, flags in configs.items():
        results[name] = run_config(args, name, flags, spec, rng)
        dram.append(dram_per_node(args.dram_gb))
    print_results(args, spec, results, dram)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "dram": dram}, default=str))


if __name__ == "__main__":
    main()
