"""The `ktserve` command: a thin dispatcher. `ktserve --help` lists the commands and imports none
of them; `ktserve COMMAND ...` imports that command's module only (`ktserve expert` loads nothing
of the GPU side), whose configure function adds the command's flags and its `run` to the parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Collection
from dataclasses import dataclass

from ktserve.parent_process import follow_parent
from ktserve.version import ktserve_version


@dataclass(frozen=True)
class Command:
    """configure: "module:function" that adds the command's flags and `run` to its parser."""

    configure: str
    help: str


COMMANDS = {
    "serve": Command(
        "gpu_service.cli:configure_serve", "serve a model over an OpenAI-compatible HTTP API"
    ),
    "expert": Command("expert_service.cli:configure_expert", "run a CPU expert worker"),
    "convert": Command(
        "expert_service.cli:configure_convert",
        "quantize and pack a shard of routed experts to disk",
    ),
    "plan": Command(
        "gpu_service.plan.cli:configure_plan",
        "the memory plan and decode speed serve would have, from a model's config alone",
    ),
}


def build_parser(configured: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """Every command; those in `configured` (their modules imported) with their flags."""
    parser = argparse.ArgumentParser(
        prog="ktserve",
        description="Serve huge Mixture-of-Experts models on one GPU plus host RAM.",
    )
    parser.add_argument("--version", action="version", version=f"ktserve {ktserve_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command_parser = sub.add_parser(name, help=command.help, description=command.help)
        if name in configured:
            module, _, function = command.configure.partition(":")
            getattr(importlib.import_module(module), function)(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command argv names; a user's mistake is one line and exit code 2."""
    follow_parent()  # NOTE: a worker the GPU service started goes when it goes
    argv = sys.argv[1:] if argv is None else argv
    named = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser([named] if named in COMMANDS else []).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:  # NOTE: CheckpointError is a ValueError
        print(f"ktserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
