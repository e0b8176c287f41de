"""The docs hold together: docs/README.md links every page of docs/, every relative link in README.md
and docs/ reaches an existing file (and heading), every source path a page names exists, and dated
measurements live in docs/benchmarks/ only (guides describe today's behaviour).

Reads files only. Links are Markdown's `[text](target)` outside code; anchors are GitHub's heading
slugs (lower case, punctuation dropped, spaces to hyphens, `-1`, `-2` for repeats).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "paramserver"
BENCHMARKS = DOCS / "benchmarks"

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")

# A dated measurement: a date (not a log line's timestamp) on a line with a figure and its unit.
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b(?!T)")
_FIGURE = re.compile(
    r"\d(?:[\d,.]*\d)?\s?(?:[kMG]\s?)?"
    r"(?:ms|us|µs|s|MB/s|GB/s|KiB|MiB|GiB|kB|MB|GB|rows/s|lines/s|examples/s|ex/s|x)(?![\w/])"
)

# A source path: under a package of src/paramserver, or under one of the repository's code folders.
_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.(?:py|c|yaml|toml))(?![\w/])")
_REPO_FOLDERS = ("src", "tests", "bench", "examples", "deploy", ".ci")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, in_fence = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append((number, line))
    return lines


def _links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link of a page, inline code left out."""
    found = []
    for number, line in _prose_lines(path):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                found.append((number, target))
    return found


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(path):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    file_part, _, anchor = target.partition("#")
    return (page.parent / file_part).resolve() if file_part else page, anchor


def test_every_doc_is_linked_from_the_index() -> None:
    index = DOCS / "README.md"
    linked = {_resolve(index, target)[0] for _, target in _links(index)}
    pages = {path.resolve() for path in DOCS.rglob("*.md")} - {index.resolve()}
    missing = sorted(str(path.relative_to(ROOT)) for path in pages - linked)
    assert not missing, f"docs/README.md does not link: {missing}"


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in _markdown_files():
        for number, target in _links(page):
            file, anchor = _resolve(page, target)
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{where} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _source_path_exists(path: str) -> bool:
    """A path as the docs write it: under src/paramserver when its first folder is a package there."""
    path = path.removeprefix("paramserver/")
    first = path.split("/", 1)[0]
    if first in _REPO_FOLDERS:
        return (ROOT / path).exists()
    if (SRC / first).is_dir():
        return (SRC / path).exists()
    return True  # a user's path in an example (`/app/train.py`, `models/x.py`): not ours to check


def test_every_source_path_named_exists() -> None:
    # ARCHITECTURE.md has its own, stricter test (test_architecture_doc.py).
    stale = []
    for page in _markdown_files():
        if page == DOCS / "ARCHITECTURE.md":
            continue
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for match in _PATH.finditer(line):
                if not _source_path_exists(match.group(1)):
                    stale.append(f"{page.relative_to(ROOT)}:{number}: {match.group(1)}")
    assert not stale, "paths that do not exist:\n" + "\n".join(stale)


def _dated_measurement(line: str, next_line: str = "") -> bool:
    """A date on the line, and a figure on it or on the next (a sentence wrapped after its date)."""
    return bool(_DATE.search(line) and _FIGURE.search(_DATE.sub("", f"{line} {next_line}")))


@pytest.mark.parametrize(
    ("line", "next_line", "dated"),
    [
        ("after alternated, 2026-12-05 11:00, idle machine): 9.8-13.8 -> 16.5-19.1 M rows/s", "", True),
        ("On an idle machine (2026-12-05 09:53): TCP push 3.02 GB/s against a raw socket's 3.45", "", True),
        ("Measured 2026-12-04 (2 rounds, 100,000 lines):", "exact 1 x 1 0.95, overlap 2 x 2 1.10", True),
        ('{"time": "2026-12-04T09:30:00.123456+00:00", "level": "INFO", "wait_s": 1.5}', "", False),
        ("a checkpoint written in 1.26 s; PS restore 0.28 s", "", False),
        ("Recorded 2026-12-05 (the release notes).", "Nothing else.", False),
    ],
)
def test_the_dated_measurement_rule(line: str, next_line: str, dated: bool) -> None:
    assert _dated_measurement(line, next_line) is dated


def test_no_dated_measurement_outside_benchmarks() -> None:
    found = []
    for page in _markdown_files():
        if BENCHMARKS in page.parents:
            continue
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if _dated_measurement(line, lines[number] if number < len(lines) else ""):
                found.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "dated measurements belong in docs/benchmarks/:\n" + "\n".join(found)
