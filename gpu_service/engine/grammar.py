"""Constrained decoding with llguidance: grammars compiled once, a matcher per request, and a
token mask applied to the logits on the model's device.

    API (event loop)     text = a Lark grammar (tool calls; JSON schemas inline as %json)
    executor thread      grammar = compiler.compile_lark(text) # cached by text; slow for big
                                                               # schemas, never on the engine thread
    Request              matcher = grammar.matcher()            # its own parser state
    Runner, each step    masker.fill(matchers)   (while the forward runs)
                         masker.apply(logits[rows], masks)     # bitmask [B, V/32] int32 filled
                                                               # on the CPU (in parallel), copied
                                                               # once, -inf where a bit is 0
    Engine, each token   matcher.accept(token); matcher.done ends the request (stop)

A matcher accepts the EOS ids only where the grammar is complete, so generation ends inside
the grammar: by EOS, or once nothing more can follow.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

BITS = 32
MASK_THREADS = 4  # threads that fill a step's masks (one row each at a time)
# NOTE: canonical json.dumps spacing, no free whitespace: what templates render (tojson) and
# models learnt, and a weak model cannot run away with blank space.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (or JSON schema) that cannot be compiled."""


class Grammar:
    """A compiled grammar; immutable, shared by every request that uses it."""

    def __init__(self, text: str, matcher: Any) -> None:
        self.text = text
        self._matcher = matcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy())


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.llm = matcher
        self.failed = False

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        if not self.llm.consume_token(token_id):
            self.failed = True
        return not self.failed

    @property
    def done(self) -> bool:
        """Nothing but EOS can follow (or the matcher failed)."""
        return self.failed or self.llm.is_stopped()


class GrammarCompiler:
    """Compiles grammars for one tokenizer (the checkpoint's, with the model's vocabulary
    size). Thread-safe; keeps the last `cache_size` grammars."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 64) -> None:  # fmt: skip
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def prepare(self) -> None:
        """Build the tokenizer's tables now (a second or so for a large vocabulary), before the
        engine decodes with the same tokenizer (not safe to share between threads)."""
        with self._lock:
            self._llg_tokenizer()

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer

    def compile_lark(self, lark: str) -> Grammar:
        import llguidance

        return self._compile(llguidance.LLMatcher.grammar_from_lark(lark))

    def _compile(self, text: str) -> Grammar:
        import llguidance

        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return self._cache[text]
            tokenizer = self._llg_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        grammar = Grammar(text, matcher)
        with self._lock:
            self._cache[text] = grammar
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar


class TokenMasker:
    """Masks logits [B, V] in place: rows with a matcher keep only the tokens it allows.

    `fill` computes the masks on a thread of its own (the runner starts it before the forward,
    which does not change the matchers, so both overlap); `apply` waits for them and masks."""

    def __init__(self) -> None:
        self._executor = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def fill(self, matchers: Sequence[GrammarMatcher | None], vocab: int,
             pinned: bool) -> Future:  # fmt: skip
        """The bitmask [B, ceil(V/32)] int32 of these rows (-1 where a row has no matcher)."""
        return self._thread.submit(self._fill, list(matchers), vocab, pinned)

    def _fill(self, matchers: list[GrammarMatcher | None], vocab: int, pinned: bool):
        import llguidance
        import llguidance.torch

        if self._executor is None:
            # NOTE: a few threads: the cores belong to the expert workers' kernels
            self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        words = -(-vocab // BITS)
        mask = torch.full((len(matchers), words), -1, dtype=torch.int32, pin_memory=pinned)
        rows = [(m.llm, i) for i, m in enumerate(matchers) if m is not None and not m.failed]
        if rows:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask  # [B, W]

    def apply(self, logits: torch.Tensor, mask: Future) -> None:
        batch, vocab = logits.shape
        device = logits.device
        if device not in self._shifts:
            self._shifts[device] = torch.arange(BITS, dtype=torch.int32, device=device)
        words = mask.result()
        words = words.to(device, non_blocking=True)
        allowed = (words[:, :, None] >> self._shifts[device]) & 1  # [B, W, 32]
        allowed = allowed.reshape(batch, -1)[:, :vocab]  # [B, V]
        logits.masked_fill_(allowed == 0, float("-inf"))

    def __call__(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
        self.apply(logits, self.fill(matchers, logits.shape[1], logits.is_cuda))
