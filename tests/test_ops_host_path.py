"""Issue 17, item 7: the cached host path of the eager ops. The first call of a signature validates and
plans; later calls reuse the plan with their own tensors, and anything that changes the launch (an
option's value, a shape or stride, the config, a runtime reset) plans again. Value checks still run on
every call where they run at all. Launches are recorded, not run (Triton JIT replaced by a recorder,
or the fake driver of test_runtime for the AOT path); performance is measured by
``ultraquant bench --host``, not here.
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.test_runtime import FakeDriver, rt, write_manifest  # noqa: F401  (rt: fixture)
from ultraquant import ops, validate
from ultraquant.errors import UltraQuantError
from ultraquant.kernels import plans, registry
from ultraquant.kernels.families import decode_splitkv as splitkv_family
from ultraquant.runtime import launch

HQ, HK, D, BS = 8, 2, 64, 16


@pytest.fixture
def recorded(monkeypatch):
    """JIT launches recorded (CPU tensors take the kernel route), plan and validation calls counted."""
    launches, counts = [], {"plan_decode": 0, "plan_store": 0, "check_decode": 0, "check_store": 0}
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")
    monkeypatch.setattr(registry, "jit_launch", launches.append)

    def counting(name, fn):
        def counted(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return counted

    for mod, name in ((plans, "plan_decode"), (plans, "plan_store"), (validate, "check_decode"),
                      (validate, "check_store")):
        monkeypatch.setattr(mod, name, counting(name, getattr(mod, name)))
    ops.forget_prepared()
    yield launches, counts
    ops.forget_prepared()


def problem(b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(8, BS, HK, uq.slot_size(D), dtype=torch.uint8)
    return dict(q=torch.randn(b, HQ, D, generator=g), cache=cache,
                bt=torch.arange(4 * b, dtype=torch.int32).reshape(b, 4) % 8,
                lens=torch.full((b,), 20, dtype=torch.int32), out=torch.empty(b, HQ, D))


def arg(name: str) -> int:
    """Position of a decode kernel parameter in a plan's args."""
    return [n for n, _ in splitkv_family.DECODE_PARAMS].index(name)


def decode(p, **kw):
    return uq.decode_attention(p["q"], p["cache"], p["bt"], p["lens"], kw.pop("scale", 0.125), out=p["out"], **kw)


def same_launch(got, want):
    """Same spec and grid, and the same arguments: tensors by identity, scalars by value."""
    assert got.spec.key() == want.spec.key() and got.grid == want.grid
    assert len(got.args) == len(want.args)
    for a, b in zip(got.args, want.args, strict=True):
        assert (a is b) if isinstance(a, torch.Tensor) else (a == b and type(a) is type(b)), (a, b)


def test_second_call_reuses_the_plan_with_its_own_tensors(recorded, monkeypatch):
    launches, counts = recorded
    monkeypatch.setattr(validate, "values_checkable", lambda *t: False)  # as for GPU tensors
    decode(problem(seed=0))
    p1 = problem(seed=1)
    decode(p1)
    decode(p1)
    assert counts["plan_decode"] == 1 and counts["check_decode"] == 1 and len(launches) == 3
    want = plans.plan_decode(p1["q"], p1["cache"], p1["bt"], p1["lens"], 0.125, None, None, None, p1["out"])
    same_launch(launches[1], want)
    same_launch(launches[2], want)


def test_anything_that_changes_the_launch_plans_again(recorded, monkeypatch):
    launches, counts = recorded
    p = problem()
    decode(p)
    decode(p, scale=0.25)
    decode(p, sliding_window=8)
    decode(p, softcap=30.0)
    decode(problem(b=3))
    assert counts["plan_decode"] == 5
    assert [lp.args[arg("scale")] for lp in launches[:2]] == [0.125, 0.25]
    monkeypatch.setenv("ULTRAQUANT_DECODE_SPLITS", "3")  # a config change: every signature plans anew
    decode(p)
    assert counts["plan_decode"] == 6 and launches[-1].grid[2] == 3


def test_value_checks_still_run_on_every_call(recorded):
    launches, counts = recorded
    p = problem()
    decode(p)
    decode(p)
    assert counts["check_decode"] == 2 and counts["plan_decode"] == 1  # CPU tensors: values checked
    p["bt"][0, 1] = 99  # same signature, a block id past the cache
    with pytest.raises(UltraQuantError, match="block id 99"):
        decode(p)
    assert len(launches) == 2


def test_static_mistakes_are_still_caught_after_a_cached_call(recorded, monkeypatch):
    monkeypatch.setattr(validate, "values_checkable", lambda *t: False)
    p = problem()
    decode(p)
    bad = dict(p, bt=p["bt"].long())
    with pytest.raises(UltraQuantError, match="block_table: expected dtype int32"):
        decode(bad)
    with pytest.raises(UltraQuantError, match="scale"):
        decode(p, scale=True)  # == 1 and hash(True) == hash(1): the option's type is part of the signature
    decode(p, scale=1)
    with pytest.raises(UltraQuantError, match="scale"):
        decode(p, scale=True)


def test_a_copied_query_is_never_cached(recorded, monkeypatch):
    launches, counts = recorded
    monkeypatch.setattr(validate, "values_checkable", lambda *t: False)
    p = problem()
    q = torch.randn(HQ, D, 2).permute(2, 0, 1)  # last stride != 1: the plan launches a contiguous copy
    for _ in range(2):
        uq.decode_attention(q, p["cache"], p["bt"], p["lens"], 0.125, out=p["out"])
    assert counts["plan_decode"] == 2
    assert all(lp.args[0] is not q and torch.equal(lp.args[0], q) for lp in launches)


def test_aliased_then_distinct_store_inputs(recorded, monkeypatch):
    launches, counts = recorded
    monkeypatch.setattr(validate, "values_checkable", lambda *t: False)
    cache = torch.zeros(4, BS, HK, uq.slot_size(D), dtype=torch.uint8)
    k, v = torch.randn(3, HK, D), torch.randn(3, HK, D)
    slots = torch.arange(3)
    uq.store_kv(k, k, cache, slots)
    uq.store_kv(k, v, cache, slots)
    assert counts["plan_store"] == 1
    assert launches[0].args[0] is k and launches[0].args[1] is k
    assert launches[1].args[0] is k and launches[1].args[1] is v


def test_out_none_gets_a_fresh_buffer_each_call(recorded):
    launches, _ = recorded
    p = problem()
    a = uq.decode_attention(p["q"], p["cache"], p["bt"], p["lens"], 0.125)
    b = uq.decode_attention(p["q"], p["cache"], p["bt"], p["lens"], 0.125)
    assert a is not b and launches[0].args[arg("out_ptr")] is a and launches[1].args[arg("out_ptr")] is b


def test_the_aot_launcher_follows_runtime_resets(rt, tmp_path, monkeypatch):  # noqa: F811
    """The cached runtime launcher keeps the loaded kernel between calls, and resolves again after
    ``runtime.reset()`` (here: then the blob is gone, and BACKEND=aot says so)."""
    monkeypatch.setattr(launch, "plan_device", lambda plan: 0)
    monkeypatch.setattr(validate, "values_checkable", lambda *t: False)
    jit = []
    monkeypatch.setattr(registry, "jit_launch", jit.append)
    ops.forget_prepared()
    p = problem()
    spec = plans.plan_decode(p["q"], p["cache"], p["bt"], p["lens"], 0.125, None, None, None, p["out"]).spec
    write_manifest(tmp_path / "gen", specs=[spec])
    monkeypatch.setenv("ULTRAQUANT_SELFTEST", "0")
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    for _ in range(3):
        decode(p)
    assert len(rt.launches) == 3 and len(rt.loads) == 1 and not jit
    launch.reset()
    decode(p)
    assert len(rt.launches) == 4 and len(rt.loads) == 1  # resolved again: the module was already loaded
    (tmp_path / "gen/sm_90/manifest.json").unlink()
    launch.reset()
    with pytest.raises(UltraQuantError, match="no usable blob"):
        decode(p)
    assert len(rt.launches) == 4 and not jit
    ops.forget_prepared()
