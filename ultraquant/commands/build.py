"""``ultraquant build --arch ...``: compile the AOT blobs and manifests (what ``make kernels`` runs).

Needs the build toolchain (Triton 3.6.0, and FlyDSL for its rows); ``make kernels`` sets up a venv
with it under ``.build/venv``. See docs/codegen.md.
"""

from __future__ import annotations

import os
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


def _install_deps(archs, rows, ops) -> None:
    """Install the pip requirements and Debian packages of the backends the selected rows use."""
    from ultraquant.codegen.backends import load_backend

    names = sorted({r.backend for r in rows if (ops is None or r.op in ops)
                    and any(r.archs is None or a.name in r.archs for a in archs)})
    for name in names:
        backend = load_backend(name)
        if backend.requirements():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", *backend.requirements()], check=True)
        missing = [p for p in backend.system_packages()
                   if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
        if missing and os.geteuid() != 0:
            click.echo(f"not root: install the Debian packages {' '.join(missing)} yourself "
                       f"(the {name} compile and ISA checks need them)", err=True)
        elif missing:
            subprocess.run(["apt-get", "update", "-q"], check=True)
            subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True)


@click.command()
@click.option("--arch", "arch_list", required=True, help="Comma list: gfx942,gfx950,sm_90.")
@click.option("--head-sizes", default="", help="Comma list (default 64,128,256,512).")
@click.option("--gqa", default="", help="Comma list of GQA ratios (default 1,4,5,6,8,16).")
@click.option("--block-sizes", default="", help="Comma list (default 16,32,64,128).")
@click.option("--dtypes", default="", help="Comma list (default bf16).")
@click.option("--ops", default="", help="Comma list of ops to build (default: all rows of the matrix).")
@click.option("--out", "out_dir", default="generated", type=click.Path(path_type=Path),
              help="Output root; blobs go to OUT/<arch>/.")
@click.option("--cache-dir", default=".build/cache", type=click.Path(path_type=Path),
              help="Incremental compile cache.")
@click.option("--no-cache", is_flag=True, help="Compile everything (and do not fill the cache).")
@click.option("-j", "--jobs", default=0, type=int, help="Parallel compiles (default: CPU count).")
@click.option("--install-deps", is_flag=True, help="First install what the used backends need.")
@click.option("--deps-only", is_flag=True, help="With --install-deps: install them and build nothing.")
@click.option("--dry-run", is_flag=True, help="Only print what would be built (counts, cache hits, skips).")
@click.option("--timings", type=click.Path(path_type=Path), default=None,
              help="Append one JSON line per compile (arch, op, key, seconds) to this file.")
def command(arch_list: str, head_sizes: str, gqa: str, block_sizes: str, dtypes: str, ops: str,
            out_dir: Path, cache_dir: Path, no_cache: bool, jobs: int, install_deps: bool,
            deps_only: bool, dry_run: bool, timings: Path | None) -> None:
    """Compile every specialization of the matrix for each arch into OUT/<arch>/ + manifest.json."""
    from ultraquant.codegen import matrix
    from ultraquant.codegen.archs import parse_arch_list
    from ultraquant.codegen.build import BuildOptions, build

    try:
        archs = parse_arch_list(arch_list)
        selection = matrix.Selection(
            head_sizes=matrix.parse_int_list(head_sizes, "HEAD_SIZES", matrix.DEFAULT_HEAD_SIZES),
            gqa=matrix.parse_int_list(gqa, "GQA", matrix.DEFAULT_GQA),
            block_sizes=matrix.parse_int_list(block_sizes, "BLOCK_SIZES", matrix.DEFAULT_BLOCK_SIZES),
            dtypes=matrix.parse_str_list(dtypes, "DTYPES", matrix.DEFAULT_DTYPES),
            ops=matrix.parse_str_list(ops, "OPS", None),
        )
        if dry_run:
            from ultraquant.codegen.build import dry_run as plan

            opts = BuildOptions(archs=archs, selection=selection, out_dir=out_dir,
                                cache_dir=None if no_cache else cache_dir)
            for r in plan(opts):
                ops = ", ".join(f"{k} {v}" for k, v in r["per_op"].items())
                click.echo(f"{r['arch']}: {r['blobs']} blobs ({ops}); {r['cached']} in the cache")
                for reason, n in r["skipped"].items():
                    click.echo(f"  skipped {n}: {reason}")
            return
        if install_deps:
            _install_deps(archs, matrix.OPS, selection.ops)
        if deps_only:
            return
        start = time.monotonic()
        results = build(BuildOptions(archs=archs, selection=selection, out_dir=out_dir,
                                     cache_dir=None if no_cache else cache_dir, jobs=jobs, timings=timings,
                                     progress=_progress))
    except UltraQuantError as exc:
        raise click.ClickException(str(exc)) from None
    elapsed = time.monotonic() - start
    for r in results:
        click.echo(f"{r.arch}: {r.blobs} blobs ({r.compiled} compiled, {r.cached} cached, "
                   f"{r.skipped} configs skipped), {r.bytes / 1e6:.2f} MB in {r.directory}")
    click.echo(f"built in {elapsed:.1f} s")
