"""Real coding agents against `ktserve serve` on the demo model: Codex CLI (`codex exec`, the
Responses API) and Claude Code (`claude -p`, the Messages API), from their npm packages
(`npm install -g @openai/codex @anthropic-ai/claude-code`); each test skips, saying so, where its
binary is missing. Each completes a one-line task through the server, whose access log shows its
route answered 200.

The demo model's context is stretched (a copy whose max_position_embeddings is larger: its rope
is the default one) to hold Codex's prompt (about 11k tokens). Claude Code runs --bare with a
short system prompt and no tools: its full prompt (about 25k tokens) would take minutes on a
CPU. Codex runs with web_search disabled: it is not a function tool, and this server refuses
those by name. Neither client forces a tool call (both send tool_choice auto), so a random model
makes none: tool calls through real clients are the SDK tests' (test_api_responses.py,
test_api_messages.py), where tool_choice forces them.

Each run has a hard timeout, its own session (process group: killed whole, whatever it left),
and a temporary HOME and config directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from gpu_service.config import DEMO_MODEL_DIR
from tests.support.api_server import CPU_FLAGS, running_server

MODEL = "demo"
KEY = "clients-key"
CONTEXT = 16384
FLAGS = (*CPU_FLAGS, "--max-model-len", str(CONTEXT), "--kv-cache-tokens", str(2 * CONTEXT),
         "--served-model-name", MODEL)  # fmt: skip
# NOTE: Codex sets no output bound: a random model may write up to the context's end (some
# minutes on a CPU); a run took 1 to 4 minutes here
RUN_TIMEOUT_S = 540


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (npm install -g its package: see the module doc)")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("long") / MODEL
    shutil.copytree(DEMO_MODEL_DIR, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model_dir / "config.json").write_text(json.dumps(config))
    with running_server(model_dir, *FLAGS, env={"KTSERVE_API_KEY": KEY}) as proc:
        yield proc


def run_cli(cmd: list[str], home: Path, env: dict[str, str]) -> str:
    """cmd's output (stdout and stderr); fails on a timeout or a nonzero exit. Its process
    group is killed afterwards, whatever it left running."""
    home.mkdir(parents=True, exist_ok=True)
    work = home / "work"
    work.mkdir(exist_ok=True)
    base = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8"}
    proc = subprocess.Popen(cmd, cwd=work, env={**base, **env}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} did not finish within {RUN_TIMEOUT_S} s:\n{out[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    return out


def access_lines(server, route: str) -> list[str]:
    return [line for line in server.stderr().splitlines()
            if "ktserve.access" in line and f" {route} " in line]  # fmt: skip


def answered(server, route: str, before: int) -> list[str]:
    """The access log's lines of `route` after the first `before`, once one says 200."""
    return server.wait_until(
        lambda: [s for s in access_lines(server, route)[before:] if f" {route} 200 " in s],
        timeout=30, what=f"an access log line of {route} 200",
    )  # fmt: skip


def test_codex_exec_completes_a_task_through_responses(server, tmp_path):
    codex = binary("codex")
    home = tmp_path / "codex"
    (home / "codex-home").mkdir(parents=True)
    (home / "codex-home" / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "ktserve"\nweb_search = "disabled"\n\n'
        f'[model_providers.ktserve]\nname = "ktserve"\nbase_url = "{server.base_url}"\n'
        'wire_api = "responses"\nenv_key = "KTSERVE_TEST_KEY"\n'
    )
    before = len(access_lines(server, "/v1/responses"))
    out = run_cli([codex, "exec", "--skip-git-repo-check", "Say hello in one line."], home,
                  {"CODEX_HOME": str(home / "codex-home"), "KTSERVE_TEST_KEY": KEY})  # fmt: skip
    lines = answered(server, "/v1/responses", before)
    print(*lines, sep="\n")
    prompt = int(lines[0].split("prompt_tokens=")[1].split()[0])
    assert prompt > 1000, lines  # Codex's own instructions and tools came through
    assert "tokens used" in out, out[-3000:]


def test_claude_code_completes_a_task_through_messages(server, tmp_path):
    claude = binary("claude")
    home = tmp_path / "claude"
    before = len(access_lines(server, "/v1/messages"))
    env = {
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": KEY,  # sent as x-api-key
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CONFIG_DIR": str(home / "claude-config"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    cmd = [claude, "-p", "Say hello in one line.", "--model", MODEL, "--bare",
           "--system-prompt", "Be brief.", "--tools", "", "--output-format", "json"]  # fmt: skip
    out = run_cli(cmd, home, env)
    answered(server, "/v1/messages", before)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["subtype"] == "success" and not result["is_error"], result
    assert isinstance(result["result"], str) and result["usage"]["output_tokens"] > 0
