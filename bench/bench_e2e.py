"""Decode and prefill at a real model's shapes through the serving path, beside llama.cpp.

One expert worker (`ktserve expert`, a subprocess) on CHECKPOINT (bench/real_checkpoint.py
writes them) and the GPU service in this process, once per mode:
  graph     CUDA graphs, the expert calls inside them (the whole decode step is one graph)
  segments  CUDA graphs of the segments between MoE layers, the host calls the experts
  graph-d1, segments-d1  the same with one expert per token deferred (--modes names them; the
            worker's per-call phases are then per call, two per deferring layer)
  graph-memops   graph with the hand-off of KTSERVE_DEVICE_HANDOFF=memops (copies and stream
            memory operations where by default Triton kernels read and write the workers' slots)
  graph-unchained  graph with KTSERVE_CHAIN_DECODE_STEPS=0 (each decode step decided and
            launched after the last one's tokens reach the host)
  graph-unfused  graph with KTSERVE_FUSED_KERNELS=0 (RMSNorm and RoPE as torch's elementwise
            steps)
  graph-fp8  graph with --gpu-weight-format fp8 (the GPU part's linear layers in FP8: what
            `auto` picks where bf16 would take over half the GPU's memory budget); every other
            mode runs the GPU part in bf16, whatever the checkpoint
  graph-int8  graph with --gpu-weight-format int8 (weight-only int8, a scale per output)
  graph-noflashmla  graph with KTSERVE_FLASHMLA=0 (an MLA model where FlashMLA serves:
            ktserve's own MLA decode kernels and 16-token cache blocks)
  graph-stamps  graph with the hand-off kernels timing themselves on the GPU's clock
            (device_kernels.py's STAMPS): per call, the GPU's wait from its request bell to the
            reply it saw, less the worker's part of it, is the two bells' latency; and the GPU's
            part between two MoE layers, beside the worker's idle in (a table of its own)
  stream-off, stream-on, stream-auto  graph with --stream-prefill off / on / auto: prefill's
            chunks through the CPU workers, streamed to the GPU, or as the start-up cost model
            chooses (printed per mode)
  MODE@2    MODE again (e.g. --modes stream-off,stream-on,stream-off@2: what a mode leaves behind
            shows in the one after it)
For each: decode tok/s at each batch size (greedy, ignore_eos, 16-token prompts), the per-MoE-
layer split of a step (the GPU's part is the segments mode's measured GPU time; the worker's
dispatch, kernel, publish and bookkeeping come from its GetStats; hand-off is what is left of the
step), prefill tok/s and time to first token for one long prompt, and the CPU bound: the bytes
of the experts the worker read per step (its weight_bytes_read) over the DRAM read bandwidth,
sampled at the start, between modes and at the end (medians). With --llama-build and --gguf,
llama.cpp's llama-bench and llama-batched-bench run on the same checkpoint (GGUF, converted by
../shared/peers/llamacpp/run_peer.sh) after ktserve, with the same threads, and the tables show
the ratios.

    python bench/bench_e2e.py CHECKPOINT [--format int4] [--threads 15] [--batch 1,4,16,64]
        [--prefill 512,2048,8192] [--tokens 64] [--modes graph,segments]
        [--max-num-batched-tokens 2048]
        [--llama-build DIR --gguf FILE --peer-script run_peer.sh]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

import grpc  # noqa: E402

from bench.bench_decode import histogram_sum, run_batch  # noqa: E402
from bench.common import (  # noqa: E402
    Column,
    DramMeter,
    GcPauses,
    busy_while_idle,
    default_device,
    print_table,
)
from bench.worker_process import expert_worker  # noqa: E402
from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig  # noqa: E402
from gpu_service.engine import SamplingParams  # noqa: E402
from gpu_service.service import build_gpu_service  # noqa: E402
from ktserve.checkpoint import ModelSpec, tensor_headers  # noqa: E402
from ktserve.checkpoint.headers import is_routed_expert  # noqa: E402
from ktserve.protocol import expert_pb2 as pb  # noqa: E402
from ktserve.protocol import expert_pb2_grpc as pb_grpc  # noqa: E402

MODES = {"graph": dict(cuda_graphs=True, graph_expert_calls=True),
         "segments": dict(cuda_graphs=True, graph_expert_calls=False),
         "eager": dict(cuda_graphs=False),
         "graph-d1": dict(cuda_graphs=True, graph_expert_calls=True,
                          max_deferred_experts_per_token=1),
         "segments-d1": dict(cuda_graphs=True, graph_expert_calls=False,
                             max_deferred_experts_per_token=1),
         "graph-unchained": dict(cuda_graphs=True, graph_expert_calls=True,
                                 chain_decode_steps=False),
         "graph-unfused": dict(cuda_graphs=True, graph_expert_calls=True, fused_kernels=False),
         "graph-fp8": dict(cuda_graphs=True, graph_expert_calls=True, gpu_weight_format="fp8"),
         # MLA models where FlashMLA serves: ktserve's own MLA decode kernels (16-token blocks)
         "graph-noflashmla": dict(cuda_graphs=True, graph_expert_calls=True, flashmla=False),
         "graph-int8": dict(cuda_graphs=True, graph_expert_calls=True, gpu_weight_format="int8"),
         "graph-stamps": dict(cuda_graphs=True, graph_expert_calls=True,
                              experts=dict(handoff_stamps=True)),
         "graph-memops": dict(cuda_graphs=True, graph_expert_calls=True,
                              experts=dict(device_handoff="memops")),
         # prefill through the GPU (--stream-prefill), side by side: --modes stream-off,stream-on
         "stream-off": dict(cuda_graphs=True, graph_expert_calls=True, stream_prefill="off"),
         "stream-on": dict(cuda_graphs=True, graph_expert_calls=True, stream_prefill="on"),
         "stream-auto": dict(cuda_graphs=True, graph_expert_calls=True,
                             stream_prefill="auto")}  # fmt: skip
PHASES = ("dispatch", "kernel", "publish", "bookkeeping")


def linear_format(mode: str) -> str:
    """The GPU part's linear layers' format in a mode (service_config's bf16 unless it says)."""
    return MODES[base_mode(mode)].get("gpu_weight_format", "bf16")


def linear_formats(modes) -> str:
    """'bf16', or per mode where the modes differ ('graph bf16, graph-fp8 fp8')."""
    formats = {mode: linear_format(mode) for mode in modes}
    if len(set(formats.values())) == 1:
        return next(iter(formats.values()))
    return ", ".join(f"{mode} {fmt}" for mode, fmt in formats.items())


def base_mode(mode: str) -> str:
    """The MODES entry of a --modes name: MODE@N is MODE run again (drift, or what the modes
    before it left behind, shows beside its first run)."""
    return mode.split("@", 1)[0]


LAYER_NAME = re.compile(r"\.layers\.(\d+)\.")


def expert_tensor_bytes(checkpoint: Path, layers: int | None = None) -> int:
    """Bytes of the routed experts' tensors (scales included) of the first `layers` layers (None:
    all), from the safetensors headers."""
    total = 0
    for name, meta in tensor_headers(checkpoint).items():
        layer = LAYER_NAME.search(name)
        if is_routed_expert(name) and (layers is None or int(layer.group(1)) < layers):
            total += meta["data_offsets"][1] - meta["data_offsets"][0]
    return total


def layer_view(checkpoint: Path, layers: int, into: Path) -> Path:
    """A checkpoint directory in `into` that serves the first `layers` layers of `checkpoint`:
    every file of it linked, config.json's num_hidden_layers set to `layers` (the loaders read
    the tensors of the configured layers only)."""
    config = json.loads((checkpoint / "config.json").read_text())
    if not 0 < layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: the checkpoint has {config['num_hidden_layers']}")
    view = into / f"{checkpoint.name}-{layers}-layers"
    view.mkdir()
    for file in checkpoint.iterdir():
        if file.name != "config.json":
            (view / file.name).symlink_to(file.resolve())
    (view / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return view


def worker_stats(stub) -> dict[str, float]:
    s = stub.GetStats(pb.StatsRequest(), timeout=30)
    return {"calls": s.calls, "bytes": s.weight_bytes_read, "idle": s.idle_seconds,
            "gaps": s.idle_gaps, "inner_idle": s.inner_idle_seconds,
            "inner_gaps": s.inner_idle_gaps,
            **{p: getattr(s, f"{p}_seconds") for p in PHASES}}  # fmt: skip


HOST_PARTS = ("between", "sample", "launch", "replay")  # ktserve_engine_host_seconds{part}


def host_seconds(service) -> dict[str, tuple[float, float]]:
    """The engine thread's own time so far, per part: (seconds, steps)."""
    return {part: histogram_sum(service.metrics.host_seconds, part=part) for part in HOST_PARTS}


def chained_steps(service) -> float:
    return service.metrics.chained_steps._value.get()


def handoff_stamps(service):
    """The decode graphs' hand-off stamps so far ([worker, slot, 6] int64, device_kernels.py),
    or None where the mode keeps none."""
    graphs = service.engine.runner.decode_graphs
    calls = graphs.calls if graphs is not None else None
    return calls.handoff_stamps() if calls is not None else None


def gpu_and_host_clocks(service) -> tuple[int, int]:
    """(%globaltimer, the host's perf_counter_ns) at about one moment."""
    from gpu_service.experts.device_kernels import read_globaltimer

    gpu = read_globaltimer(service.engine.model.device)
    return gpu, time.perf_counter_ns()


def stamp_means(before, after) -> dict[str, float] | None:
    """Mean us of the GPU's wait per call (request bell -> reply seen) and of its part between
    two MoE layers of a step (a slot's collect end -> the next slot's request bell)."""
    if before is None:
        return None
    from gpu_service.experts.device_kernels import MIDDLE_SUM, MIDDLES, WAIT_SUM, WAITS

    d = (after - before).sum(dim=(0, 1)).tolist()
    mean = lambda total, count: total / count / 1e3 if count else float("nan")  # noqa: E731
    return {"wait": mean(d[WAIT_SUM], d[WAITS]), "middle": mean(d[MIDDLE_SUM], d[MIDDLES]),
            "calls": d[WAITS]}  # fmt: skip


def decode(service, stub, batch: int, tokens: int) -> dict[str, float]:
    """Decode from the requests' first tokens on: the counters are read once the prefill is
    done, so its calls (a 16-token prompt's, ~100 experts a layer at DeepSeek-V3 shapes) and
    its eager step's gaps stay out of the per-call and per-step figures."""
    start: dict = {}

    def snapshot() -> None:
        start.update(worker=worker_stats(stub), host=host_seconds(service),
                     chained=chained_steps(service), stamps=handoff_stamps(service))  # fmt: skip

    # NOTE: the clocks are read while the GPU is idle, before the requests and after them: read
    # at the snapshot, behind a running step, they gave a rate (1.13) the spans contradict
    stamped = handoff_stamps(service) is not None
    clocks = gpu_and_host_clocks(service) if stamped else None

    with GcPauses() as pauses:
        got = run_batch(service, batch, tokens, after_prefill=snapshot)
    before, host_before = start["worker"], start["host"]
    chained_before, stamps_before = start["chained"], start["stamps"]
    after, host_after = worker_stats(stub), host_seconds(service)
    got["stamps"] = stamp_means(stamps_before, handoff_stamps(service))
    if got["stamps"] is not None:  # the GPU's ns per host ns over the batch
        (g0, t0), (g1, t1) = clocks, gpu_and_host_clocks(service)
        got["stamps"]["gpu_clock_rate"] = (g1 - g0) / (t1 - t0)
    delta = {k: after[k] - before[k] for k in before}
    got["worker"] = delta
    got["gc"] = (pauses.count, pauses.seconds)
    got["chained"] = chained_steps(service) - chained_before
    got["host"] = {}
    for part in HOST_PARTS:
        (s0, n0), (s1, n1) = host_before[part], host_after[part]
        got["host"][part] = (s1 - s0) / (n1 - n0) if n1 > n0 else float("nan")
    return got


def prefill(service, n: int, seed: int) -> float:
    """Seconds to the first token of one n-token prompt (its whole prefill). Each (n, seed) has
    random tokens of its own: prompts that shared a start (as these once did, one formula for every
    length) let the prefix cache serve a longer prompt's first part, and the run stops where any
    token was served from it."""
    first = threading.Event()
    cached = []  # the first token's event's count of prompt tokens found in the cache

    def on_event(event) -> None:
        if event.tokens and not first.is_set():
            cached.append(event.num_cached_tokens)
            first.set()

    rng = random.Random(f"prefill {n} {seed}")
    top = min(service.engine.model.config.vocab_size, 1003)
    prompt = [rng.randrange(3, top) for _ in range(n)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    service.engine.add_request(prompt, params, on_event)
    if not first.wait(600):
        raise SystemExit(f"no first token for a {n}-token prompt in 600 s")
    took = time.perf_counter() - start
    if cached[0]:
        raise SystemExit(f"the {n}-token prefill prompt was served in part by the prefix cache "
                         f"({cached[0]} tokens)")  # fmt: skip
    return took


def service_config(mode: str, checkpoint: Path, device: str, address: str, max_batch: int,
                   max_model_len: int, max_num_batched_tokens: int | None = None,
                   ) -> GPUServiceConfig:  # fmt: skip
    """The GPU service of one of MODES, bf16 (the GPU part's linear layers too, unless the mode
    names another format), on the worker at `address`."""
    batched = {} if max_num_batched_tokens is None else {
        "max_num_batched_tokens": max_num_batched_tokens}  # fmt: skip
    scheduler = SchedulerConfig(max_num_seqs=max_batch, max_model_len=max_model_len, **batched)
    service_fields = {**MODES[base_mode(mode)], "gpu_weight_format": linear_format(mode)}
    client = service_fields.pop("experts", {})  # ExpertClientConfig's fields
    return GPUServiceConfig(
        model_dir=str(checkpoint), device=device, dtype="bfloat16",
        cuda_graph_max_batch=max_batch, scheduler=scheduler,
        experts=ExpertClientConfig((address,), wire_dtype="bfloat16", **client),
        **service_fields,
    )  # fmt: skip


def run_mode(mode: str, args, address: str, stub, dram: DramMeter) -> dict:
    batches, prompts = args.batches, args.prefills
    longest = max(prompts, default=0)
    config = service_config(mode, args.checkpoint, args.device, address, max(batches),
                            longest + args.tokens + 64, args.max_num_batched_tokens)  # fmt: skip
    start = time.perf_counter()
    service = build_gpu_service(config)
    built = time.perf_counter() - start
    out: dict = {"decode": {}, "prefill": {}, "build_s": built}
    streaming = service.streaming
    out["stream"] = (streaming.cost.describe() if streaming is not None and streaming.cost
                     else "prefill: experts on the CPU workers")  # fmt: skip
    print(f"[{mode}] {out['stream']}", flush=True)
    try:
        run_batch(service, 1, 8)  # warm-up
        for b in batches:
            run_batch(service, b, 8)  # captures this batch size's graph(s)
            out["decode"][b] = decode(service, stub, b, args.tokens)
            r = out["decode"][b]
            print(f"[{mode}] batch {b}: {r['tok/s']:.1f} tok/s", flush=True)
        if mode.startswith("graph") and MODES[base_mode(mode)]["cuda_graphs"]:
            graph_steps = service.metrics.steps.labels(mode="graph")._value.get()
            if not graph_steps:
                raise SystemExit("CUDA graphs were asked for but no step ran as graphs")
        if prompts:
            prefill(service, min(prompts), 0)  # warm-up
        for n in prompts:
            ttft = min(prefill(service, n, rep + 1) for rep in range(args.prefill_reps))
            out["prefill"][n] = ttft
            print(f"[{mode}] prefill {n}: {n / ttft:.0f} tok/s, first token {ttft:.3f} s",
                  flush=True)  # fmt: skip
        _, steps = histogram_sum(service.metrics.step_seconds, phase="gpu")
        out["steps"] = steps
    finally:
        service.close()
    out["idle_check"] = busy_while_idle()
    print(f"[{mode}] closed; host while idle: {out['idle_check']}", flush=True)
    dram.sample(f"after {mode}")
    return out


def print_stamps(results: dict) -> None:
    """The hand-off on the GPU's clock (modes that keep stamps: graph-stamps)."""
    rows = []
    for mode, res in results.items():
        for b, r in res["decode"].items():
            st = r.get("stamps")
            if not st:
                continue
            w = r["worker"]
            calls = max(w["calls"], 1)
            worker = sum(w[p] for p in ("dispatch", "kernel", "publish")) / calls * 1e6
            inner_gaps = w.get("inner_gaps", 0)
            inner = w["inner_idle"] / inner_gaps * 1e6 if inner_gaps else float("nan")
            rate = st.get("gpu_clock_rate", float("nan"))
            rows.append([mode, str(b), f"{rate:.4f}", str(int(st["calls"])), f"{st['wait']:.1f}",
                         f"{worker:.1f}", f"{st['wait'] - worker:.1f}", f"{st['middle']:.1f}",
                         f"{inner:.1f}", f"{inner - st['middle']:.1f}"])  # fmt: skip
    if not rows:
        return
    print(
        "\nthe hand-off on the GPU's clock (us a call): wait = from the post's request bell to "
        "the reply the collect saw; worker = its dispatch + kernel + publish (its clock, from "
        "the request seen to the reply out); bells = wait - worker: both bells' latency and the "
        "worker's wake-up; middle = the GPU from a collect's end to the next MoE layer's request "
        "bell (its part between two MoE layers, the post included); idle in = the worker's gap "
        "there; idle in - middle: the same two bells and the worker's own gap, seen from its side; "
        "GPU clock: %globaltimer's ns per host ns over the batch, read on an idle GPU before and "
        "after it (1: the two clocks agree)"
    )
    cols = [Column("mode", 12, "<"), Column("batch", 5), Column("GPU clock", 9),
            Column("calls", 6), Column("wait", 8),
            Column("worker", 8), Column("bells", 6), Column("middle", 7), Column("idle in", 7),
            Column("idle in - middle", 16)]  # fmt: skip
    print_table(cols, rows)


# ---------------------------------------------------------------------------- llama.cpp
def run_llama(args) -> dict:
    """llama-bench (prefill at --prefill, decode --tokens) and llama-batched-bench (batches)."""
    env = dict(os.environ, THREADS=str(args.threads), NGEN=str(args.tokens),
               PROMPTS=",".join(map(str, args.prefills)) or "512",
               NPL=",".join(map(str, args.batches)), REPS=str(args.llama_reps))  # fmt: skip
    script = str(args.peer_script)
    found: dict = {"decode": {}, "prefill": {}}
    bench = subprocess.run(["bash", script, "bench", str(args.llama_build), str(args.gguf)],
                           capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    print(bench.stdout[-4000:], bench.stderr[-2000:] if bench.returncode else "", flush=True)
    for line in bench.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        test, speed = cells[-2], cells[-1]
        m = re.fullmatch(r"(pp|tg)(\d+)", test)
        if m and re.match(r"[\d.]+", speed):
            value = float(speed.split()[0])
            if m.group(1) == "pp":
                found["prefill"][int(m.group(2))] = value
            else:
                found["tg"] = value
    batched = subprocess.run(["bash", script, "batched", str(args.llama_build), str(args.gguf)],
                             capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    print(batched.stdout[-4000:], batched.stderr[-2000:] if batched.returncode else "", flush=True)
    for line in batched.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        if len(cells) == 10 and cells[2].isdigit():
            found["decode"][int(cells[2])] = float(cells[7])
    return found


# ---------------------------------------------------------------------------- tables
def print_results(args, spec: ModelSpec, results: dict, llama: dict, dram: DramMeter,
                  load: dict) -> None:  # fmt: skip
    layers = len(spec.moe_layers)
    bw = dram.gbs * 1e9
    spin = "default" if args.spin_us is None else f"{args.spin_us:g} us"
    print(f"\n{args.checkpoint.name}: {spec.family}, {layers} MoE layers of "
          f"{spec.num_experts} experts (top {spec.num_experts_per_tok}), experts {args.format} "
          f"on 1 worker x {args.threads} threads (spin {spin}), GPU part bf16 with its linear "
          f"layers in {linear_formats(results)}; {args.tokens} new tokens per request")  # fmt: skip
    print(f"worker load + convert: {load['seconds']:.1f} s for {load['bytes'] / 1e9:.1f} GB of "
          f"expert tensors = {load['bytes'] / load['seconds'] / 1e9:.2f} GB/s")  # fmt: skip
    print(dram.summary())
    print("\ndecode (tok/s; bound: the experts' bytes the worker read per step over DRAM bw)")
    cols = [Column("mode", 11, "<"), Column("batch", 5), Column("tok/s", 7), Column("ms/step", 7),
            Column("bound tok/s", 11), Column("% bound", 7), Column("llama.cpp", 9),
            Column("vs llama", 8), Column("vs b1", 5)]  # fmt: skip
    rows = []
    for mode, res in results.items():
        b1 = res["decode"].get(1, {}).get("tok/s")
        for b, r in res["decode"].items():
            step_s = 1 / (r["tok/s"] / b)
            per_step = r["worker"]["bytes"] / max(r["steps"], 1)
            bound = b / (per_step / bw) if per_step else float("nan")
            peer = llama.get("decode", {}).get(b) or (llama.get("tg") if b == 1 else None)
            rows.append([mode, str(b), f"{r['tok/s']:.1f}", f"{step_s * 1e3:.2f}",
                         f"{bound:.1f}", f"{100 * r['tok/s'] / bound:.0f}%",
                         f"{peer:.1f}" if peer else "-",
                         f"{r['tok/s'] / peer:.2f}x" if peer else "-",
                         f"{r['tok/s'] / b1:.2f}" if b1 else "-"])  # fmt: skip
    print_table(cols, rows)
    print(
        "\nper MoE layer and step (ms): gpu = the segments mode's GPU time; worker phases "
        "from GetStats; hand-off = the rest of the step (transfers, wake-ups, launches); idle = "
        "the worker's mean gap from a reply to the next request (the caller's time between "
        "two calls: gpu + hand-off); idle in = the same gap between two MoE layers of one "
        "step only (the non-expert time of a layer in the model's middle: the gaps that span "
        "a step's end, with the head and the first layers, left out), and its share of the "
        "kernel"
    )
    cols = [Column("mode", 11, "<"), Column("batch", 5), Column("layer", 6), Column("gpu", 6),
            *[Column(p, len(p)) for p in PHASES], Column("hand-off", 8),
            Column("idle", 6), Column("idle in", 7), Column("/kernel", 7)]  # fmt: skip
    rows = []
    seg = results.get("segments", {}).get("decode", {})
    for mode, res in results.items():
        for b, r in res["decode"].items():
            per_layer = 1e3 / (r["tok/s"] / b) / layers
            calls = max(r["worker"]["calls"], 1)
            phase = {p: r["worker"][p] / calls * 1e3 for p in PHASES}
            gpu = seg[b]["gpu"] / layers if b in seg else float("nan")
            rest = per_layer - gpu - phase["dispatch"] - phase["kernel"] - phase["publish"]
            gaps = r["worker"].get("gaps", 0)
            idle = r["worker"]["idle"] / gaps * 1e3 if gaps else float("nan")
            inner_gaps = r["worker"].get("inner_gaps", 0)
            inner = r["worker"]["inner_idle"] / inner_gaps * 1e3 if inner_gaps else float("nan")
            share = inner / phase["kernel"] if phase["kernel"] else float("nan")
            rows.append([mode, str(b), f"{per_layer:.3f}", f"{gpu:.3f}",
                         *[f"{phase[p]:.3f}" for p in PHASES], f"{rest:.3f}",
                         f"{idle:.3f}", f"{inner:.3f}", f"{100 * share:.0f}%"])  # fmt: skip
    print_table(cols, rows)
    print(
        "\nthe step's end (ms a step): end = the worker's mean gap across a step's end (its gaps "
        "but those inside steps; nan where fewer than one a step were under the worker's 5 ms "
        "idle bound); between and sample = the engine "
        "thread's own time (ktserve_engine_host_seconds: output processing and scheduling "
        "between two steps; logits to token ids, after the next step's launch where steps "
        "chain; the host's call that launches a step's graph, and of it the graph's replay() "
        "call alone); rest = end - those within it "
        "(the head and the first layers on the GPU, the step's preparation); gc = the cyclic "
        "garbage "
        "collector's runs during the batch and their pause per step (any thread's run holds "
        "the GIL)"
    )
    cols = [Column("mode", 11, "<"), Column("batch", 5), Column("end", 6), Column("between", 7),
            Column("sample", 6), Column("launch", 6), Column("replay", 6), Column("rest", 6),
            Column("gc runs", 7),
            Column("gc ms", 6)]  # fmt: skip
    rows = []
    for mode, res in results.items():
        for b, r in res["decode"].items():
            w, host = r["worker"], r.get("host", {})
            ends = w.get("gaps", 0) - w.get("inner_gaps", 0)
            counted = ends >= r.get("steps", 0) / 2
            end = (w["idle"] - w.get("inner_idle", 0.0)) / ends * 1e3 if counted else float("nan")
            between = host.get("between", float("nan")) * 1e3
            sample = host.get("sample", float("nan")) * 1e3
            launch = host.get("launch", float("nan")) * 1e3
            replay = host.get("replay", float("nan")) * 1e3
            within = between + (0.0 if math.isnan(launch) else launch)
            within += 0.0 if r.get("chained") else sample
            gc_runs, gc_seconds = r.get("gc", (0, 0.0))
            gc_ms = gc_seconds / r["steps"] * 1e3 if r.get("steps") else float("nan")
            rows.append([mode, str(b), f"{end:.3f}", f"{between:.3f}", f"{sample:.3f}",
                         f"{launch:.3f}", f"{replay:.3f}", f"{end - within:.3f}", str(gc_runs),
                         f"{gc_ms:.3f}"])  # fmt: skip
    print_table(cols, rows)
    print_stamps(results)
    if args.prefills:
        print("\nprefill (one prompt; time to first token)")
        cols = [Column("mode", 11, "<"), Column("tokens", 6), Column("TTFT s", 7),
                Column("tok/s", 7), Column("llama.cpp", 9), Column("vs llama", 8)]  # fmt: skip
        rows = []
        for mode, res in results.items():
            for n, ttft in res["prefill"].items():
                peer = llama.get("prefill", {}).get(n)
                rows.append([mode, str(n), f"{ttft:.3f}", f"{n / ttft:.0f}",
                             f"{peer:.0f}" if peer else "-",
                             f"{n / ttft / peer:.2f}x" if peer else "-"])  # fmt: skip
        print_table(cols, rows)


def run_ktserve(args, modes: list[str], dram: DramMeter) -> tuple[dict, dict]:
    expert_bytes = expert_tensor_bytes(args.checkpoint, args.layers)
    start = time.perf_counter()
    results = {}
    with expert_worker(args.checkpoint, args.format, args.threads, args.spin_us) as address:
        load = {"seconds": time.perf_counter() - start, "bytes": expert_bytes}
        print(f"worker serving after {load['seconds']:.1f} s", flush=True)
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.ExpertServiceStub(channel)
        try:
            for mode in modes:
                results[mode] = run_mode(mode, args, address, stub, dram)
        finally:
            channel.close()
    return results, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--format", default="int4", choices=("int4", "int8", "bf16"))
    parser.add_argument("--threads", type=int, default=15, help="expert worker threads")
    parser.add_argument(
        "--spin-us",
        type=float,
        help="how long the worker's channel thread and kernel pool spin for work "
        "(default: the worker's)",
    )
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--prefill", default="512,2048,8192", help="prompt lengths ('' none)")
    parser.add_argument("--prefill-reps", type=int, default=2)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step: longer prompts prefill in chunks of this",
    )
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per decode request")
    parser.add_argument("--modes", default="graph,segments")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dram-gb", type=float, default=4.0)
    parser.add_argument("--llama-build", type=Path)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument(
        "--peer-script",
        type=Path,
        default=Path(__file__).resolve().parent.parent / ".peer" / "run_peer.sh",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="serve only the checkpoint's first N layers "
        "(a directory of links to its files, its config's layer count set to N)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--resume",
        type=Path,
        help="take ktserve's figures from this --json file of an earlier run of "
        "the same machine session (then run llama.cpp only, and print both)",
    )
    parser.add_argument("--llama-reps", type=int, default=2)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batch.split(",")]
    args.prefills = [int(n) for n in args.prefill.split(",") if n]
    modes = args.modes.split(",")
    unknown = {base_mode(m) for m in modes} - set(MODES)
    if len(set(modes)) != len(modes):
        raise SystemExit(f"a mode is named twice in {modes}: name a repeat MODE@2")
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {sorted(MODES)}")
    if args.layers and args.gguf:
        raise SystemExit("--layers serves part of the checkpoint; llama.cpp's GGUF is all of it")
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as scratch:
        if args.layers:
            args.checkpoint = layer_view(args.checkpoint, args.layers, Path(scratch))
        run(args, modes)


def run(args, modes: list[str]) -> None:
    spec = ModelSpec.from_checkpoint(args.checkpoint)
    dram = DramMeter(args.threads, args.dram_gb)
    if args.resume:
        earlier = json.loads(args.resume.read_text())
        results, load = earlier["results"], earlier["load"]
        for mode in results.values():  # JSON keys are strings
            mode["decode"] = {int(b): r for b, r in mode["decode"].items()}
            mode["prefill"] = {int(n): t for n, t in mode["prefill"].items()}
        dram.samples = [tuple(s) for s in earlier["dram"]]
    else:
        dram.sample("start")
        results, load = run_ktserve(args, modes, dram)
    llama = {}
    if args.llama_build and args.gguf:
        print(f"[llama.cpp] before it, host while idle: {busy_while_idle()}", flush=True)
        llama = run_llama(args)
    if llama:
        dram.sample("after llama.cpp")
    print_results(args, spec, results, llama, dram, load)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "llama": llama, "load": load,
                                         "dram": dram.samples}, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
