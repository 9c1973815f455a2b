"""The expert workers' control-plane token: a shared secret every gRPC call but health carries.

A worker on TCP (loopback too: every local user reaches it) refuses to start without a token, and
then takes calls (GetInfo, LoadModel, Attach, Drain, ...) only with it; without one it listens
only on a Unix socket in a directory no other user can enter. `ktserve serve` starts its own
workers on Unix sockets in a 0700 directory with a fresh token, and remote or compose workers
share one from a file or the environment, never a command line (which every local user sees in
`ps`):

    KTSERVE_WORKER_TOKEN_FILE   a file whose first line is the token (or --worker-token-file)
    KTSERVE_WORKER_TOKEN        the token itself
    KTSERVE_WORKER_TOKEN_CREATE=1   the first process to find the token file missing writes a
                                random one there (0600), the others read it: containers that
                                share a private tmpfs (compose.yaml) agree on a token that way
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from ktserve import envs
from ktserve.config_flags import flag

TOKEN_ENV = envs.WORKER_TOKEN.name
TOKEN_FILE_ENV = envs.WORKER_TOKEN_FILE.name
TOKEN_CREATE_ENV = envs.WORKER_TOKEN_CREATE.name
METADATA_KEY = "x-ktserve-worker-token"
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # liveness for Docker, Kubernetes, the supervisor


def token_file_flag(role: str) -> Any:
    """The config field (ktserve.config_flags.flag) of a token-file flag: where the token is
    looked for, then `role` (what this side does with it), then why it is never a flag."""
    return flag(
        None,
        env=TOKEN_FILE_ENV,
        metavar="PATH",
        help=f"the workers' control-plane token: this file's first line (default: the "
        f"{TOKEN_FILE_ENV} environment variable; without either, the token in {TOKEN_ENV}). "
        f"{role} The token is never a flag: a command line is visible to every local user",
    )


class TokenError(ValueError):
    """The token file is missing, unreadable or empty."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def read_token(path: str | None = None, environ: dict | None = None) -> str | None:
    """The token from `path`, else $KTSERVE_WORKER_TOKEN_FILE, else $KTSERVE_WORKER_TOKEN; None
    when none is set."""
    env = os.environ if environ is None else environ
    path = path or env.get(TOKEN_FILE_ENV)
    if path and env.get(TOKEN_CREATE_ENV) == "1":
        create_token_file(path)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TokenError(f"worker token file {path}: {exc.strerror}") from None
        token = text.splitlines()[0].strip() if text.strip() else ""
        if not token:
            raise TokenError(f"worker token file {path} is empty")
        if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logging.getLogger("ktserve").warning(
                "worker token file %s can be read by other users (chmod 600 it)", path
            )
        return token
    return env.get(TOKEN_ENV) or None


def create_token_file(path: str) -> bool:
    """Write a random token to `path` (0600) unless it exists; True if this call wrote it. The
    file appears whole or not at all (written aside, then linked), so a reader racing the
    writer never sees it empty."""
    target = Path(path)
    if target.exists():
        return False
    aside = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (new_token() + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.link(aside, target)  # NOTE: fails if another process linked its file first
        return True
    except FileExistsError:
        return False
    finally:
        aside.unlink()


def listener_refusal(listen: str, token: str | None) -> str | None:
    """Why a worker must not listen at `listen` with this token (None: it may). Without a token
    a worker takes calls only on a Unix socket in a directory no other user can enter: a TCP port,
    loopback included, is open to every local user (and beyond loopback to other machines)."""
    if token is not None:
        return None
    how = (f"give the worker a token ({TOKEN_FILE_ENV}=PATH, or --token-file PATH; with "
           f"{TOKEN_CREATE_ENV}=1 the worker writes a fresh one there, 0600; or {TOKEN_ENV}) "
           "and the GPU service the same (ktserve serve --worker-token-file PATH)")  # fmt: skip
    if not listen.startswith("unix:"):
        return f"--listen {listen} is a TCP port every local user can reach: {how}"
    directory = Path(listen.removeprefix("unix:")).parent
    try:
        info = directory.stat()
    except OSError as exc:
        return f"--listen {listen}: its directory {directory}: {exc.strerror}"
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"--listen {listen}: other users can enter {directory} (mode "
                f"{stat.S_IMODE(info.st_mode):o}, owner uid {info.st_uid}): put the socket in a "
                f"directory of yours with mode 0700, or {how}")  # fmt: skip
    return None
