"""The `checkpoint` and `checkpoints` fixtures: tiny random checkpoints seeded with the run's seed,
made once per test module (tests/conftest.py registers this module as a pytest plugin).

What they hold is the module's to say, in constants the fixtures read from it (pytest's
`request.module`):
  CHECKPOINT           `checkpoint`: a TinyCheckpoint or a ServedCheckpoint
  CHECKPOINT_FAMILIES  `checkpoint` is a tiny checkpoint of each family in turn: the module's
                       tests are parametrized over them
  CHECKPOINTS          `checkpoints`: {name: TinyCheckpoint} (one_per_family builds the usual one)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class TinyCheckpoint:
    """make_tiny_checkpoint(family, seed=the run's seed + seed_offset, **overrides)."""

    family: str
    seed_offset: int = 0
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dir_name(self) -> str:
        return self.family

    def make(self, path: Path, seed: int) -> Path:
        from tests.support.checkpoints import make_tiny_checkpoint  # NOTE: imports transformers

        return make_tiny_checkpoint(
            self.family, path, seed=seed + self.seed_offset, **self.overrides
        )


@dataclass(frozen=True)
class ServedCheckpoint:
    """make_served_checkpoint: a tiny DeepSeek-V3 saved with the test tokenizer, for a server."""

    max_position_embeddings: int = 512
    dir_name: str = "tiny"  # NOTE: the name it is served as (--served-model-name's default)

    def make(self, path: Path, seed: int) -> Path:
        from tests.support.api_server import make_served_checkpoint  # NOTE: imports transformers

        return make_served_checkpoint(path, seed, self.max_position_embeddings)


def one_per_family(
    families: Iterable[str], *, distinct_seeds: bool = False
) -> dict[str, TinyCheckpoint]:
    """{family: its tiny checkpoint}; distinct_seeds: the i-th family's seed is the run's + i."""
    return {f: TinyCheckpoint(f, i if distinct_seeds else 0) for i, f in enumerate(families)}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    families = getattr(metafunc.module, "CHECKPOINT_FAMILIES", None)
    if families is not None and "checkpoint" in metafunc.fixturenames:
        metafunc.parametrize("checkpoint", list(families), indirect=True, scope="module")


@pytest.fixture(scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory, seed: int) -> Path:
    """The module's CHECKPOINT, or a tiny checkpoint of the family the test is parametrized
    with (CHECKPOINT_FAMILIES)."""
    spec = TinyCheckpoint(request.param) if hasattr(request, "param") else request.module.CHECKPOINT
    return spec.make(tmp_path_factory.mktemp("checkpoint") / spec.dir_name, seed)


@pytest.fixture(scope="module")
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory, seed: int) -> dict[str, Path]:
    """The module's CHECKPOINTS, made: {name: path}."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: spec.make(root / name, seed) for name, spec in request.module.CHECKPOINTS.items()}
