"""The one backend policy: which path runs an op, and the one place a :class:`LaunchPlan` is run.

The chain is AOT blob -> Triton JIT -> reference, steered by :mod:`ultraquant.config`:

* :func:`route` names the path of a call on ``device``: ``"kernel"`` (a GPU, or CPU tensors under
  ``TRITON_INTERPRET=1`` with ``ULTRAQUANT_BACKEND=triton``, which is how CI runs the kernels; ``aot``
  always, so a CPU call is refused by the runtime) or
  ``"reference"`` (CPU tensors, or ``ULTRAQUANT_BACKEND=reference``).
* :func:`launch` runs a kernel plan: the AOT runtime first (it returns False on a miss, with the
  reason logged once; under ``aot``/``ULTRAQUANT_REQUIRE_AOT=1`` a miss raises), then Triton's JIT.
"""

from __future__ import annotations

from typing import Any

import torch

from . import config
from .kernels.plans import LaunchPlan
from .runtime import try_launch
from .runtime.launch import Prepared


def route(device: torch.device) -> str:
    """``"kernel"`` or ``"reference"`` for an op whose tensors live on ``device``."""
    mode = config.get().backend
    if mode == "reference":
        return "reference"
    if mode in ("triton", "aot"):  # aot on CPU tensors: the runtime refuses with its own message
        return "kernel"
    return "reference" if device.type == "cpu" else "kernel"


def host_reference(device: torch.device) -> bool:
    """Whether a host-side op (dequant into caller buffers) computes on the host: the route is the
    reference and, on the CPU, Triton's interpreter is off (under it the kernel runs CPU tensors)."""
    cfg = config.get()
    if route(device) != "reference":
        return False
    return cfg.backend == "reference" or not cfg.triton_interpret


def launch(plan: LaunchPlan) -> None:
    """Run ``plan``: its AOT blob when the runtime has a usable one, else Triton's JIT."""
    if try_launch(plan):
        return
    from .kernels import registry  # imports triton: only when a kernel really runs through it

    registry.jit_launch(plan)


def launch_prepared(aot: Prepared, args: tuple[Any, ...], grid: tuple[int, int, int]) -> None:
    """:func:`launch` of a plan the ops cached per call signature (``aot``: its runtime launcher)."""
    if aot(args, grid):
        return
    from .kernels import registry

    registry.jit_launch(LaunchPlan(aot.spec, args, grid))
