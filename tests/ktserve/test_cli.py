"""`ktserve` as a command (ktserve/cli.py): every subcommand's help explains every flag, and each
subcommand imports only its own side."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from gpu_service.cli import MOVED_FLAGS
from ktserve.cli import COMMANDS, build_parser
from ktserve.worker_token import TOKEN_ENV, new_token
from tests.support.ktserve_command import ktserve
from tests.support.watched_process import CHILD_ENV, REPO, WatchedProcess

SERVE_FLAGS = (
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "--metrics-public",
    "--max-request-bytes",
    "--max-waiting-requests",
    "--request-timeout",
    "--shutdown-timeout",
    "--served-model-name",
    "--expert-workers",
    "--experts-per-worker",
    "--format",
    "--threads",
    "--gpu-experts",
    "--expert-placement",
    "--max-model-len",
    "--kv-cache-tokens",
    "--dtype",
    "--max-num-seqs",
    "--max-decode-stall-ms",
    "--device",
    "--worker-timeout",
    "--no-restart-workers",
    "--worker-start-timeout",
    "--expert-address",
)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_help_explains_every_flag():
    """Every option and positional of every subcommand, read from the parser, has help text
    that its --help prints (unwrapped: a wide terminal, whitespace collapsed)."""
    wide = {"COLUMNS": "1000"}
    top = ktserve("--help", env=wide)
    assert top.returncode == 0, top.stderr
    commands = subcommands(build_parser())
    assert set(commands) == set(COMMANDS) == {"serve", "expert", "convert", "plan"}
    for name, command in COMMANDS.items():
        assert command.help and f"{name} {command.help}" in " ".join(top.stdout.split())
    for name, parser in commands.items():
        result = ktserve(name, "--help", env=wide)
        assert result.returncode == 0, result.stderr
        text = " ".join(result.stdout.split())
        actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        actions = [a for a in actions if a.help is not argparse.SUPPRESS]  # moved: MOVED_FLAGS
        assert actions, f"ktserve {name} has no flags"
        for action in actions:
            what = f"ktserve {name} {'/'.join(action.option_strings) or action.metavar}"
            assert action.help and action.help.strip(), f"{what} has no help"
            assert " ".join((action.help % vars(action)).split()) in text, f"{what}: help missing"
            for option in action.option_strings or [action.metavar]:
                assert re.search(rf"(^|[\s\[]){re.escape(option)}\b", text), f"{what} missing"
    serve = {o for a in commands["serve"]._actions for o in a.option_strings}
    assert set(SERVE_FLAGS) <= serve
    text = ktserve("serve", "--help").stdout
    assert not [flag for flag in MOVED_FLAGS if flag in text]
    assert (
        "KTSERVE_API_KEY" in text
        and "KTSERVE_DEVICE" in text
        and "MODEL" in text
        and ".gguf" in text
    )
    # the expert_service subcommands are the same parsers
    assert "--listen" in ktserve("expert", "--help").stdout
    assert "--out" in ktserve("convert", "--help").stdout


def imported(stderr: str) -> set[str]:
    """The top-level packages a `python -X importtime` run imported, read from its stderr."""
    lines = (line for line in stderr.splitlines() if line.startswith("import time:"))
    return {line.rpartition("|")[2].strip().split(".")[0] for line in lines} - {"imported package"}


@pytest.mark.parametrize(
    "argv, absent",
    [
        ([], {"torch", "gpu_service", "expert_service"}),
        (["expert"], {"torch", "gpu_service", "grpc"}),
        (["convert"], {"torch", "gpu_service"}),
        (["serve"], {"torch", "expert_service", "transformers", "uvicorn"}),
        (["plan"], {"torch", "expert_service", "transformers", "uvicorn"}),
    ],
)
def test_help_imports_only_the_command_asked_for(argv, absent):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ktserve", *argv, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=CHILD_ENV,
    )
    assert result.returncode == 0, result.stderr
    loaded = imported(result.stderr)
    assert "ktserve" in loaded and not loaded & absent, f"imported {sorted(loaded & absent)}"


def test_expert_worker_starts_without_the_gpu_side():
    worker = WatchedProcess([sys.executable, "-X", "importtime", "-m", "ktserve", "expert",
                             "--listen", "127.0.0.1:0", "--threads", "1"],
                            {TOKEN_ENV: new_token()})  # fmt: skip
    try:
        worker.read_line("listening on")
        assert worker.terminate() == 0
        loaded = imported(worker.stderr())
    finally:
        worker.kill()
        worker.close_streams()
    assert {"expert_service", "grpc"} <= loaded
    assert not loaded & {"gpu_service", "transformers", "uvicorn", "fastapi"}, sorted(loaded)
