"""Shared pytest setup: the run's random seed. The repo root is on sys.path (pyproject.toml's
pytest `pythonpath`), so the packages and the helpers (tests.support) import as packages."""

import os
import random

import pytest

# One random seed per run, printed with pytest's summary (a test that fails after the fixture's
# first use does not show the fixture's own print); KTSERVE_TEST_SEED=N reproduces a run.
RUN_SEED = int(os.environ.get("KTSERVE_TEST_SEED", random.randrange(2**31)))


@pytest.fixture(scope="module")
def seed() -> int:
    """The run's random seed (every module that randomizes starts from it), printed."""
    print(f"seed={RUN_SEED} (KTSERVE_TEST_SEED={RUN_SEED} reproduces it)")
    return RUN_SEED


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"random seed {RUN_SEED}: KTSERVE_TEST_SEED={RUN_SEED} reproduces")
