"""Backend choice per call and the one place a :class:`LaunchPlan` is run.

* :func:`backend_for` picks, per call, ``"triton"`` for GPU tensors and ``"reference"`` for CPU
  tensors. ``ULTRAQUANT_BACKEND=reference|triton`` forces one (``triton`` on CPU tensors needs
  ``TRITON_INTERPRET=1`` set before the kernels are imported: that is how CI runs the kernels).
* :func:`launch` runs a plan: first through the launchers registered with
  :func:`register_launcher` (the AOT blob runtime puts itself here; a launcher returns False when it
  has no blob for the plan), then through Triton's JIT. Plans are built by
  ``ultraquant.kernels.plans``, so every path launches the same kernel with the same arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .errors import UltraQuantError
from .kernels.plan import LaunchPlan

BACKENDS = ("auto", "aot", "reference", "triton")
"""Values of ``ULTRAQUANT_BACKEND``."""

Launcher = Callable[[LaunchPlan], bool]
_launchers: list[Launcher] = []


def backend_for(device: torch.device) -> str:
    """``"triton"`` or ``"reference"`` for tensors on ``device`` (see the module docstring)."""
    forced = os.environ.get("ULTRAQUANT_BACKEND", "auto")
    if forced not in BACKENDS:
        raise UltraQuantError(f"ULTRAQUANT_BACKEND: expected one of {BACKENDS}, got {forced!r}")
    if forced != "auto":
        return forced
    return "reference" if device.type == "cpu" else "triton"


def register_launcher(launcher: Launcher, *, first: bool = True) -> None:
    """Add a launcher tried before Triton's JIT (``first``: ahead of those already registered)."""
    if launcher in _launchers:
        return
    if first:
        _launchers.insert(0, launcher)
    else:
        _launchers.append(launcher)


def unregister_launcher(launcher: Launcher) -> None:
    """Remove a launcher added by :func:`register_launcher` (no error if absent)."""
    if launcher in _launchers:
        _launchers.remove(launcher)


def launch(plan: LaunchPlan) -> None:
    """Run ``plan``: the first registered launcher that accepts it, else Triton's JIT."""
    for launcher in _launchers:
        if launcher(plan):
            return
    from .kernels import registry  # imports triton: only when a kernel really runs through it

    registry.launch(plan)


from .runtime import try_launch as _try_aot  # noqa: E402  (AOT blobs first; ultraquant.runtime)

register_launcher(_try_aot)
