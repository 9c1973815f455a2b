"""Logprobs in the two OpenAI formats, from the engine's SampledTokens.

chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
              "bytes"}]}]}
completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
              "text_offset": [...]}   (offsets into the completion text)
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_service.api.tokenizer import ServedTokenizer
from gpu_service.engine import SampledToken


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: ServedTokenizer, tokens: Sequence[SampledToken]) -> dict:
    ids = [t.token_id for t in tokens]
    alt_ids = [i for t in tokens for i, _ in t.top_logprobs]
    texts = tokenizer.token_texts(ids + alt_ids)
    alt_texts = iter(texts[len(ids) :])
    content = []
    for token, text in zip(tokens, texts):
        entry = _entry(text, token.logprob)
        entry["top_logprobs"] = [_entry(next(alt_texts), lp) for _, lp in token.top_logprobs]
        content.append(entry)
    return {"content": content}


class CompletionLogprobs:
    """Builds the completions format chunk by chunk; text_offset runs over the whole answer."""

    def __init__(self, tokenizer: ServedTokenizer) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def __call__(self, tokens: Sequence[SampledToken]) -> dict:
        ids = [t.token_id for t in tokens]
        alt_ids = [i for t in tokens for i, _ in t.top_logprobs]
        texts = self.tokenizer.token_texts(ids + alt_ids)
        alt_texts = iter(texts[len(ids) :])
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, text in zip(tokens, texts):
            out["tokens"].append(text)
            out["token_logprobs"].append(token.logprob)
            out["top_logprobs"].append({next(alt_texts): lp for _, lp in token.top_logprobs})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
