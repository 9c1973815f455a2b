"""Train the demo model's byte-level BPE tokenizer and save it as a transformers tokenizer.

Writes tokenizer.json, tokenizer_config.json (with a ChatML chat_template that renders tools
in the Hermes format, and eos_token) and
chat_template.jinja to --out-dir, so AutoTokenizer.from_pretrained(out_dir) and
apply_chat_template work without any code from this project.

Usage: python -m training.train_tokenizer [--data-dir training/data] [--out-dir demo_model]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from training.prepare_corpus import DEFAULT_OUT_DIR, read_texts

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
# ChatML, with tools and tool calls written as Hermes / Qwen do (<tool_call>{json}</tool_call>),
# so that a server on the demo model shows tool calling.
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()


def _batches(texts: list[str], size: int = 256) -> Iterator[list[str]]:
    for i in range(0, len(texts), size):
        yield texts[i : i + size]


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, no prefix space), SPECIAL_TOKENS first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batches(texts), trainer=trainer, length=len(texts))
    return tok


def as_transformers(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save(fast: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """save_pretrained, plus the chat template inside tokenizer_config.json for older readers."""
    fast.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    # NOTE: the class name every transformers version (4.x and 5.x) resolves to its fast tokenizer.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_OUT_DIR)
    ap.add_argument("--out-dir", type=Path, default=Path("demo_model"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--model-max-length", type=int, default=2048)
    args = ap.parse_args()
    texts = read_texts(args.data_dir / "train.txt.gz") + read_texts(args.data_dir / "chat.txt.gz")
    tok = train_bpe(texts, args.vocab_size)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save(as_transformers(tok, args.model_max_length), args.out_dir)
    print(f"vocab {tok.get_vocab_size()} -> {args.out_dir}")


if __name__ == "__main__":
    main()
