"""The tokenizer a GGUF file carries (tokenizer.ggml.*, written as llama.cpp's converter writes a
byte-level BPE vocabulary) gives the ids the checkpoint's Hugging Face tokenizer gives, on text
with code, unicode and special tokens; its chat template and end-of-turn ids come along, and
--tokenizer DIR replaces it."""

from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

from gpu_service.api.tokenizer import TokenizerError, load_tokenizer
from ktserve.gguf.tokenizer import EXTRA_PRE_TOKENIZER_SPLITS
from tests.support.api_server import CHAT_TEMPLATE, EOS, IM_END, IM_START, SENTENCES
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.gguf_checkpoints import write_gguf

THINK = "<think>"  # an added token that is not special (USER_DEFINED in the GGUF)
CORPUS = [
    *SENTENCES,
    "def route(x: Tensor) -> Tensor:\n    return torch.topk(x @ w.T, k=8).indices  # [T, k]\n",
    'for (int i = 0; i < n; ++i) { y[i] += a * x[i]; }  /* axpy */ printf("%d\\n", 42);',
    "Grüße aus Köln — naïve café, 東京と大阪, 한국어, עברית, 😀🚀 emoji!",
    "numbers 1234567 3.14159 -0.5e-10 and   multiple   spaces\t\ttabs\r\nCRLF",
    f"{IM_START}user\nHello there{IM_END}\n{IM_START}assistant\n{THINK}hmm</think>Hi!{EOS}",
    "",
    " leading space, trailing space ",
]
SPLITS = {
    "default": pre_tokenizers.ByteLevel(add_prefix_space=False),
    "qwen2": pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]),
    "deepseek-v3": pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated")
          for r in EXTRA_PRE_TOKENIZER_SPLITS["deepseek-v3"]),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]),
}  # fmt: skip


def byte_level_bpe(pre: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the corpus the way `pre` splits text, with special tokens, a
    non-special added token and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = SPLITS[pre]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.add_tokens([THINK])
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.mark.parametrize("pre", list(SPLITS))
def test_gguf_tokenizer_gives_the_checkpoint_tokenizers_ids(pre, tmp_path, seed):
    hf = byte_level_bpe(pre)
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed, mlp_only_layers=[],
                                      vocab_size=len(hf))  # fmt: skip
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf", tokenizer=hf, tokenizer_pre=pre)
    served = load_tokenizer(first)
    for text in CORPUS:
        want = hf(text, add_special_tokens=False).input_ids
        assert served.encode(text, add_special_tokens=False) == want, text
        assert served.decode_all(want) == hf.decode(want, skip_special_tokens=False)
    assert served.eos_token_ids == (hf.eos_token_id,)
    messages = [{"role": "user", "content": "Hi there"}]
    ids, text = served.render_chat(lambda as_text: messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == hf(text, add_special_tokens=False).input_ids


def test_tokenizer_flag_replaces_the_gguf_tokenizer(tmp_path, seed):
    hf = byte_level_bpe("default")
    other = byte_level_bpe("qwen2")
    other.save_pretrained(tmp_path / "other")
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed, mlp_only_layers=[],
                                      vocab_size=len(hf))  # fmt: skip
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf", tokenizer=hf)
    served = load_tokenizer(first, tmp_path / "other")
    text = CORPUS[6]
    assert served.encode(text) == other(text).input_ids != hf(text).input_ids


def test_a_gguf_without_a_tokenizer_names_the_flag(tmp_path, seed):
    checkpoint = make_tiny_checkpoint("mixtral", tmp_path / "ckpt", seed=seed)
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf")
    with pytest.raises(TokenizerError, match="no tokenizer.ggml.model.*--tokenizer DIR"):
        load_tokenizer(first)
