"""The whole-page decode as the product's decode, on the CPU: the plan's rule (whole-page for a ``cuda`` target on the
configs ``wholepage_supports`` covers, split-KV otherwise), warmup's specs, and an sm_90 build of one whole-page config
whose manifest key is the plan's key and which ``ultraquant verify`` accepts.

CPU tensors stand for CUDA ones by patching ``plans.target_of`` (the plan reads the target only
there); the kernel itself runs in tests/gpu/test_decode_wholepage_gpu.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.helpers import force_target
from ultraquant import config, policy
from ultraquant.format import slot_size
from ultraquant.kernels import plans
from ultraquant.kernels.families.decode_wholepage import whole_runs

SLOT = 136  # slot bytes at D=128


def _call(hq: int = 32, hk: int = 8, bs: int = 64, d: int = 128, head_major: bool = True, batch: int = 3):
    """(query, cache, block table, seq_lens, out) of a decode call on CPU tensors."""
    slot = slot_size(d)
    if head_major:
        cache = torch.zeros(9, hk, bs, slot, dtype=torch.uint8).transpose(1, 2)
    else:
        cache = torch.zeros(9, bs, hk, slot, dtype=torch.uint8)
    q = torch.randn(batch, hq, d).to(torch.bfloat16)
    return q, cache, torch.zeros(batch, 3, dtype=torch.int32), torch.ones(batch, dtype=torch.int32), q.clone()


def _plan(call, tuning=plans.NO_TUNING, **kw):
    q, cache, bt, lens, out = call
    return plans.plan_decode(q, cache, bt, lens, q.shape[-1] ** -0.5, None, kw.get("window"), None, out, tuning)


@pytest.fixture
def cuda_target(monkeypatch):
    force_target(monkeypatch, "cuda")


def test_cuda_target_takes_wholepage_where_covered(cuda_target):
    for hq, hk, bs in ((32, 8, 64), (16, 1, 16), (4, 4, 128), (12, 2, 32), (128, 8, 16)):
        p = _plan(_call(hq, hk, bs))
        assert p.spec.kernel == "uq_decode_wholepage", (hq, hk, bs)
        assert p.grid == (p.notes["programs"], 1, 1) and p.spec.constexprs["HK"] == hk  # persistent grid
        assert p.args[list(p.spec.signature).index("num_requests")] == 3
        assert set(p.spec.divisible) == {"stride_qb", "stride_qh", "stride_ob", "stride_oh"}
        assert len(p.args) == len(p.spec.signature)  # the kernel's parameters (WHOLEPAGE_PARAMS), in order
        assert p.args[list(p.spec.signature).index("stride_btb")] == p.args[2].stride(0)
    wide = _plan(_call(16, 2, 64, d=256))  # shape C: D=256, GQA 8
    assert wide.spec.kernel == "uq_decode_wholepage" and wide.spec.constexprs["D"] == 256
    assert wide.spec.constexprs["NSUB"] == 2 and wide.spec.constexprs["ROWS_IN_N"]
    window = _plan(_call(), window=100)
    assert window.spec.kernel == "uq_decode_wholepage" and window.spec.constexprs["HAS_WINDOW"]


def test_cuda_target_takes_wholepage_on_token_major_pages(cuda_target):
    """Token-major pages (a plain torch.zeros of the ops' shape, upstream vLLM's order) at Hk > 1: the
    whole-page decode with TOKEN_MAJOR; head-major and one kv head keep the head-major key."""
    for hq, hk, bs, d in ((32, 8, 16, 128), (12, 2, 32, 128), (16, 4, 64, 128), (16, 2, 16, 256)):
        p = _plan(_call(hq, hk, bs, d=d, head_major=False))
        assert p.spec.kernel == "uq_decode_wholepage" and p.spec.constexprs.get("TOKEN_MAJOR"), (hq, hk, bs, d)
        head = _plan(_call(hq, hk, bs, d=d))
        assert head.spec.kernel == "uq_decode_wholepage" and "TOKEN_MAJOR" not in head.spec.constexprs
    one = _plan(_call(8, 1, 16, head_major=False))
    assert one.spec.kernel == "uq_decode_wholepage" and "TOKEN_MAJOR" not in one.spec.constexprs


def test_cuda_target_keeps_splitkv_on_padded_slots(cuda_target):
    """Slots 144 bytes apart (neither head- nor token-major pages): split-KV decode."""
    q, _, bt, lens, out = _call()
    padded = torch.zeros(9, 64, 8, 144, dtype=torch.uint8)[..., :SLOT]
    assert plans.plan_decode(q, padded, bt, lens, 0.1, None, None, None, out).spec.kernel == "uq_decode_splitkv"


@pytest.mark.parametrize("what,call", [
    ("D=64", dict(d=64)),
    ("D=256, GQA 16", dict(d=256, hq=32, hk=2)),
    ("GQA 32", dict(hq=32, hk=1)),
    ("16 kv heads", dict(hq=32, hk=16)),
    ("3 kv heads", dict(hq=12, hk=3)),
    ("8-token blocks", dict(bs=8)),
])
def test_cuda_target_keeps_splitkv_outside_the_rule(cuda_target, what, call):
    p = _plan(_call(**call))
    assert p.spec.kernel == "uq_decode_splitkv" and p.grid[1] == p.args[1].shape[2], what


def test_splitkv_when_not_cuda_or_switched_off(cuda_target, monkeypatch):
    off = dataclasses.replace(plans.NO_TUNING, decode_wholepage=False)
    assert _plan(_call(), off).spec.kernel == "uq_decode_splitkv"
    monkeypatch.setenv("ULTRAQUANT_DECODE_WHOLEPAGE", "0")
    assert config.get().tuning.decode_wholepage is False
    assert _plan(_call(), config.get().tuning).spec.kernel == "uq_decode_splitkv"
    monkeypatch.undo()
    assert _plan(_call()).spec.kernel == "uq_decode_splitkv"  # CPU tensors: target "portable"


def test_misaligned_cache_keeps_splitkv(cuda_target):
    q, cache, bt, lens, out = _call()
    raw = torch.zeros(9 * 8 * 64 * SLOT + 8, dtype=torch.uint8)
    shifted = raw[8:].view(9, 8, 64, SLOT).transpose(1, 2)
    assert whole_runs(128, shifted.stride(), 8) and shifted.data_ptr() % 16
    assert plans.plan_decode(q, shifted, bt, lens, 0.1, None, None, None, out).spec.kernel == "uq_decode_splitkv"


def test_forced_splits_carry_over(cuda_target):
    p = _plan(_call(), dataclasses.replace(plans.NO_TUNING, decode_splits=5))
    assert p.spec.kernel == "uq_decode_wholepage" and p.grid == (3 * 5, 1, 1)  # 5 pieces per request


def test_warmup_specs_follow_the_rule(cuda_target, monkeypatch):

    strides = _call()[1].stride()
    model = {"head_size": 128, "block_size": 64, "num_q_heads": 32, "num_kv_heads": 8, "ops": ["decode_attention"]}
    monkeypatch.setattr(policy, "_torch_device", lambda device: torch.device("cpu"))
    (wholepage,) = policy.model_specializations({**model, "cache_strides": list(strides)})
    (dense,) = policy.model_specializations(model)  # the dense (token-major) layout
    assert wholepage.kernel == "uq_decode_wholepage" and dense.kernel == "uq_decode_wholepage"
    assert dense.constexprs.get("TOKEN_MAJOR") and "TOKEN_MAJOR" not in wholepage.constexprs
    dense_plan = _plan(_call(head_major=False))
    assert dataclasses.replace(dense, divisible=dense_plan.spec.divisible).key() == dense_plan.spec.key()
    plan = _plan(_call())
    assert dataclasses.replace(wholepage, divisible=plan.spec.divisible).key() == plan.spec.key()
    assert "decode_attention_wholepage" not in [s.kernel for s in policy.model_specializations(
        {k: v for k, v in model.items() if k != "ops"})]


def test_sm90_build_of_a_wholepage_config_is_the_plans_key(cuda_target, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from ultraquant.codegen import matrix
    from ultraquant.codegen.archs import get_arch
    from ultraquant.codegen.build import BuildOptions, build
    from ultraquant.codegen.verify import verify_dir
    from ultraquant.runtime.manifest import ManifestIndex, find_manifests

    (row,) = [r for r in matrix.OPS if r.op == "decode_attention_wholepage"]
    one = dataclasses.replace(row, features=(matrix.PLAIN,))
    sel = matrix.Selection(head_sizes=(128,), gqa=(4,), block_sizes=(64,), kv_heads=(8,),
                           ops=("decode_attention_wholepage",))
    build(BuildOptions(archs=[get_arch("sm_90")], selection=sel, out_dir=tmp_path, cache_dir=None, jobs=1,
                       rows=[one], extra_env={"TRITON_INTERPRET": "0"}))
    manifest = json.loads((tmp_path / "sm_90" / "manifest.json").read_text())
    (blob,) = manifest["blobs"]
    plan = _plan(_call())
    assert blob["key"] == plan.spec.key()
    assert [p["name"] for p in blob["params"] if p["hidden"]] == ["global_scratch", "profile_scratch"]
    report = verify_dir(tmp_path / "sm_90")
    assert not report.problems, report.problems
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    entry, why = ManifestIndex(find_manifests()).lookup("sm_90", plan.spec.key())
    assert entry is not None and entry.kernel == "uq_decode_wholepage", why
    points, skipped = matrix.expand([row], matrix.Selection(head_sizes=(64, 128), gqa=(4, 32), block_sizes=(64,),
                                                            kv_heads=(2, 3)), "sm_90", ["triton"])
    assert {(p.config["head_size"], p.config["gqa"], p.config["num_kv_heads"]) for p in points} == {(128, 4, 2)}
    assert {p.config["token_major"] for p in points} == {False, True}  # both page layouts at Hk 2
    assert len(skipped) == 7 * 2 * len(matrix.ATTENTION_FEATURES)  # 7 configs x both layouts
    assert all("wholepage_supports" in s["reason"] for s in skipped)
    assert matrix.expand([row], sel, "gfx942", ["triton"]) == ([], [])


class ReferenceBlob:
    """Looks like a loaded whole-page blob; its launch writes the reference decode of the launch's arguments
    (optionally without the sinks: a wrong kernel) and records the grid and cache strides."""

    def __init__(self, spec, drop_sinks: bool = False) -> None:
        self.entry = type("E", (), {"key": spec.key(), "kernel": spec.kernel, "alternate_of": ""})()
        self.names, self.flags, self.drop_sinks = list(spec.signature), spec.constexprs, drop_sinks
        self.seen: list = []

    def launch(self, args, grid) -> None:
        from ultraquant import reference

        a = dict(zip(self.names, args, strict=True))
        self.seen.append((grid, a["cache_ptr"].stride()))
        sinks = a["sinks_ptr"] if self.flags["HAS_SINKS"] and not self.drop_sinks else None
        a["out_ptr"].copy_(reference.decode_attention(
            a["q_ptr"].float(), a["cache_ptr"], a["bt_ptr"], a["seqlen_ptr"], a["scale"], sinks=sinks,
            sliding_window=a["window"] if self.flags["HAS_WINDOW"] else None,
            softcap=a["softcap"] if self.flags["HAS_SOFTCAP"] else None))


def test_selftest_problem_of_wholepage():
    """The whole-page self-test problem plans whole-page over a head-major cache on several programs, passes a kernel
    that computes the decode, fails one that drops the sinks, refuses a blob of another key."""
    from ultraquant.kernels.families.decode_wholepage import decode_wholepage_spec
    from ultraquant.runtime import problems

    spec = decode_wholepage_spec(head_size=128, gqa=4, num_kv_heads=2, block_size=32, has_sinks=True, has_window=True)
    spec = dataclasses.replace(spec, divisible=("stride_qb", "stride_qh", "stride_ob", "stride_oh"))
    good = ReferenceBlob(spec)
    ok, detail = problems.decode_wholepage_problem(good, spec, torch.device("cpu"))
    assert ok, detail
    (grid, strides), = good.seen
    assert grid[1] == grid[2] == 1 and grid[0] > 1 and whole_runs(128, strides, 2)  # a persistent grid
    ok, detail = problems.decode_wholepage_problem(ReferenceBlob(spec, drop_sinks=True), spec, torch.device("cpu"))
    assert not ok and "rel err" in detail
    other = dataclasses.replace(spec, constexprs={**spec.constexprs, "NSUB": 2 * spec.constexprs["NSUB"]})
    ok, detail = problems.decode_wholepage_problem(ReferenceBlob(other), spec, torch.device("cpu"))
    assert not ok and "not this blob's" in detail
