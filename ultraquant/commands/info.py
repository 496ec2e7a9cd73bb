"""``ultraquant info``: version, toolchains, the GPU, and the blobs this install can find."""

from __future__ import annotations

import importlib.util

import click
import torch

import ultraquant


def _gpu_description() -> str:
    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = getattr(props, "gcnArchName", "") or f"sm_{props.major}{props.minor}"
    return f"{props.name} ({arch.split(':')[0]})"


def _version_of(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # a broken install is worth reporting, not crashing on
        return f"broken ({type(exc).__name__}: {exc})"


@click.command()
def command() -> None:
    """Print the version, toolchain availability, the GPU and the blobs found."""
    from ultraquant.runtime.manifest import find_manifests

    click.echo(f"ultraquant {ultraquant.__version__}")
    click.echo(f"torch      {torch.__version__}")
    click.echo(f"triton     {_version_of('triton')}")
    click.echo(f"flydsl     {_version_of('flydsl')}")
    click.echo(f"gpu        {_gpu_description()}")
    manifests = find_manifests()
    if not manifests:
        click.echo("blobs      none found (run `make kernels ARCH=...` or install a wheel with blobs)")
    for m in manifests:
        click.echo(f"blobs      {m.arch}: {len(m.blobs)} in {m.directory}")
