"""``make wheel``: a wheel of the ultraquant package with the generated blobs inside it.

How the blobs enter the package namespace: the source tree is copied to a staging folder
(``.build/wheel-src``: tracked and untracked-but-not-ignored files), each built ``generated/<arch>/``
(manifest + blobs, after ``verify``) is copied to ``ultraquant/_generated/<arch>/`` there, and a
staging-only ``MANIFEST.in`` marks those files as package data (setuptools' ``include_package_data``,
on by default for pyproject projects). ``pip wheel`` then builds the staged tree. The source tree is
never modified. At run time ``ultraquant.runtime.manifest`` searches ``ultraquant/_generated`` first.

The wheel is ``py3-none-any``: the blobs are loaded by the GPU driver, not by Python. It says what it
holds: its version carries a local label ``+<arches>.<selection>`` (e.g. ``0.1.0+gfx942.popular``;
a selection other than an exact preset adds a hash of it), and it is built only when every arch's
manifest records exactly the selection asked for (the same ``MODELS=/TP=/MATRIX=/...`` as ``make
kernels``), so a stale or wider ``generated/`` is refused instead of shipped.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click

from ultraquant.errors import UltraQuantError

from .archs import parse_arch_list
from .models import make_selection, selection_label
from .verify import verify_dir

GENERATED_PACKAGE_DIR = "ultraquant/_generated"


def _source_files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True).stdout
        # ultraquant/runtime and ultraquant/codegen are links to folders: staged as links too
        return [f for f in out.decode().split("\0") if f and ((root / f).is_file() or (root / f).is_symlink())]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but build dirs
        skip = {".git", ".venv", ".build", "build", "dist", "generated"}
        return [p.relative_to(root).as_posix() for p in root.rglob("*")
                if p.is_file() and not skip.intersection(p.relative_to(root).parts)]


def local_version(archs: list[str], label: str) -> str:
    """PEP 440 local version label of a wheel holding ``archs`` built for the selection ``label``."""
    return ".".join([*(a.replace("_", "") for a in archs), label])


def check_selection(generated: Path, archs: list[str], expected: dict) -> str:
    """Raise unless every arch's manifest was built for ``expected``; the selection's label."""
    for arch in archs:
        got = json.loads((generated / arch / "manifest.json").read_text()).get("selection")
        if got != expected:
            raise UltraQuantError(
                f"{generated / arch} was built for another selection ({selection_label(got or {})}) than "
                f"this wheel asks for ({selection_label(expected)}): run `make wheel` with the same "
                "MODELS/TP/MATRIX/HEAD_SIZES/GQA/BLOCK_SIZES/DTYPES/OPS as `make kernels`, or rebuild")
    return selection_label(expected)


def _set_version(pyproject: Path, local: str) -> str:
    text = pyproject.read_text()
    m = re.search(r'^version = "([^"+]+)"$', text, re.MULTILINE)
    if m is None:
        raise UltraQuantError(f"{pyproject}: no version line to label")
    version = f"{m.group(1)}+{local}"
    pyproject.write_text(text[:m.start()] + f'version = "{version}"' + text[m.end():])
    return version


def stage_tree(root: Path, generated: Path, archs: list[str], stage: Path) -> None:
    """Copy the source tree + blobs to ``stage`` (pyproject's package list is complete: a test checks it)."""
    if stage.exists():
        shutil.rmtree(stage)
    for rel in _source_files(root):
        if rel.startswith(("generated/", f"{GENERATED_PACKAGE_DIR}/")):
            continue
        dst = stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dst, follow_symlinks=False)
    for arch in archs:
        shutil.copytree(generated / arch, stage / GENERATED_PACKAGE_DIR / arch,
                        ignore=shutil.ignore_patterns("*.tmp"))
    (stage / "MANIFEST.in").write_text(f"recursive-include {GENERATED_PACKAGE_DIR} *\n")


@click.command()
@click.option("--arch", "arch_list", required=True, help="Comma list of arches whose blobs to ship.")
@click.option("--generated", default="generated", type=click.Path(path_type=Path))
@click.option("--dist", default="dist", type=click.Path(path_type=Path))
@click.option("--stage", default=".build/wheel-src", type=click.Path(path_type=Path))
@click.option("--model", "models", default="", help="As `ultraquant build --model` (the selection to expect).")
@click.option("--tp", default="")
@click.option("--matrix", "matrix_name", default="")
@click.option("--head-sizes", default="")
@click.option("--gqa", default="")
@click.option("--block-sizes", default="")
@click.option("--dtypes", default="")
@click.option("--ops", default="")
def main(arch_list: str, generated: Path, dist: Path, stage: Path, **selection: str) -> None:
    """Verify the built blobs, check they are the selection asked for, stage the tree with them and
    build the wheel into DIST."""
    try:
        archs = [a.name for a in parse_arch_list(arch_list)]
        for arch in archs:
            report = verify_dir(generated / arch)
            if not report.ok:
                raise UltraQuantError(f"{generated / arch} fails verify:\n  " + "\n  ".join(report.problems))
        label = check_selection(generated, archs, make_selection(**selection).as_dict())
    except UltraQuantError as exc:
        raise click.ClickException(str(exc)) from None
    root = Path.cwd()
    stage_tree(root, generated.resolve(), archs, stage.resolve())
    version = _set_version(stage.resolve() / "pyproject.toml", local_version(archs, label))
    for old in dist.glob(f"ultraquant-{version}-*.whl"):
        old.unlink()
    dist.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(dist.resolve()), str(stage.resolve())], capture_output=True, text=True)
    if res.returncode:  # setuptools' data-folder warnings are noise on success; show all on failure
        raise click.ClickException(f"pip wheel failed:\n{res.stdout}\n{res.stderr}")
    for w in sorted(dist.glob(f"ultraquant-{version}-*.whl")):
        click.echo(f"{w} ({w.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
