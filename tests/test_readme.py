"""The README's copy-paste Python example runs as written, and the docs it points at exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_readme_example_runs() -> None:
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 1, "the README has one copy-paste Python example"
    # a fresh interpreter, as a reader pasting it would have; the checkout on the path
    res = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = re.search(r"torch.Size\(\[2, 32, 128\]\) cosine vs unquantized attention: ([0-9.]+)", res.stdout)
    assert m, res.stdout
    assert 0.95 < float(m.group(1)) < 1.0  # 4-bit K/V: close to, not equal to, exact attention
    readme = (ROOT / "README.md").read_text()
    assert f"It prints `{m.group(0)}`" in readme, "the README quotes the example's output"


def test_docs_named_in_code_and_readme_exist() -> None:
    named: set[str] = set()
    sources = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("ultraquant/**/*.py"),
               *ROOT.glob("codegen/**/*.py"), *ROOT.glob("tests/*.py")]
    for path in sources:
        named |= set(re.findall(r"(?<!shared )\bdocs/[a-z_]+\.md\b", path.read_text()))  # shared/: outside
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"named but missing: {missing}"
    assert "docs/format.md" in named


def test_format_doc_slot_table_matches_the_code() -> None:
    from ultraquant.format import SlotLayout, slot_size

    text = (ROOT / "docs" / "format.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+)\.\.(\d+) \| (\d+)\.\.(\d+) \| (\d+)\.\.(\d+) \| (\d+)\.\.(\d+) \| (\d+) \|$",
                      text, re.MULTILINE)
    assert len(rows) == 4
    for row in rows:
        d, *offsets, size = map(int, row)
        lay = SlotLayout(d)
        starts = offsets[0::2]
        assert starts == [lay.k_codes, lay.k_scales, lay.v_codes, lay.v_scales] and size == slot_size(d)
