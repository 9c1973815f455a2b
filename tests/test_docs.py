"""The docs that are generated or that name the code: docs/serving.md's flag reference is
`ktserve serve`'s parser as it stands (tools/serving_flags.py), and the README stays a front
door whose links lead somewhere."""

from __future__ import annotations

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


def test_every_serve_flag_is_in_the_reference():
    written = serving_flags.current(serving_flags.DOC.read_text())
    parser = serving_flags.serve_parser()
    flags = [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]
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
