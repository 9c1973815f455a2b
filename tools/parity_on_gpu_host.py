"""Parity of the two-process path on a machine whose transformers differs from the pinned one.

`make` (here, with the pinned transformers): tiny checkpoints per family, prompts, transformers'
fp32 last-position logits and its 32-token greedy continuation (full forward each step), saved.
`check` (on the GPU host, no transformers needed): the GPU service on --device (cuda) + a
`ktserve expert` subprocess (bf16 experts, fp32 on the wire and in the GPU part) must give those
logits (max relative error) and the same tokens. Prints one table.

    python tools/parity_on_gpu_host.py make DIR      # here
    python tools/parity_on_gpu_host.py check DIR     # there
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral")
NUM_TOKENS = 32


def make(out: Path, seed: int) -> None:
    from tests.support.checkpoints import load_reference_model, make_tiny_checkpoint

    g = torch.Generator().manual_seed(seed)
    for family in FAMILIES:
        path = make_tiny_checkpoint(family, out / family, seed=seed)
        model = load_reference_model(path)
        prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (6, 13, 3)]
        logits, greedy = [], []
        with torch.no_grad():
            for prompt in prompts:
                logits.append(model(torch.tensor([prompt])).logits[0, -1])
                ids = list(prompt)
                for _ in range(NUM_TOKENS):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                greedy.append(ids[len(prompt) :])
        torch.save({"prompts": prompts, "logits": torch.stack(logits), "greedy": greedy},
                   out / family / "reference.pt")  # fmt: skip
    print(f"references for {', '.join(FAMILIES)} in {out}")


def logits_error(model, ref: dict) -> float:
    """Max relative error of the last-position logits of the reference's prompts, one batch."""
    from gpu_service.kvcache.manager import KVCacheManager
    from gpu_service.models import Batch, SeqInput

    kv = KVCacheManager(model.kv_cache.config)
    caches = [kv.allocate(len(p)) for p in ref["prompts"]]
    batch = Batch(tuple(SeqInput(p, c, 0) for p, c in zip(ref["prompts"], caches)))
    got = model.forward(batch).cpu()
    for c in caches:
        kv.free(c)
    return float(((got - ref["logits"]).abs().amax(1) / ref["logits"].abs().amax(1)).max())


def greedy(service, prompts: list[list[int]]) -> list[list[int]]:
    """NUM_TOKENS greedy tokens of every prompt, the prompts served together."""
    from gpu_service.engine import SamplingParams

    outputs = [[] for _ in prompts]
    done = threading.Semaphore(0)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):

        def on_event(e, i=i):
            outputs[i].extend(t.token_id for t in e.tokens)
            if e.finish_reason is not None:
                done.release()

        service.engine.add_request(prompt, params, on_event)
    for _ in prompts:
        done.acquire(timeout=300)
    return outputs


def check(ref_dir: Path, device: str) -> int:
    from bench.common import Column, print_table
    from bench.worker_process import expert_worker
    from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig
    from gpu_service.service import build_gpu_service

    rows, failed = [], False
    for family in FAMILIES:
        path = ref_dir / family
        ref = torch.load(path / "reference.pt")
        with expert_worker(path, "bf16", 4) as address:
            service = build_gpu_service(GPUServiceConfig(
                model_dir=str(path), device=device, dtype="float32", kv_cache_tokens=1024,
                scheduler=SchedulerConfig(max_model_len=128),
                experts=ExpertClientConfig((address,), wire_dtype="float32")))  # fmt: skip
            try:
                err = logits_error(service.engine.model, ref)
                outputs = greedy(service, ref["prompts"])
                pinned = bool(service.experts._registered)
                graphed = int(service.metrics.steps.labels(mode="graph")._value.get())
            finally:
                service.close()
        same = sum(o == g for o, g in zip(outputs, ref["greedy"]))
        ok = err < 1e-3 and same == len(ref["prompts"])
        failed |= not ok
        verdict = "ok" if ok else "FAIL"
        rows.append((family, f"{err:.2e}", f"{same}/{len(ref['prompts'])}", str(pinned),
                     str(graphed), verdict))  # fmt: skip
    print(f"two-process parity on {device} (bf16 experts, fp32 wire and GPU part)")
    columns = [Column("family", 12, "<"), Column("logits rel err", 14),
               Column("greedy 32 same", 14), Column("pinned shm", 10), Column("graph steps", 11),
               Column("", 4, "<")]  # fmt: skip
    print_table(columns, rows, rule=False)
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.common import run_make_or_check

    sys.exit(run_make_or_check(__doc__, make, check))
