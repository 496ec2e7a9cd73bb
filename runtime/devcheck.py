"""``ultraquant verify --device``: load and self-test every blob of the GPU's arch now, as a table.

Unlike first-use self-tests this ignores cached verdicts (it is the on-demand check) and records the
fresh verdicts, so a blob that now passes is re-enabled and one that now fails is disabled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ultraquant.kernels.specialization import Specialization

from . import launch, selftest
from .loader import BlobError, get_kernel
from .manifest import ManifestIndex


@dataclass(frozen=True)
class Row:
    """One blob's on-device check."""

    key: str
    file: str
    status: str
    """``pass``, ``FAIL`` (self-test) or ``REFUSED`` (sha256, load or launch setup)."""
    detail: str
    ms: float


def verify_device(device: Any = None, *, keys: list[str] | None = None) -> tuple[str, list[Row]]:
    """Self-test the blobs for ``device``'s arch (all, or ``keys``); returns (arch, rows)."""
    dev = launch.device_of(device)
    d = launch.info(dev)
    idx = launch.index()
    if d.arch in idx.errors:
        return d.arch, [Row("-", "manifest.json", "REFUSED", idx.errors[d.arch], 0.0)]
    rows = []
    for key, entry in sorted(idx.entries.get(d.arch, {}).items()):
        if keys is not None and key not in keys:
            continue
        t0 = time.perf_counter()
        try:
            kernel = get_kernel(entry, dev)
        except BlobError as exc:
            rows.append(Row(key, entry.path.name, "REFUSED", str(exc), (time.perf_counter() - t0) * 1e3))
            continue
        spec = Specialization(kernel=entry.kernel, signature=entry.signature, constexprs=entry.constexprs,
                              divisible=entry.divisible)
        v = selftest.run(kernel, spec, d)
        rows.append(Row(key, entry.path.name, "pass" if v.ok else "FAIL", v.detail,
                        (time.perf_counter() - t0) * 1e3))
    launch.reset(idx)  # fresh verdicts take effect for later calls in this process
    return d.arch, rows


def format_table(arch: str, device_name: str, rows: list[Row]) -> str:
    """Plain-text table of ``rows`` with a summary line."""
    width = max([len(r.key) for r in rows] + [6])
    lines = [f"{'config':<{width}}  {'status':<7}  {'ms':>7}  detail"]
    lines += [f"{r.key:<{width}}  {r.status:<7}  {r.ms:7.1f}  {r.detail}" for r in rows]
    bad = sum(r.status != "pass" for r in rows)
    lines.append(f"{len(rows)} blobs for {arch} on {device_name}: {len(rows) - bad} pass, {bad} failed or refused")
    return "\n".join(lines)


def cli_verify_device(device: str, dirs: list[Path] | None = None) -> int:
    """``ultraquant verify --device [INDEX]``: print the table; exit status 0 only if all pass.

    ``dirs`` (generated/<arch> folders) replace the default manifest search when given."""
    import click
    import torch

    if not torch.cuda.is_available():
        click.echo("verify --device: no GPU visible to torch", err=True)
        return 2
    text = str(device).split(":")[-1]
    if device not in ("", "current") and not text.isdigit():
        click.echo(f"verify --device: expected a GPU index such as 0 or cuda:1, got {device!r}", err=True)
        return 2
    dev = torch.cuda.current_device() if device in ("", "current") else int(text)
    if dirs:
        from .manifest import MANIFEST_NAME, read_manifest

        launch.reset(ManifestIndex([read_manifest(Path(d) / MANIFEST_NAME) for d in dirs]))
    d = launch.info(dev)
    arch, rows = verify_device(dev)
    if not rows:
        click.echo(f"no blobs for {arch} ({d.name}); nothing to self-test", err=True)
        return 1
    click.echo(format_table(arch, f"cuda:{dev} {d.name}", rows))
    return 0 if all(r.status == "pass" for r in rows) else 1
