"""Engines on tiny checkpoints for the engine's tests: made, fed prompts together, and their
greedy tokens against transformers'."""

from __future__ import annotations

import threading

import torch

from gpu_service.engine import Engine, SchedulerConfig
from gpu_service.engine.decode_graphs import DecodeGraphConfig
from gpu_service.models import TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader


def make_engine(checkpoint, cache_tokens=4096, graphs: DecodeGraphConfig | None = None,
                device: torch.device | str = "cpu", **scheduler) -> Engine:  # fmt: skip
    experts = TorchExperts(CheckpointReader(checkpoint), device, torch.float32)
    model = load_model(checkpoint, device, torch.float32, experts=experts,
                       max_num_tokens_in_cache=cache_tokens, block_size=4)  # fmt: skip
    config = SchedulerConfig(**{"max_model_len": 128, **scheduler})
    return Engine(model, config, graph_config=graphs).start()


def prompts(seed: int, lengths=(5, 11, 2)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, one full forward per token (EOS not special).

    NOTE: not generate(): it suppresses EOS under min_new_tokens, and its cached decode and its
    full forward can pick different tokens where two logits are nearly tied after a routing
    flip (seen: 0.429 vs 0.420); the full forward is the oracle.
    """
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def tokens_of(events) -> list[int]:
    return [t.token_id for e in events for t in e.tokens]


def run_together(engine: Engine, requests) -> list[list]:
    """Submit all requests at once (they batch), wait for every final event."""
    done = threading.Semaphore(0)
    results: list[list] = [[] for _ in requests]

    def collector(i):
        def on_event(event):
            results[i].append(event)
            if event.finish_reason is not None:
                done.release()

        return on_event

    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, collector(i))
    for _ in requests:
        assert done.acquire(timeout=300)
    return results


def _count_and_sum(histogram, **labels) -> tuple[float, float]:
    samples = {s.name: s.value for m in histogram.labels(**labels).collect() for s in m.samples}
    return samples[f"{histogram._name}_count"], samples[f"{histogram._name}_sum"]
