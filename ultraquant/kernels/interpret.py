"""Run the Triton kernels on CPU tensors through Triton's interpreter (tests, CI, debugging).

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is *defined*, so the kernel modules must
be (re)imported after it is set. :func:`interpreted_registry` does that once per process and returns
the registry whose kernels accept CPU tensors. Mixing interpreted and compiled kernels in one process
is not supported: call it only in CPU-only processes (tests, CI).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from .catalog import source_modules


def interpreted_registry() -> ModuleType:
    """Set ``TRITON_INTERPRET=1`` and (re)import the kernel modules so they run on the CPU."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    registry = sys.modules.get("ultraquant.kernels.registry")
    if registry is not None and all(isinstance(f, InterpretedFunction) for f in registry.KERNELS.values()):
        return registry
    for name in ("triton.common", *source_modules(), "registry"):
        full = f"ultraquant.kernels.{name}"
        if full in sys.modules:
            importlib.reload(sys.modules[full])
        else:
            importlib.import_module(full)
    return sys.modules["ultraquant.kernels.registry"]
