"""The README and docs/ hold together: every link resolves (file and heading), every docs page is linked from the
README and says first what it answers, and every repository path named in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH_IN_BACKTICKS = re.compile(r"`((?:optimizer|tests|benchmarks|examples|recipes|scripts|docs)/[\w./-]+?)`")
README_MAX_LINES = 250


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' line inside a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    return LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+://", target):
            continue  # the network is not checked here
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_paths_named_in_backticks_exist(page):
    missing = [p for p in PATH_IN_BACKTICKS.findall(page.read_text())
               if "*" not in p and "<" not in p and not (ROOT / p.rstrip("/.")).exists()]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: p.name)
def test_a_page_starts_with_what_it_answers(page):
    first_paragraph = page.read_text().split("\n\n")[1]
    assert first_paragraph.startswith("What this answers:"), page.name


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad anchor](#nowhere)\n")
    assert _links(page) == ["#title", "missing.md", "#nowhere"]
    assert _anchors(page) == {"title"} and _slug("Choosing a build: `--precision auto`") == "choosing-a-build---precision-auto"
