"""``ultraquant bench``'s AOT-vs-JIT rows: one decode timed through each backend, env restored (CPU:
the timing itself is replaced, the backend switching is what is tested)."""

from __future__ import annotations

import pytest

from ultraquant import config
from ultraquant.bench import decode as bench
from ultraquant.errors import UltraQuantError


@pytest.mark.parametrize("aot_serves", [True, False])
def test_aot_vs_jit_times_both_backends_and_restores_the_switch(monkeypatch, aot_serves):
    seen = []

    def fake_decode(p, d):
        seen.append(config.get().backend)
        if config.get().backend == "aot" and not aot_serves:
            raise UltraQuantError("no sm_90 blob for config uq_decode_splitkv[...]")
        return {"triton": 100.0, "aot": 101.5}[config.get().backend]

    monkeypatch.setattr(bench, "bench_decode", fake_decode)
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "auto")
    jit_us, aot_us = bench.bench_aot_vs_jit(None, 128)
    assert seen == ["triton", "aot"] and jit_us == 100.0
    assert aot_us == 101.5 if aot_serves else "no sm_90 blob" in aot_us
    assert config.get().backend == "auto"
