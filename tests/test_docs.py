"""Every relative link of the README and of docs/*.md reaches a file, and its #anchor a heading of
that file (GitHub's anchors), so that moving a page or renaming a section cannot strand a reader."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, CODE_SPAN.sub("", line)))
    return out


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -,
    repeats numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link of ``page`` whose file or heading does not exist."""
    out = []
    for number, line in _prose(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{number}"
            if not dest.exists():
                out.append(f"{where}: {target} (no file {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{where}: {target} (no heading #{anchor} in {dest.name})")
    return out


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert (ROOT / "docs").is_dir() and len(pages()) > 2
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_a_missing_file_or_heading_is_reported_with_its_line(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text("# Title\n\nSee [a](docs/a.md#the-setup) and [b](docs/b.md).\n")
    (docs / "a.md").write_text(
        "# A\n\n## The set-up\n\n[back](../README.md#title), [here](#a), [gone](#nowhere)\n"
        "```\n[not a link](missing.md)\n```\n`[code](missing.md)` [web](https://example.com/x.md)\n"
    )
    found = [b for page in pages(tmp_path) for b in broken_links(page, tmp_path)]
    assert found == [
        "README.md:3: docs/a.md#the-setup (no heading #the-setup in a.md)",
        f"README.md:3: docs/b.md (no file {docs / 'b.md'})",
        "docs/a.md:5: #nowhere (no heading #nowhere in a.md)",
    ]
