"""pyproject's package list covers every package folder, so a non-editable install imports them all."""

from __future__ import annotations

import os
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_package_list_matches_the_tree() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = set()
    for parent, _, files in os.walk(ROOT / "ultraquant", followlinks=True):  # runtime/, codegen/: links
        if "__init__.py" in files:
            on_disk.add(".".join(Path(parent).relative_to(ROOT).parts))
    assert set(cfg["packages"]) == on_disk


def test_runtime_and_codegen_links_point_at_the_design_card_folders() -> None:
    for name in ("runtime", "codegen"):
        link = ROOT / "ultraquant" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()
