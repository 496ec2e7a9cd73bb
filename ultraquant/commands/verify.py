"""``ultraquant verify [DIR ...]``: check generated blobs offline against their manifests.

With no DIR, every manifest this install can find (``ULTRAQUANT_GENERATED``, the wheel's
``ultraquant/_generated``, the checkout's ``generated/``) is checked. Exit status 1 and one line per
problem on any mismatch. Needs neither a GPU nor the build toolchain.
"""

from __future__ import annotations

from pathlib import Path

import click


def _default_dirs() -> list[Path]:
    from ultraquant.runtime.manifest import find_manifests

    return [m.directory for m in find_manifests()]


@click.command()
@click.argument("dirs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--device", is_flag=False, flag_value="current", default=None, metavar="[INDEX]",
              help="Instead: self-test every blob of this GPU's arch on the GPU (0, 1, cuda:1...).")
def command(dirs: tuple[Path, ...], device: str | None = None) -> None:
    """Verify every blob of each DIR (a generated/<arch>/ folder holding manifest.json)."""
    if device is not None:  # on-device self-tests: ultraquant.runtime (docs/runtime.md)
        from ultraquant.runtime.devcheck import cli_verify_device

        raise SystemExit(cli_verify_device(device, list(dirs)))
    from ultraquant.codegen.verify import verify_dir

    targets = list(dirs) or _default_dirs()
    if not targets:
        raise click.ClickException("no manifests found: pass a generated/<arch> folder, or build blobs "
                                   "with `make kernels ARCH=...`")
    failed = 0
    for directory in targets:
        report = verify_dir(directory)
        if report.ok:
            click.echo(f"OK    {report.arch}: {report.blobs} blobs in {directory}")
            continue
        failed += 1
        click.echo(f"FAIL  {report.arch}: {len(report.problems)} problem(s) in {directory}", err=True)
        for problem in report.problems:
            click.echo(f"  {problem}", err=True)
    if failed:
        raise SystemExit(1)
