"""UltraQuant's run-time side of the AOT path: find generated blobs, load and launch them.

Installed as ``ultraquant.runtime`` (the source lives in the top-level ``runtime/`` folder).
The backend policy calls :func:`try_launch` per op call; :func:`warmup` loads a model's blobs before CUDA graph
capture (``ultraquant.warmup`` expands model configs first); ``devcheck`` self-tests every blob of the GPU's arch
(``ultraquant verify --device``).
Importing this package imports neither Triton nor a GPU driver: the driver is bound on first use.
"""

from .launch import reset, try_launch, warmup

__all__ = ["reset", "try_launch", "warmup"]
