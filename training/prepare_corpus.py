"""Build the demo model's text corpus from the Python documentation's HTML (Debian python3.X-doc).

Each HTML page is one document. Pages are reduced to their main body's text (training.html_text),
whitespace-normalized, deduplicated (whole pages, then repeated prose paragraphs), and split into
train / held-out by page with a seeded shuffle. Output (gzip, UTF-8), under --out-dir:
  train.txt.gz     training documents, separated by DOC_SEPARATOR
  val.txt.gz       validation documents (checkpoint selection during training), likewise
  heldout.txt.gz   held-out documents (reported perplexity; never used in training), likewise
  chat.txt.gz      ChatML dialogues built from training pages only (training.chat_samples)
  manifest.json    source, counts and sizes
and, committed with the model, --sample-path (training/heldout_sample.txt): the first
--sample-chars of the held-out documents as plain text, cut at a paragraph boundary, for the
perplexity test and ktserve's quality benchmark.

Usage: python -m training.prepare_corpus [--html-dir DIR] [--out-dir DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from training.chat_samples import chat_dialogues
from training.html_text import Block, page_blocks

DOC_SEPARATOR = "\n\f\n"
DEFAULT_HTML_DIR = Path("/usr/share/doc/python3.11/html")
DEFAULT_OUT_DIR = Path("training/data")
DEFAULT_SAMPLE_PATH = Path("training/heldout_sample.txt")
# Index, search and table-of-contents pages: lists of links, not prose.
SKIP_PAGES = ("genindex", "py-modindex", "search", "contents", "glossary-index")


@dataclass(frozen=True)
class CorpusConfig:
    html_dir: Path = DEFAULT_HTML_DIR
    out_dir: Path = DEFAULT_OUT_DIR
    seed: int = 1234
    heldout_fraction: float = 0.02
    val_fraction: float = 0.02
    min_doc_chars: int = 200
    sample_path: Path = DEFAULT_SAMPLE_PATH
    sample_chars: int = 40_000

    def __post_init__(self) -> None:
        for name in ("heldout_fraction", "val_fraction"):
            if not 0.0 < getattr(self, name) < 0.25:
                raise ValueError(f"{name} must be in (0, 0.25), got {getattr(self, name)}")


@dataclass(frozen=True)
class Document:
    name: str  # page path relative to the HTML root
    blocks: tuple[Block, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(b.text for b in self.blocks)


def read_documents(html_dir: Path) -> list[Document]:
    """All content pages under html_dir, sorted by path, as block lists."""
    docs = []
    for path in sorted(html_dir.rglob("*.html")):
        name = path.relative_to(html_dir).as_posix()
        if path.name.startswith(SKIP_PAGES) or name.startswith("_"):
            continue
        blocks = page_blocks(path.read_text(encoding="utf-8", errors="replace"))
        docs.append(Document(name, tuple(blocks)))
    return docs


def dedupe(docs: list[Document], min_doc_chars: int) -> list[Document]:
    """Drop repeated pages and repeated prose paragraphs (first one wins), then short pages."""
    seen_docs: set[str] = set()
    seen_paras: set[str] = set()
    out = []
    for doc in docs:
        digest = hashlib.sha256(doc.text.encode()).hexdigest()
        if digest in seen_docs:
            continue
        seen_docs.add(digest)
        kept = []
        for block in doc.blocks:
            # NOTE: headings and short lines repeat legitimately ("Example", "Changed in 3.x").
            if block.kind == "text" and len(block.text) >= 80:
                if block.text in seen_paras:
                    continue
                seen_paras.add(block.text)
            kept.append(block)
        doc = Document(doc.name, tuple(kept))
        if len(doc.text) >= min_doc_chars:
            out.append(doc)
    return out


def split(
    docs: list[Document], seed: int, heldout_fraction: float, val_fraction: float
) -> tuple[list[Document], list[Document], list[Document]]:
    """(train, val, heldout) by document; deterministic for a seed; each keeps its path order."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    num_heldout = max(1, round(len(docs) * heldout_fraction))
    num_val = max(1, round(len(docs) * val_fraction))
    heldout_ids = set(order[:num_heldout])
    val_ids = set(order[num_heldout : num_heldout + num_val])
    train = [d for i, d in enumerate(docs) if i not in heldout_ids and i not in val_ids]
    val = [d for i, d in enumerate(docs) if i in val_ids]
    heldout = [d for i, d in enumerate(docs) if i in heldout_ids]
    return train, val, heldout


def write_texts(path: Path, texts: list[str]) -> int:
    """Write texts joined by DOC_SEPARATOR as gzip; returns the number of characters."""
    joined = DOC_SEPARATOR.join(texts)
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(joined)
    return len(joined)


def read_texts(path: Path) -> list[str]:
    """The documents written by write_texts."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [t for t in f.read().split(DOC_SEPARATOR) if t]


def heldout_sample(docs: list[Document], max_chars: int) -> str:
    """Whole paragraphs of the documents, in order, up to max_chars (ends with a newline)."""
    out: list[str] = []
    size = 0
    for block in (b for d in docs for b in d.blocks):
        if size + len(block.text) + 2 > max_chars:
            break
        out.append(block.text)
        size += len(block.text) + 2
    return "\n\n".join(out) + "\n"


def prepare(config: CorpusConfig) -> dict:
    if not config.html_dir.is_dir():
        raise FileNotFoundError(
            f"{config.html_dir} not found: install the Debian package python3.11-doc"
        )
    docs = dedupe(read_documents(config.html_dir), config.min_doc_chars)
    train, val, heldout = split(docs, config.seed, config.heldout_fraction, config.val_fraction)
    dialogues = chat_dialogues(train, config.seed)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "source": str(config.html_dir),
        "seed": config.seed,
        "num_train_docs": len(train),
        "num_val_docs": len(val),
        "num_heldout_docs": len(heldout),
        "num_chat_dialogues": len(dialogues),
        "train_chars": write_texts(config.out_dir / "train.txt.gz", [d.text for d in train]),
        "val_chars": write_texts(config.out_dir / "val.txt.gz", [d.text for d in val]),
        "heldout_chars": write_texts(config.out_dir / "heldout.txt.gz", [d.text for d in heldout]),
        "chat_chars": write_texts(config.out_dir / "chat.txt.gz", dialogues),
        "val_docs": [d.name for d in val],
        "heldout_docs": [d.name for d in heldout],
    }
    config.sample_path.write_text(heldout_sample(heldout, config.sample_chars), encoding="utf-8")
    (config.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--html-dir", type=Path, default=CorpusConfig.html_dir)
    ap.add_argument("--out-dir", type=Path, default=CorpusConfig.out_dir)
    ap.add_argument("--seed", type=int, default=CorpusConfig.seed)
    ap.add_argument("--heldout-fraction", type=float, default=CorpusConfig.heldout_fraction)
    ap.add_argument("--val-fraction", type=float, default=CorpusConfig.val_fraction)
    ap.add_argument("--min-doc-chars", type=int, default=CorpusConfig.min_doc_chars)
    ap.add_argument("--sample-path", type=Path, default=CorpusConfig.sample_path)
    ap.add_argument("--sample-chars", type=int, default=CorpusConfig.sample_chars)
    args = ap.parse_args()
    manifest = prepare(CorpusConfig(**vars(args)))
    print(json.dumps({k: v for k, v in manifest.items() if not isinstance(v, list)}, indent=2))


if __name__ == "__main__":
    main()
