"""Offline sm_90 compile of the whole-page decode checked for misaligned or out-of-range ring accesses (the faults
of round 2's first H200 run): ``tools/wholepage_align_check.py`` on the default and the 16-M-row builds, in a
subprocess without ``TRITON_INTERPRET`` (the suite's interpreter mode cannot compile Gluon)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args", [["gqa=4", "num_kv_heads=8", "block_size=64"],
                                  ["gqa=16", "num_kv_heads=1", "block_size=16", "has_window=true", "L=2048"],
                                  ["head_size=256", "gqa=8", "num_kv_heads=2", "block_size=64"]])
def test_v8_ring_accesses_aligned_and_in_bounds(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "wholepage_align_check.py"), *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
