"""The README and docs/ link only to files and headings that exist.

Files move (kernels, the tokenizer, the built-in model, the benchmarks all moved once); a link that
still names the old path sends a reader to nothing. Every relative link in README.md and
docs/*.md must resolve to a file or folder in the checkout, and an anchor to a heading of the
target page (an explicit `<a id>` or GitHub's slug: lower case, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
EXPLICIT_ANCHOR = re.compile(r'<a id="([^"]+)"')


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The headings' slugs and the explicit ``<a id="...">`` anchors of a page."""
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in HEADING.findall(text)} | set(EXPLICIT_ANCHOR.findall(text))


def relative_links(page: Path) -> list[str]:
    links = LINK.findall(FENCE.sub("", page.read_text()))
    return [link for link in links if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_the_slug_follows_github() -> None:
    assert slug("Which kernel runs a decode layer?") == "which-kernel-runs-a-decode-layer"
    assert slug("The rivals' environments") == "the-rivals-environments"
    assert slug("`pagedkv bench` and tools/") == "pagedkv-bench-and-tools"
