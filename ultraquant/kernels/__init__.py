"""UltraQuant kernels.

``plan`` / ``plans`` describe launches without importing Triton (the AOT runtime uses them);
``store``, ``dequant``, ``attention`` hold the Triton sources and ``registry`` maps kernel names to
them. Nothing here imports Triton at package import time.
"""
