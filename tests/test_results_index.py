"""benchmarks/results/README.md lists every results file, and every results file that README.md or
docs/ cite exists (a figure must name the file that produced it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CITE = re.compile(r"benchmarks/results/([A-Za-z0-9_.\-]+[A-Za-z0-9_\-])(?![{\w.\-])")


def test_the_index_lists_every_results_file():
    index = (RESULTS / "README.md").read_text()
    listed = set(re.findall(r"^- `([^`]+)`", index, flags=re.M))
    files = {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"}
    assert files - listed == set(), "add these to benchmarks/results/README.md"
    assert listed - files == set(), "benchmarks/results/README.md lists files that do not exist"


def test_every_cited_results_file_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {(d.name, name) for d in docs for name in CITE.findall(d.read_text())
               if name != "README.md" and not (RESULTS / name).is_file()}
    assert missing == set()
