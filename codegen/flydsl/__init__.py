"""FlyDSL backend of the AOT generator: the UltraQuant decode kernels for gfx942/gfx950 (CDNA3/4).

- :mod:`.decode`: the kernel source (imports flydsl; only the compile path loads it).
- :mod:`.compiler`: FlyDSL environment + ``flyc.compile`` + HSACO extraction.
- :mod:`.backend`: :class:`~.backend.FlyDSLBackend`, the generator's seam (specialize/compile).
- :mod:`.isa`: the ISA checks ``ultraquant verify`` runs on every FlyDSL blob (MFMA instructions in
  the disassembly, occupancy from the VGPR count); no flydsl needed.
- :mod:`.compile_kernel`: one compile in a subprocess, from the command line (tests, debugging).

The lane layout every kernel uses is defined (and emulated on the CPU) in
:mod:`ultraquant.kernels.flydsl.layout`; docs/flydsl.md derives it.
"""
