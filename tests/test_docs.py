"""The docs stand alone: every relative link in the README and under docs/ leads to a file of the repository (and
to a heading of it, for a link with an anchor; a link out of the repository is an error), and the README stays an
entry page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands, not links
    problems = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading '#{anchor}' in {file.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_leads_to_a_file_and_heading_of_the_repository(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_a_missing_heading_and_a_way_out(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "training.md").write_text("# Training\n## Resuming a run\n")
    page = tmp_path / "docs" / "probe.md"
    page.write_text("# Probe\n[a](nope.md) [b](training.md#no-such-heading) [c](../../x.md) [d](#probe)\n"
                    "[e](https://example.org) ![f](missing.png) [g](training.md#resuming-a-run)\n"
                    "```\n[h](inside-a-code-block.md)\n```\n")
    assert broken_links(page, tmp_path) == [
        "nope.md: no such file", "training.md#no-such-heading: no heading '#no-such-heading' in docs/training.md",
        "../../x.md: outside the repository", "missing.png: no such file"]


def test_the_readme_is_an_entry_page() -> None:
    """At most ~200 lines: what satlab is, the two commands, a quick start, links; the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert any("make train" in line for line in lines[:60]) and any("make test" in line for line in lines[:60])
