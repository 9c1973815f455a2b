"""Plain text from a Sphinx HTML page: the main body only, as a list of typed blocks.

A block is one paragraph, heading, list item, table row or code listing. Prose has its whitespace
collapsed; code keeps its lines (trailing blanks dropped, runs of blank lines squeezed to one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser

HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
# Elements whose start or end closes the current prose block.
BLOCK_TAGS = (
    frozenset(
        {
            "p",
            "div",
            "li",
            "dt",
            "dd",
            "tr",
            "td",
            "th",
            "table",
            "ul",
            "ol",
            "dl",
            "section",
            "blockquote",
            "br",
            "hr",
            "caption",
            "figure",
            "figcaption",
        }
    )
    | HEADINGS
)
SKIP_TAGS = frozenset({"script", "style", "nav", "form"})
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class Block:
    """One unit of page text: kind is "heading", "text" or "code"."""

    kind: str
    text: str


class _MainBodyParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[Block] = []
        self._div_depth = 0  # depth of open divs, counted only inside the main body
        self._in_main = False
        self._skip_depth = 0  # open SKIP_TAGS or headerlink anchors
        self._pre_depth = 0
        self._anchor_skips: list[bool] = []  # per open <a>: is it a headerlink (the pilcrow)?
        self._heading = False
        self._buf: list[str] = []

    def _flush(self) -> None:
        raw = "".join(self._buf)
        self._buf = []
        if self._pre_depth:
            return
        text = _SPACES.sub(" ", raw).strip()
        if text:
            self.blocks.append(Block("heading" if self._heading else "text", text))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if not self._in_main:
            if tag == "div" and attr.get("role") == "main":
                self._in_main, self._div_depth = True, 1
            return
        if tag == "div":
            self._div_depth += 1
        if tag == "a":
            is_headerlink = "headerlink" in (attr.get("class") or "")
            self._anchor_skips.append(is_headerlink)
            self._skip_depth += is_headerlink
            return
        if tag in SKIP_TAGS:
            self._skip_depth += 1
            return
        if tag == "pre":
            self._flush()
            self._pre_depth += 1
            return
        if tag in BLOCK_TAGS and not self._pre_depth:
            self._flush()
            self._heading = tag in HEADINGS

    def handle_endtag(self, tag: str) -> None:
        if not self._in_main:
            return
        if tag == "a":
            if self._anchor_skips and self._anchor_skips.pop():
                self._skip_depth -= 1
            return
        if tag in SKIP_TAGS:
            self._skip_depth = max(0, self._skip_depth - 1)
            return
        if tag == "pre" and self._pre_depth:
            self._pre_depth -= 1
            if not self._pre_depth:
                code = _clean_code("".join(self._buf))
                self._buf = []
                if code:
                    self.blocks.append(Block("code", code))
            return
        if tag in BLOCK_TAGS and not self._pre_depth:
            self._flush()
            self._heading = False
        if tag == "div":
            self._div_depth -= 1
            if self._div_depth == 0:
                self._in_main = False

    def handle_data(self, data: str) -> None:
        if self._in_main and not self._skip_depth:
            self._buf.append(data)


def _clean_code(raw: str) -> str:
    lines = [line.rstrip() for line in raw.strip("\n").split("\n")]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip("\n")


def page_blocks(html: str) -> list[Block]:
    """The blocks of a page's main body, in document order."""
    parser = _MainBodyParser()
    parser.feed(html)
    parser.close()
    return parser.blocks
