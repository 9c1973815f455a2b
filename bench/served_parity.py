"""Served parity: `ktserve serve` (both processes, over HTTP) against transformers, for every
device hand-off, with and without expert deferral, decode graphs on (the defaults). The first
run of every GPU-host session (issue 43: the default hand-off once changed the logits there).

`make` (here, with the pinned transformers): a tiny checkpoint of each family with a tokenizer,
prompts, and transformers' float32 greedy continuation of each (full forward each step): every
position's token, its logprob and the margin to the runner-up. The host's transformers is not
the pinned one, so the references travel (carry DIR).
`check` (there): one server per family and mode on the exact path (`--format bf16 --dtype
float32`, KTSERVE_WIRE_DTYPE=float32, one expert worker), each mode its experiment switches
(ktserve/envs.py) in the server's environment, greedy completions with logprobs:
  no deferral    the first token's logprob within 1e-3 of transformers', and the tokens equal
                 (each logprob within 1e-3) up to the first near-tie (a runner-up within 1e-3)
  deferral       (it changes the numbers by design) every token and logprob equal to the same
                 deferral with the expert calls made by the host between graph segments
Prints one table; exits 1 where a row fails.

    python bench/served_parity.py make DIR
    python bench/served_parity.py check DIR [--device cuda]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral")
NUM_TOKENS = 24
TOLERANCE = 1e-3  # logprob, and the runner-up margin under which a position is a near-tie
PROMPTS = ("The quick brown fox", "Mixture of experts models route", "Hello world! How")
EXACT = ("--expert-workers", "1", "--threads", "4", "--dtype", "float32", "--format", "bf16",
         "--max-model-len", "128", "--kv-cache-tokens", "2048",
         "--served-model-name", "tiny")  # fmt: skip
EXACT_ENV = {"KTSERVE_WIRE_DTYPE": "float32"}
# (label, environment, reference): "transformers", or the label of the row a deferral row must
# equal
MODES = (
    ("kernels", {"KTSERVE_DEVICE_HANDOFF": "kernels"}, "transformers"),
    ("memops", {"KTSERVE_DEVICE_HANDOFF": "memops"}, "transformers"),
    ("host calls", {"KTSERVE_GRAPH_EXPERT_CALLS": "0"}, "transformers"),
    ("host calls, defer 1",
     {"KTSERVE_GRAPH_EXPERT_CALLS": "0", "KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN": "1"}, None),
    ("kernels, defer 1",
     {"KTSERVE_DEVICE_HANDOFF": "kernels", "KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN": "1"},
     "host calls, defer 1"),
    ("memops, defer 1",
     {"KTSERVE_DEVICE_HANDOFF": "memops", "KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN": "1"},
     "host calls, defer 1"),
)  # fmt: skip


def make(out: Path, seed: int) -> None:
    from tests.support.api_server import make_tokenizer
    from tests.support.checkpoints import (
        available_families,
        load_reference_model,
        make_tiny_checkpoint,
    )

    tokenizer = make_tokenizer()
    for family in (f for f in FAMILIES if f in available_families()):
        path = out / family
        make_tiny_checkpoint(family, path, seed=seed, vocab_size=len(tokenizer),
                             eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        tokenizer.save_pretrained(path)
        model = load_reference_model(path)
        refs = []
        with torch.no_grad():
            for text in PROMPTS:
                ids = tokenizer(text)["input_ids"]
                prompt, tokens, logprobs, margins = list(ids), [], [], []
                for _ in range(NUM_TOKENS):
                    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
                    top = torch.topk(lp, 2)
                    tokens.append(int(top.indices[0]))
                    logprobs.append(float(top.values[0]))
                    margins.append(float(top.values[0] - top.values[1]))
                    ids.append(tokens[-1])
                refs.append({"prompt": prompt, "tokens": tokens, "logprobs": logprobs,
                             "margins": margins})  # fmt: skip
        torch.save(refs, path / "served_reference.pt")
        print(f"{family}: {len(refs)} prompts, {NUM_TOKENS} tokens each, in {path}")


def complete(server, prompt: list[int]) -> tuple[list[str], list[float]]:
    status, body = server.post("/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0,
        "logprobs": 1, "ignore_eos": True})  # fmt: skip
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body}")
    lp = body["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def compare_to_transformers(tokenizer, refs, served) -> tuple[float, str, bool]:
    """(worst first-token logprob error, tokens matched / compared, ok)."""
    first_err, matched, compared, ok = 0.0, 0, 0, True
    for ref, (pieces, logprobs) in zip(refs, served):
        first_err = max(first_err, abs(logprobs[0] - ref["logprobs"][0]))
        for i, token in enumerate(ref["tokens"]):
            compared += 1
            same = pieces[i] == tokenizer.decode([token])
            same = same and abs(logprobs[i] - ref["logprobs"][i]) <= TOLERANCE
            if not same:
                ok = False
                break
            matched += 1
            if ref["margins"][i] < TOLERANCE:  # a near-tie: what follows may differ
                break
    ok = ok and first_err <= TOLERANCE
    return first_err, f"{matched}/{compared}", ok


def check_family(path: Path, device: str) -> list[tuple]:
    """One family's rows, a server per mode in MODES' order (a deferral row's reference runs
    before it); each row is also printed as it completes (stderr), so a run cut short says how
    far it got."""
    from transformers import AutoTokenizer

    from tests.support.api_server import ServerProcess

    refs = torch.load(path / "served_reference.pt")
    tokenizer = AutoTokenizer.from_pretrained(path)
    outputs: dict[str, list] = {}
    rows = []
    for label, env, reference in MODES:
        server = ServerProcess(path, *EXACT, "--device", device, env={**EXACT_ENV, **env})
        try:
            served = [complete(server, ref["prompt"]) for ref in refs]
        finally:
            server.close()
        outputs[label] = served
        if reference == "transformers":
            err, matched, ok = compare_to_transformers(tokenizer, refs, served)
            shown = (f"{err:.1e}", matched, "transformers")
        elif reference is None:
            err, _, _ = compare_to_transformers(tokenizer, refs, served)
            ok, shown = True, (f"{err:.1e}", "-", "(deferral's reference)")
        else:
            want = outputs[reference]
            same = sum(g == w for g, w in zip(served, want))
            worst = max(abs(a - b) for (_, g), (_, w) in zip(served, want)
                        for a, b in zip(g, w))  # fmt: skip
            ok = same == len(refs) and worst == 0.0
            shown = ("-", f"{same}/{len(refs)} equal", reference)
        rows.append((path.name, label, *shown, "ok" if ok else "FAIL"))
        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    return rows


def check(ref_dir: Path, device: str) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import transformers

    from bench.common import Column, print_table

    transformers.AutoTokenizer  # resolved here: transformers' lazy imports race across threads

    paths = sorted(p for p in ref_dir.iterdir() if (p / "served_reference.pt").exists())
    with ThreadPoolExecutor(max(1, len(paths))) as pool:  # one family per thread, side by side
        rows = [row for family in pool.map(check_family, paths, [device] * len(paths))
                for row in family]  # fmt: skip
    print(f"served parity on {device} (bf16 experts, float32 wire and GPU part; "
          f"{NUM_TOKENS} greedy tokens of {len(PROMPTS)} prompts)")  # fmt: skip
    columns = [Column("family", 12, "<"), Column("mode", 20, "<"),
               Column("first logprob err", 17), Column("tokens same", 12),
               Column("against", 22, "<"), Column("", 4, "<")]  # fmt: skip
    print_table(columns, rows, rule=False)
    failed = any(row[-1] != "ok" for row in rows)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    from bench.common import run_make_or_check

    sys.exit(run_make_or_check(__doc__, make, check))
