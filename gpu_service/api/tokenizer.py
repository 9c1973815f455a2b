"""The checkpoint's tokenizer as the API uses it: encode, decode, chat template, EOS ids.

NOTE: two copies of the tokenizer, each behind its own lock: Hugging Face fast tokenizers are not
safe to use from two threads at once, and prompts (encode, render_chat: the API's tokenizing
thread) must never make the engine thread wait in decode (a long prompt froze every stream).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu_service.engine.errors import PromptTooLong


class TokenizerError(ValueError):
    """The checkpoint's tokenizer cannot be loaded or cannot do what was asked."""


class ServedTokenizer:
    """tokenizer: decodes (the engine's detokenizer, logprobs); encoder: a copy of it for prompts
    (default: a deep copy)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], encoder: Any = None) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder if encoder is not None else copy.deepcopy(tokenizer)
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._encode_lock = threading.Lock()
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        # NOTE: a byte-level token's name has one character per byte, so no token's text is
        # longer: a text longer than n * max_token_chars has more than n tokens.
        self.max_token_chars = max(map(len, vocab), default=1) or 1
        self._special: set[int] = set()
        self._kept: set[int] = set()

    def check_length(self, num_chars: int, max_tokens: int, param: str = "prompt") -> None:
        """Raise PromptTooLong when a text of num_chars characters surely has max_tokens tokens
        or more (a bound that costs nothing: no tokenizing)."""
        if num_chars >= max_tokens * self.max_token_chars:
            raise PromptTooLong(
                f"this model's maximum context length is {max_tokens} tokens; the {param} has "
                f"{num_chars} characters, so at least {-(-num_chars // self.max_token_chars)} "
                f"tokens (no token of this tokenizer has more than {self.max_token_chars})"
            )

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def thinking_switch(self) -> str | None:
        """The template variable that turns thinking on or off (Qwen3's enable_thinking,
        DeepSeek-V3.1's thinking), if the chat template reads one."""
        template = self.tokenizer.chat_template
        template = template if isinstance(template, str) else str(template or "")
        if re.search(r"\benable_thinking\b", template):
            return "enable_thinking"
        if re.search(r"\bthinking\s+is\s+defined\b|\bif\s+thinking\b", template):
            return "thinking"
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._encode_lock:
            return list(self.encoder(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text shown to users: special tokens left out, except those kept (keep_tokens)."""
        with self._lock:
            if self._kept:
                ids = [i for i in ids if i in self._kept or i not in self._special]
                return self.tokenizer.decode(list(ids), skip_special_tokens=False)
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_all(self, ids: Sequence[int]) -> str:
        """The text of these ids, special tokens included (what /detokenize returns)."""
        with self._lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def keep_tokens(self, texts: Sequence[str]) -> None:
        """Decode these special tokens as their text (the markers tool and reasoning parsers
        read, special in some checkpoints' tokenizers); call before decoding starts."""
        with self._lock:
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            self._special = {i for i, t in added.items() if getattr(t, "special", False)}
            self._special |= set(getattr(self.tokenizer, "all_special_ids", ()))
            vocab = self.tokenizer.get_vocab()
            self._kept = {vocab[t] for t in texts if t in vocab and vocab[t] in self._special}

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens included), as logprobs report them."""
        with self._lock:
            return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def render_chat(self, messages: Callable[[bool], list[dict]], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None,
                    max_tokens: int | None = None) -> tuple[list[int], str]:  # fmt: skip
        """Prompt ids and text of a conversation through the checkpoint's chat template, ending
        with the assistant's turn opened (add_generation_prompt). messages(arguments_as_text):
        the conversation, tool-call arguments as objects (Hugging Face's convention, tried
        first) or as JSON text (for templates that concatenate them). max_tokens:
        PromptTooLong, before tokenizing, for a rendered text that surely has that many tokens
        (check_length)."""
        if not self.has_chat_template:
            raise TokenizerError(
                "this model's tokenizer has no chat template; use /v1/completions with a prompt"
            )
        with self._encode_lock:
            text = None
            for as_text in (False, True):
                try:
                    text = self.encoder.apply_chat_template(
                        messages(as_text), tools=tools, add_generation_prompt=True,
                        tokenize=False, **(template_kwargs or {}),
                    )  # fmt: skip
                    break
                except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
                    error = exc
            if text is None:
                raise TokenizerError(f"the chat template failed on these messages: {error}")
            if max_tokens is not None:
                self.check_length(len(text), max_tokens, param="conversation")
            # NOTE: the template writes any BOS itself; adding special tokens would double it.
            return list(self.encoder(text, add_special_tokens=False).input_ids), text


def load_tokenizer(
    model_dir: str | Path, tokenizer_dir: str | Path | None = None
) -> ServedTokenizer:
    """The checkpoint's tokenizer: a Hugging Face directory's files, or a GGUF checkpoint's
    metadata; tokenizer_dir (--tokenizer): that Hugging Face directory's instead."""
    from ktserve.gguf.files import is_gguf_path

    if tokenizer_dir is not None:
        served = load_tokenizer(tokenizer_dir)
        if is_gguf_path(model_dir):  # NOTE: the model's own end-of-turn ids count too
            served.eos_token_ids = tuple(dict.fromkeys(served.eos_token_ids
                                                       + _gguf_eos_ids(model_dir)))  # fmt: skip
        return served
    if is_gguf_path(model_dir):
        return _load_gguf_tokenizer(model_dir)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise TokenizerError(
            f"cannot load a tokenizer from {model_dir} ({type(exc).__name__}: {exc}); the "
            "directory needs the checkpoint's tokenizer files (tokenizer.json, "
            "tokenizer_config.json)"
        ) from exc
    return ServedTokenizer(tokenizer, eos_token_ids(model_dir, tokenizer))


def _load_gguf_tokenizer(path: str | Path) -> ServedTokenizer:
    from ktserve.gguf.tokenizer import GGUFTokenizerError, load_gguf_tokenizer

    try:
        tokenizer = load_gguf_tokenizer(path)
    except GGUFTokenizerError as exc:
        raise TokenizerError(str(exc)) from exc
    ids = [*_gguf_eos_ids(path), *_as_ids(getattr(tokenizer, "eos_token_id", None))]
    return ServedTokenizer(tokenizer, tuple(dict.fromkeys(ids)))


def _gguf_eos_ids(path: str | Path) -> tuple[int, ...]:
    from ktserve.gguf.tokenizer import gguf_eos_token_ids

    return gguf_eos_token_ids(path)


def eos_token_ids(model_dir: str | Path, tokenizer: Any = None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer, in that order."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            ids += _as_ids(json.loads(path.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        ids += _as_ids(getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
