"""`ktserve serve FILE.gguf` as a user runs it: a real server subprocess with its own expert
worker, the tokenizer and chat template from the file's metadata; it answers as serving the
Hugging Face directory the file was converted from does. A file it cannot serve is refused
before any worker starts."""

from __future__ import annotations

from transformers import AutoTokenizer

from tests.support.api_server import (
    EXACT_ENV,
    HELLO,
    NO_EOS,
    TINY_FLAGS,
    make_served_checkpoint,
    running_server,
)
from tests.support.expert_procs import no_segments_left_behind  # noqa: F401 - autouse
from tests.support.gguf_checkpoints import write_gguf
from tests.support.ktserve_command import ktserve


def test_serving_a_gguf_answers_as_its_checkpoint_does(tmp_path, seed):
    checkpoint = make_served_checkpoint(tmp_path / "tiny", seed)
    (tmp_path / "gguf").mkdir()
    first, _ = write_gguf(checkpoint, tmp_path / "gguf" / "tiny.gguf",
                          tokenizer=AutoTokenizer.from_pretrained(checkpoint))  # fmt: skip
    answers = []
    for model in (checkpoint, first):
        with running_server(model, *TINY_FLAGS, env=EXACT_ENV) as server:
            status, body = server.post("/v1/chat/completions", {
                "model": "tiny", "messages": HELLO, "max_tokens": 12, "temperature": 0, **NO_EOS,
            })  # fmt: skip
            assert status == 200, body
            answers.append((body["usage"], body["choices"][0]["message"]["content"]))
    print(f"served from the directory and the GGUF: {answers}")
    assert answers[0] == answers[1]


def test_a_gguf_it_cannot_serve_is_refused_before_any_worker_starts(tmp_path, seed):
    checkpoint = make_served_checkpoint(tmp_path / "tiny", seed)
    (tmp_path / "gguf").mkdir()
    first, _ = write_gguf(checkpoint, tmp_path / "gguf" / "tiny.gguf")
    data = first.read_bytes()
    first.write_bytes(data[: len(data) // 2])
    result = ktserve("serve", str(first), "--port", "0", "--device", "cpu")
    print(result.stderr)
    assert result.returncode == 2
    assert f"ktserve serve: error: {first} is not a usable GGUF file: truncated" in result.stderr
    assert "starting" not in result.stdout + result.stderr
