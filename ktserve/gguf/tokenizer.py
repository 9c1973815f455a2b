"""The tokenizer and chat template a GGUF checkpoint carries (tokenizer.ggml.*,
tokenizer.chat_template), as a Hugging Face fast tokenizer: transformers builds it from the
metadata (its GGUF tokenizer support: byte-level BPE `gpt2`, sentencepiece `llama`, ...).

Where transformers does not know a file's pre-tokenizer (tokenizer.ggml.pre), the text would be
split the GPT-2 way; the splits of the ones ktserve's families use are added here, as llama.cpp's
llama-vocab.cpp spells them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ktserve.gguf.container import open_checkpoint

# tokenizer.ggml.pre -> the regular expressions llama.cpp splits with, in order (each isolated)
EXTRA_PRE_TOKENIZER_SPLITS = {
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
# metadata keys whose token ids end a turn, beside tokenizer.ggml.eos_token_id
END_OF_TURN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.eom_token_id")  # fmt: skip


class GGUFTokenizerError(ValueError):
    """The GGUF file's tokenizer metadata cannot be turned into a tokenizer."""


def load_gguf_tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer (with the chat template, when the file has one) from the
    metadata of the GGUF checkpoint `path` names."""
    from transformers import PreTrainedTokenizerFast

    checkpoint = open_checkpoint(path)
    if not checkpoint.has("tokenizer.ggml.model"):
        raise GGUFTokenizerError(
            f"{checkpoint.path} carries no tokenizer (no tokenizer.ggml.model); give a Hugging "
            "Face tokenizer directory with --tokenizer DIR"
        )
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(checkpoint.path.parent), gguf_file=checkpoint.path.name
        )
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise GGUFTokenizerError(
            f"cannot build a tokenizer from {checkpoint.path}'s metadata "
            f"(tokenizer.ggml.model {checkpoint.value('tokenizer.ggml.model')!r}: "
            f"{type(exc).__name__}: {exc}); give a Hugging Face tokenizer directory with "
            "--tokenizer DIR"
        ) from exc
    splits = EXTRA_PRE_TOKENIZER_SPLITS.get(checkpoint.value("tokenizer.ggml.pre"))
    if splits is not None:
        _set_splits(tokenizer, splits)
    template = checkpoint.value("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    return tokenizer


def gguf_eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """The token ids that end generation: EOS, end of turn, end of message."""
    checkpoint = open_checkpoint(path)
    ids = [checkpoint.value(key) for key in END_OF_TURN_KEYS]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))


def _set_splits(tokenizer: Any, splits: tuple[str, ...]) -> None:
    from tokenizers import Regex, pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
