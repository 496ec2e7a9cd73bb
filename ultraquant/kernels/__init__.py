"""UltraQuant kernels: every kernel source and its launch description (docs/architecture.md).

``catalog`` lists the families; ``families/`` holds one module per family (parameters, spec, coverage
rule, plan); ``triton/``, ``gluon/`` and ``flydsl/`` hold the sources; ``plans`` routes a call to its
family; ``registry`` maps kernel names to Triton functions. Nothing here imports Triton at package
import time (only ``registry`` and the sources do).
"""
