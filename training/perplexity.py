"""Perplexity of a causal LM on a text file, with transformers as the reference implementation.

Definition (ktserve's quality benchmark must use the same one): the whole file is one string,
tokenized without special tokens and cut to its first max_tokens tokens; the ids are split into
consecutive non-overlapping windows of seq_len tokens (the last one may be shorter; a window of
one token is dropped). Each window is scored on its own, from an empty cache: tokens 1..n-1 are
predicted from their prefix within the window. Perplexity = exp(mean NLL over all predicted tokens).

Usage: python -m training.perplexity MODEL_DIR TEXT_PATH [--seq-len 512] [--max-tokens 16384]
"""

from __future__ import annotations

import argparse
import gzip
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel


def read_text(path: Path) -> str:
    """A UTF-8 text file, gzip-compressed when its name ends in .gz."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of at most seq_len ids; single-id tails are dropped."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    out = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    return [w for w in out if len(w) >= 2]


def window_nll(logits: torch.Tensor, window: list[int]) -> float:
    """Sum of NLL in nats of window[1:], each predicted from the logits [n, V] of the position
    before it (the window scored on its own)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # [n-1, V]
    target = torch.tensor(window[1:], device=logits.device)
    return -logp.gather(1, target[:, None]).sum().item()


@torch.no_grad()
def nll_sum(model: PreTrainedModel, ids: list[int], seq_len: int) -> tuple[float, int]:
    """(sum of NLL in nats, number of predicted tokens) over the windows of ids."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for window in windows(ids, seq_len):
        logits = model(input_ids=torch.tensor([window], device=device), use_cache=False).logits
        total += window_nll(logits[0], window)  # [n, V]
        count += len(window) - 1
    return total, count


def perplexity_of_ids(model: PreTrainedModel, ids: list[int], seq_len: int) -> float:
    total, count = nll_sum(model, ids, seq_len)
    if count == 0:
        raise ValueError("no token to predict: the text is shorter than two tokens")
    return math.exp(total / count)


def tokenize_file(model_dir: Path | str, text_path: Path | str, max_tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(read_text(Path(text_path)), add_special_tokens=False)["input_ids"]
    return ids[:max_tokens]


def transformers_perplexity(
    model_dir: Path | str,
    text_path: Path | str,
    seq_len: int = 512,
    max_tokens: int = 16384,
    device: str = "cpu",
) -> float:
    """Perplexity of the checkpoint in model_dir on text_path, float32, as the module docstring
    defines it."""
    ids = tokenize_file(model_dir, text_path, max_tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.eval()
    return perplexity_of_ids(model, ids, seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("text_path", type=Path)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    ppl = transformers_perplexity(
        args.model_dir, args.text_path, args.seq_len, args.max_tokens, args.device
    )
    print(f"{ppl:.4f}")


if __name__ == "__main__":
    main()
