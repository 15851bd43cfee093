"""The README's benchmark headlines are figures docs/benchmarks.md reports, and its links
lead somewhere: the front page cannot quote a figure the benchmarks page no longer has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()
FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?: ?(?:ms|us|s|%|x)\b|%)")


def section(text: str, heading: str) -> str:
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_every_benchmark_headline_is_a_figure_of_the_benchmarks_page() -> None:
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    headlines = [row for row in section(README, "Benchmarks").splitlines() if row.count("|") > 3]
    figures = {f for row in headlines[2:] for f in FIGURE.findall(row.rsplit("|", 2)[1])}
    assert len(figures) >= 10
    assert not {f for f in figures if f not in benchmarks}


def test_every_relative_link_names_a_file_of_the_repository() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name} links {target}"
