"""Every relative link in the README and the docs points at a file of the repository, and every
``#anchor`` into a markdown file at one of its headings (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                    *(ROOT / "benchmarks").glob("*.md"), ROOT / "benchmarks/data/README.md"])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def links(text: str) -> list:
    """The link targets of markdown ``text``, code blocks and code spans left out."""
    return LINK.findall(CODE.sub("", FENCE.sub("", text)))


def anchors(path: Path) -> set:
    """GitHub's ids of ``path``'s headings: lower case, punctuation dropped, spaces to '-'."""
    ids = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            ids.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return ids


def test_the_link_parser():
    text = "see [a](docs/a.md) and `[b](not/a/link)`\n```\n[c](nor/this)\n```\n[d](http://x)"
    assert links(text) == ["docs/a.md", "http://x"]


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc):
    assert doc.exists(), doc
    bad = []
    for target in links(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        name, _, anchor = target.partition("#")
        path = (doc.parent / name).resolve() if name else doc
        if ROOT not in path.parents and path != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)
