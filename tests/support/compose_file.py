"""compose.yaml read the way Docker Compose reads it: `${VAR:-default}` interpolated (from a given
environment, else the defaults), YAML merge keys, and the `!reset` tag of override files."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

VARIABLE = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*))?\}")


class Reset:
    """`!reset`: the override file removes the key it tags."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def interpolate(value, env: dict[str, str]):
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name, op, default = match.groups()
        if name in env and (env[name] or op != ":-"):
            return env[name]
        if op is None:
            raise KeyError(f"${{{name}}} has no default and is not set")
        return default

    text = VARIABLE.sub(substitute, value)
    if "$" in text:
        raise ValueError(f"unsupported interpolation in {value!r}")
    return text


def load(path: Path, env: dict[str, str] | None = None) -> dict:
    with open(path) as f:
        return interpolate(yaml.load(f, Loader=ComposeLoader), env or {})


@dataclass(frozen=True)
class Mount:
    source: str
    target: str


def mounts(service: dict) -> list[Mount]:
    """The service's volumes, short syntax ("SOURCE:TARGET[:ro]")."""
    out = []
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        out.append(Mount(source, target))
    return out


def environment(service: dict) -> dict[str, str | None]:
    """The service's environment (list form "NAME=VALUE", or "NAME": passed on from the host)."""
    out = {}
    for entry in service.get("environment", []):
        name, sep, value = entry.partition("=")
        out[name] = value if sep else None
    return out


def host_path(root: Path, service: dict, container_path: str) -> Path:
    """Where a bind-mounted container path lies on the host (compose's relative sources are
    relative to the compose file's directory)."""
    for mount in mounts(service):
        if container_path == mount.target or container_path.startswith(mount.target + "/"):
            return (root / mount.source / container_path[len(mount.target) :].lstrip("/")).resolve()
    raise KeyError(f"{container_path} is not in a bind mount of the service")


def flag(argv: list[str], name: str) -> str:
    """The value of `--name VALUE` in argv (the last one, as argparse takes it)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    if not values:
        raise KeyError(f"{name} is not in {argv}")
    return values[-1]


def replace_flags(argv: list[str], values: dict[str, str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in values:
            out[i + 1] = values[a]
    return out
