"""``ultraquant build --arch ...``: compile the AOT blobs and manifests (what ``make kernels`` runs).

What to build: ``--model`` config.json files or the ``popular`` preset (the default), or ``--matrix
full`` / ``--head-sizes``/``--gqa`` for a product of axes (codegen/models.py ``make_selection``).
Needs the build toolchain (Triton 3.6.0, and for the FlyDSL rows flydsl + an ld.lld/llvm-objdump,
found without root by codegen/toolchain.py); ``make kernels`` sets up ``.build/venv``. A missing tool
is a one-paragraph error before anything compiles. See docs/codegen.md.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from ultraquant.errors import UltraQuantError


def _progress(total: int, label: str):
    bar = click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True)
    bar.__enter__()

    def update(n: int) -> None:
        bar.update(n)
        if bar.pos >= bar.length:
            bar.__exit__(None, None, None)

    return update


def _rows_in_use(archs, rows, ops) -> list:
    """Rows of the matrix the selected arches and ops build."""
    return [r for r in rows if (ops is None or r.op in ops)
            and any(r.archs is None or a.name in r.archs for a in archs)]


def _install_deps(archs, rows, ops, system: bool) -> None:
    """pip-install the used backends' requirements (into this environment: no root); with ``system``,
    also apt-install their system packages that are missing (needs root)."""
    from ultraquant.codegen.backends import load_backend

    for name in sorted({r.backend for r in _rows_in_use(archs, rows, ops)}):
        backend = load_backend(name)
        if backend.requirements():
            res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *backend.requirements()])
            if res.returncode:
                raise UltraQuantError(f"pip install {' '.join(backend.requirements())} failed (exit {res.returncode})")
        packages = backend.system_packages()
        if system and packages:
            if shutil.which("apt-get") is None:
                raise UltraQuantError(f"--install-system-deps uses apt-get, which this machine lacks; install "
                                      f"{' '.join(packages)} (LLVM >= 19 ld.lld, LLVM 22 llvm-objdump) another way")
            for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *packages]):
                res = subprocess.run(cmd)
                if res.returncode:
                    raise UltraQuantError(f"`{' '.join(cmd)}` failed (exit {res.returncode}); it needs root. "
                                          "Without root see the FlyDSL tool search in docs/codegen.md")


def _preflight(archs, rows, ops) -> None:
    """Fail before compiling, with what to do, when a tool the selected rows need is missing."""
    used = {r.backend for r in _rows_in_use(archs, rows, ops)}
    if "triton" in used and importlib.util.find_spec("triton") is None:
        raise UltraQuantError("building blobs needs Triton 3.6.0 (the compiler of the Triton rows), which this "
                              "Python lacks: in a source checkout run `make kernels ARCH=...` (it sets up "
                              ".build/venv), or `pip install triton==3.6.0` here. Installed blobs need no Triton.")
    if "flydsl" in used:
        from ultraquant.codegen.toolchain import check_flydsl_tools

        gfx = [a.name for a in archs if a.is_amd]
        problems = check_flydsl_tools(gfx)
        if problems:
            raise UltraQuantError(problems[0])


def _selection_summary(selection) -> str:
    n = len(selection.attention) if selection.attention is not None else None
    if selection.attention is not None:
        models = (f"{len(selection.models)} models" if selection.preset == "popular"
                  else ", ".join(selection.models))
        return (f"selection {selection.preset}: {models}; TP {','.join(map(str, selection.tp))}; block sizes "
                f"{','.join(map(str, selection.block_sizes))} -> {n} attention configs (head sizes "
                f"{','.join(map(str, selection.head_sizes))}, GQA {','.join(map(str, selection.gqa))})")
    return (f"selection {selection.preset}: head sizes {','.join(map(str, selection.head_sizes))}, GQA "
            f"{','.join(map(str, selection.gqa))}, block sizes {','.join(map(str, selection.block_sizes))}, "
            f"dtypes {','.join(selection.dtypes)} (every combination)")


@click.command()
@click.option("--arch", "arch_list", required=True, help="Comma list: gfx942,gfx950,sm_90.")
@click.option("--model", "models", default="",
              help="Comma list of Hugging Face config.json files (or model folders), or 'popular' (the default "
                   "when no --matrix/--head-sizes/--gqa is given): build exactly what they need.")
@click.option("--tp", default="", help="Tensor-parallel degrees for --model (default 1,2,4,8).")
@click.option("--matrix", "matrix_name", default="", help="'full': every combination of the axes below.")
@click.option("--head-sizes", default="", help="Comma list (matrix default 64,128,256,512).")
@click.option("--gqa", default="", help="Comma list of GQA ratios (matrix default 1,4,5,6,8,16).")
@click.option("--block-sizes", default="", help="Comma list (models: 16, vLLM's default; matrix: 16,32,64,128).")
@click.option("--dtypes", default="", help="Comma list (default: the models' dtypes; matrix: bf16).")
@click.option("--ops", default="", help="Comma list of ops to build (default: all rows of the matrix).")
@click.option("--kv-heads", default="", help="Comma list of the whole-page decode's kv-head counts (default 1,2,4,8).")
@click.option("--out", "out_dir", default="generated", type=click.Path(path_type=Path),
              help="Output root; blobs go to OUT/<arch>/.")
@click.option("--cache-dir", default=".build/cache", type=click.Path(path_type=Path),
              help="Incremental compile cache.")
@click.option("--no-cache", is_flag=True, help="Compile everything (and do not fill the cache).")
@click.option("-j", "--jobs", default=0, type=int, help="Parallel compiles (default: CPU count).")
@click.option("--install-deps", is_flag=True, help="First pip-install what the used backends need (no root).")
@click.option("--install-system-deps", is_flag=True,
              help="Also apt-get install the FlyDSL rows' lld-19/llvm-22 when missing (needs root).")
@click.option("--deps-only", is_flag=True, help="With --install-deps: install them and build nothing.")
@click.option("--dry-run", is_flag=True, help="Only print what would be built (counts, cache hits, skips).")
@click.option("--timings", type=click.Path(path_type=Path), default=None,
              help="Append one JSON line per compile (arch, op, key, seconds) to this file.")
def command(arch_list: str, models: str, tp: str, matrix_name: str, head_sizes: str, gqa: str, block_sizes: str,
            dtypes: str, ops: str, kv_heads: str, out_dir: Path, cache_dir: Path, no_cache: bool, jobs: int,
            install_deps: bool, install_system_deps: bool, deps_only: bool, dry_run: bool,
            timings: Path | None) -> None:
    """Compile the selected specializations for each arch into OUT/<arch>/ + manifest.json."""
    from ultraquant.codegen import matrix
    from ultraquant.codegen.archs import parse_arch_list
    from ultraquant.codegen.models import make_selection

    try:
        archs = parse_arch_list(arch_list)
        selection = make_selection(models=models, tp=tp, matrix_name=matrix_name, head_sizes=head_sizes,
                                   gqa=gqa, block_sizes=block_sizes, dtypes=dtypes, ops=ops, kv_heads=kv_heads)
        click.echo(_selection_summary(selection), err=True)
        if selection.notes:
            shown = selection.notes if dry_run else ()
            click.echo(f"  {len(selection.notes)} model/TP pairs vLLM cannot shard are left out"
                       + ("" if dry_run else " (--dry-run lists them)"), err=True)
            for note in shown:
                click.echo(f"  left out: {note}", err=True)
        if install_deps or install_system_deps:
            _install_deps(archs, matrix.OPS, selection.ops, install_system_deps)
        if deps_only:
            return
        _preflight(archs, matrix.OPS, selection.ops)
        from ultraquant.codegen.build import BuildOptions, build
        from ultraquant.codegen.build import dry_run as plan

        opts = BuildOptions(archs=archs, selection=selection, out_dir=out_dir,
                            cache_dir=None if no_cache else cache_dir, jobs=jobs, timings=timings,
                            progress=_progress)
        if dry_run:
            for r in plan(opts):
                per_op = ", ".join(f"{k} {v}" for k, v in r["per_op"].items())
                click.echo(f"{r['arch']}: {r['blobs']} blobs ({per_op}); {r['cached']} in the cache")
                for reason, n in r["skipped"].items():
                    click.echo(f"  skipped {n}: {reason}")
            return
        start = time.monotonic()
        results = build(opts)
    except UltraQuantError as exc:
        raise click.ClickException(str(exc)) from None
    elapsed = time.monotonic() - start
    for r in results:
        click.echo(f"{r.arch}: {r.blobs} blobs ({r.compiled} compiled, {r.cached} cached, "
                   f"{r.skipped} configs skipped), {r.bytes / 1e6:.2f} MB in {r.directory}")
    click.echo(f"built in {elapsed:.1f} s")
