"""Sample completions from a checkpoint with transformers on CPU (the README's samples).

Usage: python -m training.samples [MODEL_DIR] [--seed 1234] [--max-new-tokens 60]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# (prompt, is_chat, sampled)
PROMPTS = (
    ("The Python interpreter", False, False),
    ("The json module", False, True),
    ("Tell me about the json module.", True, False),
    ("What is a list comprehension?", True, True),
)


def complete(
    model_dir: Path, prompt: str, chat: bool, sampled: bool, seed: int, max_new: int
) -> str:
    """One completion: greedy, or top-p 0.9 / temperature 0.8 sampling from torch seed `seed`."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if chat:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    torch.manual_seed(seed)
    kwargs = dict(do_sample=True, top_p=0.9, temperature=0.8) if sampled else dict(do_sample=False)
    out = model.generate(ids, max_new_tokens=max_new, pad_token_id=tokenizer.eos_token_id, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path, nargs="?", default=Path("demo_model"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-new-tokens", type=int, default=60)
    args = ap.parse_args()
    for prompt, chat, sampled in PROMPTS:
        text = complete(args.model_dir, prompt, chat, sampled, args.seed, args.max_new_tokens)
        mode = ("chat, " if chat else "") + ("sampled" if sampled else "greedy")
        print(f"--- {mode}: {prompt!r}\n{text}\n")


if __name__ == "__main__":
    main()
