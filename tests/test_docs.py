"""The docs that are generated or that name the code: docs/serving.md's flag reference is
`ktserve serve`'s parser as it stands and its environment reference is ktserve/envs.py
(tools/serving_flags.py), and the README stays a front door whose links lead somewhere."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tools import serving_flags

ROOT = Path(__file__).resolve().parent.parent


def test_serving_flag_reference_is_current():
    written = serving_flags.current(serving_flags.DOC.read_text())
    assert written is not None, "docs/serving.md lost its generated flag reference"
    assert written == serving_flags.render(), (
        "docs/serving.md's flag reference is stale: run `python -m tools.serving_flags`"
    )


def test_environment_reference_is_current():
    text = serving_flags.DOC.read_text()
    written = serving_flags.current(text, serving_flags.ENV_BEGIN, serving_flags.ENV_END)
    assert written is not None, "docs/serving.md lost its generated environment reference"
    assert written == serving_flags.render_environment(), (
        "docs/serving.md's environment reference is stale: run `python -m tools.serving_flags`"
    )


def test_every_serve_flag_is_in_the_reference():
    written = serving_flags.current(serving_flags.DOC.read_text())
    parser = serving_flags.serve_parser()
    actions = [a for a in parser._actions if a.help is not argparse.SUPPRESS]  # moved flags
    flags = [s for a in actions for s in a.option_strings if s not in ("-h", "--help")]
    missing = [f for f in flags if f"`{f}`" not in written]
    assert not missing, f"flags missing from docs/serving.md: {missing}"


def test_readme_is_a_front_door_whose_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "make serve" in text and "make test" in text
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links, "the README links to the docs"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_architecture_names_every_package_and_no_other():
    """docs/architecture.md's map: each service's subpackages, each named once as `name/`, and
    no name of one that is gone; gpu_service keeps at most six modules at its top."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    gpu = ROOT / "gpu_service"
    packages = sorted(p.name for p in gpu.iterdir() if (p / "__init__.py").exists())
    missing = [p for p in packages if f"{p}/" not in text]
    assert not missing, f"docs/architecture.md does not name gpu_service's {missing}"
    block = text[text.index("gpu_service/ ") : text.index("\ntests/ ")]
    named = set(re.findall(r"(?<![\w/.])([a-z_]+)/ \(", block))
    gone = sorted(n for n in named if not (gpu / n).is_dir() and not any(gpu.glob(f"*/{n}")))
    assert not gone, f"docs/architecture.md names packages that do not exist: {gone}"
    top = sorted(p.name for p in gpu.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 6, f"gpu_service has {len(top)} modules at its top: {top}"
