"""`ktserve serve` as a real subprocess on a tiny checkpoint with a tokenizer, for API tests."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ktserve import envs
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.expert_procs import shm_entries
from tests.support.watched_process import WatchedProcess

# one expert worker with one thread, everything on the CPU in float32
CPU_FLAGS = ("--expert-workers", "1", "--threads", "1", "--device", "cpu", "--dtype", "float32")
# ... and exact: bf16 experts (the tiny checkpoints' own weights) and, an experiment switch,
# float32 on the wire (pass EXACT_ENV with EXACT_FLAGS or TINY_FLAGS)
EXACT_FLAGS = (*CPU_FLAGS, "--format", "bf16")
EXACT_ENV = {envs.WIRE_DTYPE.name: "float32"}
TINY_MODEL_LEN = 256
TINY_FLAGS = (*EXACT_FLAGS, "--max-model-len", str(TINY_MODEL_LEN), "--kv-cache-tokens", "4096",
              "--served-model-name", "tiny")  # fmt: skip
HELLO = [{"role": "user", "content": "Hello! How are you today?"}]
# NOTE: a tiny model is random: EOS may come at any step, so tests that need a given length pass
# the ignore_eos extension.
NO_EOS = {"ignore_eos": True}

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route each token to a few experts.",
    "Hello world! How are you today? I am fine, thank you.",
    "Shared memory channels carry hidden states between processes.",
    "Once upon a time there was a small model that served requests.",
]


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on a few sentences, with special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_served_checkpoint(path: Path, seed: int, max_position_embeddings: int = 512) -> Path:
    """A tiny random DeepSeek-V3 whose vocabulary is the tokenizer's, saved with the tokenizer."""
    tokenizer = make_tokenizer()
    make_tiny_checkpoint(
        "deepseek_v3",
        path,
        seed=seed,
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(path)
    return path


class ServerProcess(WatchedProcess):
    """`python -m ktserve serve MODEL --port 0 ...`; the URL is read from its stdout. health()
    and metrics() send the API key that env gives the server (KTSERVE_API_KEY), if any."""

    what = "the server"

    def __init__(
        self,
        model_dir: str | Path | None,
        *flags: str,
        env: dict | None = None,
        wait: bool = True,
        timeout: float = 180.0,
    ) -> None:
        model = [str(model_dir)] if model_dir is not None else []
        cmd = [sys.executable, "-m", "ktserve", "serve", *model, "--port", "0", *flags]
        super().__init__(cmd, env)
        self.url = ""
        key = (env or {}).get("KTSERVE_API_KEY")
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        if wait:
            line = self.read_line(r"serving .* at (http://\S+)/v1", timeout)
            self.url = re.search(r"at (http://\S+)/v1", line).group(1)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def health(self) -> tuple[int, dict]:
        status, body = self.get("/health", self.auth)
        return status, json.loads(body)

    def metrics(self) -> dict[str, float]:
        """Every sample as {"name{label=value,...}": value}, the model_name label that every
        sample must carry left out of the key (and kept in self.model_names)."""
        status, body = self.get("/metrics", self.auth)
        assert status == 200
        out = {}
        self.model_names = set()
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                assert "model_name" in s.labels, f"{s.name} has no model_name label"
                self.model_names.add(s.labels["model_name"])
                rest = {k: v for k, v in s.labels.items() if k != "model_name"}
                labels = ",".join(f"{k}={v}" for k, v in sorted(rest.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def open_stream(self, path: str, body: dict, headers: dict | None = None, read: bool = True):
        """A raw POST: (connection, response or None) so a test can drop the connection."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
        )
        return conn, conn.getresponse() if read else None

    def wait_until(self, predicate, timeout: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"{what} did not hold within {timeout} s")

    def close(self) -> None:
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            self.kill()
        self.close_streams()


@contextlib.contextmanager
def running_server(model_dir: str | Path | None, *flags: str, env: dict | None = None,
                   timeout: float = 180.0) -> Iterator[ServerProcess]:  # fmt: skip
    """A ServerProcess for the block, which must then exit 0 on SIGTERM and leave no shared
    memory segment behind."""
    before = shm_entries()
    proc = ServerProcess(model_dir, *flags, env=env, timeout=timeout)
    try:
        yield proc
        assert proc.terminate() == 0, proc.stderr()[-3000:]
    finally:
        proc.close()
    assert not shm_entries() - before


def tiny_server(checkpoint: Path, api_key: str, max_num_seqs: int):
    """running_server on a make_served_checkpoint: TINY_FLAGS and EXACT_ENV, served as `tiny`,
    with a key."""
    return running_server(checkpoint, *TINY_FLAGS, "--max-num-seqs", str(max_num_seqs),
                          env={**EXACT_ENV, "KTSERVE_API_KEY": api_key})  # fmt: skip


def openai_client(server: ServerProcess, api_key: str = "unused"):
    """The real openai SDK's client of `server` (no retries: a test sees each answer)."""
    import openai  # NOTE: here, so tests that only make checkpoints need no openai (GPU host)

    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
