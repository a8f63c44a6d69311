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
    assert _anchors(page) == {"title"}
    assert _slug("Choosing a build: `--precision auto`") == "choosing-a-build---precision-auto"


def _package_map() -> dict[str, str]:
    """docs/development.md's map of the package: "accel_opt/graph/" or "accel_opt/errors.py" -> what the map says of it
    (its entry's text, continuation lines included)."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = re.search(r"```\noptimizer/ .*?```", text, re.S).group(0)
    entries: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, folder) of the enclosing folders below accel_opt/
    last = None
    for line in block.splitlines()[1:-1]:
        indent = len(line) - len(line.lstrip())
        token = line.split()[0] if line.strip() else ""
        if indent <= 2 and not token.endswith("/accel_opt/") and token != "accel_opt/":
            last = None  # top-level folders beside the package (recipes/, tests/, ...)
            continue
        if token == "accel_opt/":
            stack, last = [(indent, "accel_opt/")], None
            continue
        if token.endswith(("/", ".py")) and stack and stack[0][0] < indent < 24:  # an entry (descriptions: column 27)
            while indent <= stack[-1][0]:
                stack.pop()
            path = "".join(folder for _, folder in stack) + token
            entries[path] = line.strip()[len(token):]
            if token.endswith("/"):
                stack.append((indent, token))
            last = path
        elif last is not None:
            entries[last] += " " + line.strip()
    return entries


def test_the_package_map_names_every_module():
    """docs/development.md's map of the package cannot drift: every module and sub-package is named in its folder's
    entry (a new module without a word in the map fails here), and every entry is a folder or module that exists."""
    entries = _package_map()
    package = ROOT / "optimizer" / "accel_opt"
    missing, stale = [], [path for path in entries if not (ROOT / "optimizer" / path.rstrip("/")).exists()]
    for folder in [package, *sorted(p for p in package.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        key = folder.relative_to(package.parent).as_posix() + "/"
        said = entries.get(key, "")
        for module in sorted(folder.glob("*.py")):
            if module.name in ("__init__.py", "__main__.py"):
                continue
            if folder == package:  # the package's own modules are entries of their own
                if f"accel_opt/{module.name}" not in entries:
                    missing.append(f"accel_opt/{module.name}")
            elif not re.search(rf"\b{module.stem}\b", said):
                missing.append(f"{key}{module.name}")
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
            if f"{key}{sub.name}/" not in entries and not re.search(rf"\b{sub.name}\b", said):
                missing.append(f"{key}{sub.name}/")
    assert not missing and not stale, f"the map does not name {missing}; it names what is gone: {stale}"


# A path a comment, docstring or page names: folders and a file name ending .py, .md, .yaml or .yml.
FILE_REFERENCE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w-]+\.(?:py|md|ya?ml))\b")
PLACEHOLDERS = ("NAME.", "path/file.", "since gone")  # a template or a file named as gone, not a reference


def test_every_file_a_source_or_page_names_exists():
    """References to files in code, tests, benchmarks, scripts and docs resolve: from the repository root, the package,
    the source root, or a folder above the referring file (backends/torch/backend.py may name its neighbour from
    backends/). A moved or deleted file fails here."""
    package = ROOT / "optimizer" / "accel_opt"
    sources = [*ROOT.glob("optimizer/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/**/*.py"),
               *ROOT.glob("examples/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("recipes/*.yaml"), *PAGES]
    missing = []
    for source in sources:
        text = source.read_text()
        for match in FILE_REFERENCE.finditer(text):
            line = text[text.rfind("\n", 0, match.start()) + 1:text.find("\n", match.end())]
            if any(p in line for p in PLACEHOLDERS):
                continue
            bases = [ROOT, package.parent, package, *source.parents]
            if not any((base / match.group(1)).exists() for base in bases):
                missing.append(f"{source.relative_to(ROOT)}: {match.group(1)}")
    assert not missing, missing
