"""The installed distribution's version (pyproject.toml's), for `ktserve --version` and
GET /version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def ktserve_version() -> str:
    try:
        return version("ktserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
