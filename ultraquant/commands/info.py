"""``ultraquant info``: version, toolchains, the GPU, and the blobs this install can find: per arch the
selection they were built for (preset, models, TP) and the attention configs inside."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

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


MAX_GROUPS = 24
"""Config groups printed per arch without ``--configs``."""


def _features(c: dict[str, Any]) -> str:
    on = [n for n, k in (("sinks", "has_sinks"), ("softcap", "has_softcap"), ("window", "has_window")) if c.get(k)]
    return "+".join(on) or "plain"


def config_groups(blobs: list[dict[str, Any]]) -> list[str]:
    """The attention configs of a manifest's blobs, one line per (head size, block size, dtype, features)
    with its GQA ratios, and which ops have them."""
    groups: dict[tuple, dict[str, set]] = {}
    for b in blobs:
        c = b.get("config", {})
        if "gqa" not in c:
            continue
        key = (c["head_size"], c.get("block_size"), c.get("query_dtype", c.get("dtype")), _features(c))
        g = groups.setdefault(key, {"gqa": set(), "ops": set()})
        g["gqa"].add(c["gqa"])
        g["ops"].add(b.get("op", "?"))
    return [f"D={d} block {bs} {dt} {feat}: GQA {','.join(map(str, sorted(g['gqa'])))} "
            f"({', '.join(sorted(g['ops']))})"
            for (d, bs, dt, feat), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0,
                                                                            str(kv[0][2]), kv[0][3]))]


def _selection_text(sel: dict[str, Any]) -> str:
    from ultraquant.codegen.models import selection_label

    label = selection_label(sel)
    if sel.get("attention") is not None:
        models = sel.get("models") or []
        who = f"{len(models)} models" if len(models) > 3 else ", ".join(models)
        return f"{label}: {who}, TP {','.join(map(str, sel.get('tp') or []))}"
    return f"{label}: every combination of its axes"


@click.command()
@click.option("--configs", "all_configs", is_flag=True, help="List every attention config group of every arch.")
def command(all_configs: bool) -> None:
    """Print the version, toolchain availability, the GPU and the blobs found (with their configs)."""
    from ultraquant.runtime.manifest import find_manifests

    try:
        dist = importlib.metadata.version("ultraquant")
    except importlib.metadata.PackageNotFoundError:
        dist = "not installed (source checkout)"
    click.echo(f"ultraquant {ultraquant.__version__} (distribution {dist})")
    click.echo(f"torch      {torch.__version__}")
    click.echo(f"triton     {_version_of('triton')}")
    click.echo(f"flydsl     {_version_of('flydsl')}")
    click.echo(f"gpu        {_gpu_description()}")
    manifests = find_manifests()
    if not manifests:
        click.echo("blobs      none found (run `make kernels ARCH=...` or install a wheel with blobs)")
    for m in manifests:
        click.echo(f"blobs      {m.arch}: {len(m.blobs)} in {m.directory}")
        sel = m.data.get("selection")
        if isinstance(sel, dict):
            click.echo(f"  built for  {_selection_text(sel)}")
        lines = config_groups(m.blobs)
        shown = lines if all_configs or len(lines) <= MAX_GROUPS else lines[:MAX_GROUPS]
        for line in shown:
            click.echo(f"  configs    {line}")
        if len(shown) < len(lines):
            click.echo(f"  configs    ... {len(lines) - len(shown)} more groups (ultraquant info --configs)")
