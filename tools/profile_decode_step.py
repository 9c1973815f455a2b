"""Where a decode step's GPU time goes, kernel by kernel, with the expert calls in the graph.

One expert worker (subprocess) on CHECKPOINT and the GPU service in this process, per mode of
bench_e2e.py (graph, graph-memops, ...): a batch decodes under torch.profiler (CUPTI records
the kernels inside CUDA graphs), and the GPU timeline of the step is split per MoE layer into
    compute   the model's kernels (attention, norms, router, shared expert, sampling ...)
    post      the kernels and copies that hand a call to the worker (device_kernels' post, or
              the staging pack and the copy into the slot)
    collect   the kernels and copies that take its reply (device_kernels' collect spins there
              until the worker answers: that is the expert wait; with memops the wait is a
              stream memory operation, which CUPTI does not show: it falls into the gaps)
    gaps      the GPU idle between one operation's end and the next one's start
The first and last steps are dropped (their edges are the host's).

--middle also lists, kernel by kernel, the GPU's work between two MoE layers of one step (from a
collect's end to the next layer's post: the non-expert time of a layer in the model's middle, with
no head, embedding or dense layer in it), the median such gap of the run. It counts one collect
per MoE layer: one worker, no expert deferral.

    python tools/profile_decode_step.py CHECKPOINT [--modes graph,graph-memops] [--batch 1]
                                        [--middle]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.bench_decode import run_batch  # noqa: E402
from bench.bench_e2e import MODES, service_config  # noqa: E402
from bench.common import Column, default_device, print_table  # noqa: E402
from bench.worker_process import expert_worker  # noqa: E402
from gpu_service.service import build_gpu_service  # noqa: E402
from ktserve.checkpoint import ModelSpec  # noqa: E402

POST = ("_post_kernel",)
COLLECT = ("_collect_kernel",)


def classify(event: dict) -> str:
    name = event["name"]
    if any(k in name for k in POST):
        return "post"
    if any(k in name for k in COLLECT):
        return "collect"
    if event.get("cat") == "gpu_memcpy":
        # DtoD into the mapped slot (post) or from it (collect): told apart by the order
        return "copy"
    return "compute"


def gpu_timeline(trace: Path) -> list[dict]:
    events = json.loads(trace.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("ph") == "X"]  # fmt: skip
    return sorted(gpu, key=lambda e: e["ts"])


def split(timeline: list[dict], calls: int) -> dict[str, float]:
    """Microseconds per MoE call in each part; calls: the MoE calls the timeline holds."""
    parts = {"compute": 0.0, "post": 0.0, "collect": 0.0, "copy": 0.0, "gaps": 0.0}
    counts = {k: 0 for k in parts}
    end = None
    for e in timeline:
        kind = classify(e)
        parts[kind] += e["dur"]
        counts[kind] += 1
        if end is not None and e["ts"] > end:
            parts["gaps"] += e["ts"] - end
        end = max(end or 0.0, e["ts"] + e["dur"])
    out = {k: v / calls for k, v in parts.items()}
    out["kernels/call"] = counts["compute"] / calls
    by_name: dict[str, float] = {}
    for e in timeline:
        if classify(e) == "compute":
            by_name[e["name"][:60]] = by_name.get(e["name"][:60], 0.0) + e["dur"] / calls
    out["top"] = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return out


def middle_gaps(timeline: list[dict], moe_layers: int) -> list[list[dict]]:
    """The events between a collect and the next post, for each pair of MoE layers of one step
    (a step's last collect is followed by the head and the next step's first layers: skipped)."""
    gaps, current, collects = [], None, 0
    for e in timeline:
        kind = classify(e)
        if kind == "collect":
            collects += 1
            middle = collects % moe_layers != 0
            current = [e] if middle else None
        elif kind == "post":
            if current is not None:
                gaps.append(current + [e])  # the collect, what follows it, the post
            current = None
        elif current is not None:
            current.append(e)
    return gaps


def describe_gap(events: list[dict]) -> tuple[float, list[list[str]]]:
    """(us from the collect's end to the post's start, rows: kernel, us, idle before it)."""
    end = events[0]["ts"] + events[0]["dur"]
    span = events[-1]["ts"] - end
    rows = []
    for e in events[1:-1]:
        rows.append([e["name"][:60], f"{e['dur']:.1f}", f"{max(0.0, e['ts'] - end):.1f}"])
        end = max(end, e["ts"] + e["dur"])
    rows.append(["(post starts)", "-", f"{max(0.0, events[-1]['ts'] - end):.1f}"])
    return span, rows


def profile_mode(mode: str, args, address: str, moe_layers: int) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    config = service_config(mode, args.checkpoint, args.device, address, args.batch,
                            args.tokens + 128)  # fmt: skip
    service = build_gpu_service(config)
    try:
        run_batch(service, args.batch, 16)  # warm-up: captures the graphs
        with tempfile.TemporaryDirectory() as tmp:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                got = run_batch(service, args.batch, args.tokens)
                torch.cuda.synchronize()
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            timeline = gpu_timeline(trace)
    finally:
        service.close()
    steps = got["steps"]
    out = split(timeline, steps * moe_layers)
    out["step_ms"] = 1e3 * args.batch * (args.tokens - 1) / got["tok/s"] / steps
    out["gpu_span_ms"] = (timeline[-1]["ts"] + timeline[-1]["dur"] - timeline[0]["ts"]) / 1e3
    out["steps"] = steps
    gaps = sorted(middle_gaps(timeline, moe_layers), key=lambda g: describe_gap(g)[0])
    out["middle"] = describe_gap(gaps[len(gaps) // 2]) if gaps else None
    out["middle_count"] = len(gaps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--format", default="int4", choices=("int4", "int8", "bf16"))
    parser.add_argument("--threads", type=int, default=15)
    parser.add_argument("--spin-us", type=float, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--modes", default="graph,graph-memops")
    parser.add_argument("--device", default=default_device())
    parser.add_argument(
        "--middle", action="store_true", help="list the kernels between two MoE layers of a step"
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {sorted(MODES)}")
    moe_layers = len(ModelSpec.from_checkpoint(args.checkpoint).moe_layers)
    rows, tops, middles = [], {}, {}
    with expert_worker(args.checkpoint, args.format, args.threads, args.spin_us) as address:
        for mode in modes:
            r = profile_mode(mode, args, address, moe_layers)
            tops[mode] = r["top"]
            middles[mode] = (r["middle"], r["middle_count"])
            rows.append([mode, str(args.batch), f"{r['step_ms']:.2f}",
                         *(f"{r[k]:.1f}" for k in ("compute", "post", "collect", "copy", "gaps")),
                         f"{r['kernels/call']:.1f}"])  # fmt: skip
    print(f"{args.checkpoint.name}: {moe_layers} MoE layers, batch {args.batch}, "
          f"{args.tokens} tokens; microseconds per MoE layer of a step")  # fmt: skip
    print_table([Column("mode", 16, "<"), Column("batch", 5), Column("step ms", 7),
                 Column("compute", 7), Column("post", 6), Column("collect", 7),
                 Column("copies", 6), Column("gaps", 6), Column("kernels", 7)], rows)  # fmt: skip
    for mode, top in tops.items():
        print(f"{mode}: the compute kernels that take longest, us per MoE layer")
        print_table([Column("kernel", 60, "<"), Column("us", 6)],
                    [[name, f"{us:.1f}"] for name, us in top])  # fmt: skip
    for mode, (middle, count) in middles.items() if args.middle else ():
        if middle is None:
            print(f"{mode}: no two MoE layers of one step to look between")
            continue
        span, kernel_rows = middle
        print(
            f"{mode}: between two MoE layers of a step, the median of {count} gaps: "
            f"{span:.1f} us from a collect's end to the next post"
        )
        print_table(
            [Column("kernel", 60, "<"), Column("us", 6), Column("idle before", 11)], kernel_rows
        )


if __name__ == "__main__":
    main()
