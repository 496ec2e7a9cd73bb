"""NVIDIA-only kernels written in Triton's Gluon (explicit layouts, async copies); import needs triton."""
