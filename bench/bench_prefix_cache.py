"""Time to first token of an agent conversation replayed turn by turn, with and without prefix
caching, in one run.

An agent harness resends the whole conversation every turn: a long system prompt (tool
descriptions), then per turn a user or tool message and the model's reply, rendered with the
checkpoint's chat template. Two GPU services on one `ktserve expert` worker (a subprocess), one
with prefix caching and one with --no-prefix-caching, get each turn's prompt alternately (so the
machine's drift hits both alike); the replies (greedy) come from the cached service and go into
the history as text, as a harness would send them. --repeats N replays the conversation N times,
each time on a fresh cached service (so each meets every turn once, as a harness's server would).
Prints per turn the prompt length, the tokens served from the prefix cache, both TTFTs (the
median of the N) and their ratio.

    python bench/bench_prefix_cache.py [--model demo_model] [--turns 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import DEMO_MODEL, Column, default_device, print_table
from bench.worker_process import expert_worker
from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig
from gpu_service.engine import SamplingParams
from gpu_service.service import build_gpu_service

WORDS = ("path", "file", "read", "write", "search", "query", "result", "error", "line", "code",
         "function", "return", "value", "string", "number", "list", "object", "patch", "test",
         "build", "shell", "command", "output", "status", "diff", "commit", "branch",
         "config")  # fmt: skip


def text_of(tokenizer, rng: random.Random, num_tokens: int, kind: str) -> str:
    """Tool-schema or tool-output-like text of about num_tokens tokens."""
    lines: list[str] = []
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < num_tokens:
        a, b, c, d = rng.sample(WORDS, 4)
        if kind == "tools":
            params = f'{{"{c}": "string", "{d}": "integer"}}'
            lines.append(f'{{"name": "{a}_{b}", "description": "{a} {b} {c} {d}", '
                         f'"parameters": {params}}}')  # fmt: skip
        else:
            lines.append(f"{rng.randrange(1000):4d}: {a}({b}, {c}) -> {d} = {rng.randrange(10**6)}")
    return "\n".join(lines)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's token ids, through the checkpoint's chat template."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(getattr(ids, "input_ids", ids))


def first_token_seconds(service, prompt: list[int], max_tokens: int) -> tuple[float, list, int]:
    """(seconds to the first token, the generated token ids, prompt tokens from the cache)."""
    events: queue.Queue = queue.Queue()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    service.engine.add_request(prompt, params, events.put)
    ttft, tokens = None, []
    while True:
        event = events.get(timeout=900)
        if event.tokens and ttft is None:
            ttft = time.perf_counter() - start
        tokens.extend(t.token_id for t in event.tokens)
        if event.finish_reason is not None:
            if event.error is not None:
                raise SystemExit(f"request failed: {event.error}")
            return ttft, tokens, event.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--format", default="int8")
    parser.add_argument("--threads", type=int, default=1, help="expert worker threads")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1900)
    parser.add_argument("--turn-tokens", type=int, default=250, help="user/tool text per turn")
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536,
                        help="each service's KV cache (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="replays of the conversation, each on a fresh cached service; per turn and side "
        "the median TTFT is reported (so one outlier on a busy machine decides nothing)",
    )
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="threads of this process's torch (the GPU part on the CPU); 0: "
                        "torch's default")  # fmt: skip
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rng, warm_rng = random.Random(args.seed), random.Random(args.seed + 1)
    messages = [{"role": "system", "content": text_of(tokenizer, rng, args.system_tokens, "tools")}]
    prompts: list[list[int]] = []  # per turn, made by the first replay
    replies: list[list[int]] = []
    cached_s = [[] for _ in range(args.turns)]
    plain_s = [[] for _ in range(args.turns)]
    hits: list[int] = []
    with expert_worker(args.model, args.format, args.threads) as address:

        def service(caching: bool):
            built = build_gpu_service(GPUServiceConfig(
                model_dir=args.model, device=args.device, dtype=args.dtype,
                prefix_caching=caching, scheduler=SchedulerConfig(max_model_len=8192),
                # NOTE: two services at a time: on a GPU the default sizing gives the first one
                # 90% of the memory and the second one runs out
                kv_cache_tokens=args.kv_cache_tokens,
                experts=ExpertClientConfig((address,))))  # fmt: skip
            first_token_seconds(built, [warm_rng.randrange(3, 4000) for _ in range(64)],
                                2)  # fmt: skip # warm-up, shares no prefix
            return built

        plain = service(False)
        try:
            # NOTE: one fresh cached service per replay, so each meets every turn once, as a
            # harness's server would; two services at a time, as without --repeats
            for replay in range(args.repeats):
                cached = service(True)
                try:
                    for turn in range(args.turns):
                        if replay == 0:
                            content = text_of(tokenizer, rng, args.turn_tokens, "output")
                            role = "user" if turn == 0 else "tool"
                            messages.append({"role": role, "content": content})
                            prompts.append(render(tokenizer, messages))
                        prompt = prompts[turn]
                        seconds, reply, hit = first_token_seconds(cached, prompt,
                                                                  args.reply_tokens)  # fmt: skip
                        cached_s[turn].append(seconds)
                        plain_s[turn].append(first_token_seconds(plain, prompt, 1)[0])
                        if replay == 0:
                            replies.append(reply)
                            hits.append(hit)
                            text = tokenizer.decode(reply, skip_special_tokens=True)
                            messages.append({"role": "assistant", "content": text})
                        elif (reply, hit) != (replies[turn], hits[turn]):
                            print(f"turn {turn + 1}: replay {replay + 1} differs ({hit} cached, "
                                  f"not {hits[turn]})", flush=True)  # fmt: skip
                        print(f"replay {replay + 1} turn {turn + 1}: {len(prompt)} tokens, {hit} "
                              f"cached, TTFT {seconds:.2f} s vs {plain_s[turn][-1]:.2f} s",
                              flush=True)  # fmt: skip
                finally:
                    cached.close()
        finally:
            plain.close()
    rows = [(t + 1, len(prompts[t]), hits[t], cached_s[t], plain_s[t]) for t in range(args.turns)]
    print(f"\nagent conversation replay: {Path(args.model).name}, GPU part on {args.device}, "
          f"{torch_threads()} torch threads, 1 expert worker ({args.format}, {args.threads} "
          f"threads), {args.system_tokens}-token "
          f"system prompt, ~{args.turn_tokens} tokens of tool output and a {args.reply_tokens}-"
          "token reply per turn; TTFT with prefix caching and without, alternated, the median "
          f"of {args.repeats} (min-max beside it)")  # fmt: skip
    columns = [Column("turn", 4), Column("prompt", 6), Column("cached", 6), Column("cached %", 8),
               Column("TTFT cached s", 13), Column("min-max", 11), Column("TTFT uncached s", 15),
               Column("min-max", 13), Column("cached/uncached", 15)]  # fmt: skip
    print_table(columns, [
        [str(t), str(n), str(hit), f"{100 * hit / n:.1f}", f"{median(c):.3f}", spread(c),
         f"{median(p):.3f}", spread(p), f"{100 * median(c) / median(p):.1f}%"]
        for t, n, hit, c, p in rows
    ], rule=False)  # fmt: skip


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


if __name__ == "__main__":
    main()
