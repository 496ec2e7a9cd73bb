"""The self-test problems run for real on CPU: the Triton kernels under TRITON_INTERPRET=1 stand in
for a loaded blob, so the problems' construction, plan-key checks and pass criteria are exercised
against the actual kernels. A mislabelled "blob" (another variant's code under this key) must fail.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

from ultraquant.kernels.families import decode_splitkv as splitkv_family  # noqa: E402
from ultraquant.kernels.families import dequant as dequant_family  # noqa: E402
from ultraquant.kernels.families import prefill as prefill_family  # noqa: E402
from ultraquant.kernels.families import store as store_family  # noqa: E402
from ultraquant.kernels.plans import LaunchPlan  # noqa: E402
from ultraquant.kernels.specialization import Specialization  # noqa: E402
from ultraquant.runtime import problems  # noqa: E402

CPU = "cpu"


def _interpreting() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    mod = sys.modules.get("ultraquant.kernels.triton.store")
    return mod is None or type(mod.uq_store_kv).__name__ == "InterpretedFunction"


pytestmark = pytest.mark.skipif(not _interpreting(), reason="needs TRITON_INTERPRET=1 before kernels import")


class _Entry:
    def __init__(self, spec: Specialization) -> None:
        self.key, self.kernel, self.alternate_of = spec.key(), spec.kernel, ""


class InterpretedBlob:
    """Looks like a loaded :class:`~ultraquant.runtime.loader.Kernel` whose manifest key is
    ``label``'s, but runs ``actual``'s Triton kernel in the interpreter."""

    def __init__(self, label: Specialization, actual: Specialization | None = None) -> None:
        self.entry = _Entry(label)
        self.actual = actual or label
        self.launches = 0

    def launch(self, args, grid) -> None:
        from ultraquant.kernels import registry

        self.launches += 1
        registry.jit_launch(LaunchPlan(self.actual, tuple(args), grid))


@pytest.mark.parametrize("encoder", ["rne", "upstream"])
def test_store_problem_passes_for_the_right_kernel(encoder):
    spec = store_family.store_spec(head_size=64, key_dtype="bf16", slot_dtype="i64", encoder=encoder)
    blob = InterpretedBlob(spec)
    ok, detail = problems.store_problem(blob, spec, CPU)
    assert ok, detail
    assert blob.launches == 1


def test_store_problem_catches_a_wrong_encoder():
    label = store_family.store_spec(head_size=64, key_dtype="bf16", slot_dtype="i64", encoder="upstream")
    actual = store_family.store_spec(head_size=64, key_dtype="bf16", slot_dtype="i64", encoder="rne")
    ok, detail = problems.store_problem(InterpretedBlob(label, actual), label, CPU)
    assert not ok and "V/untouched bytes differing: 0;" not in detail


def test_decode_problem_passes_and_catches_a_missing_feature():
    spec = splitkv_family.decode_splitkv_spec(head_size=64, gqa=2, block_size=16, query_dtype="bf16", has_softcap=True)
    ok, detail = problems.decode_problem(InterpretedBlob(spec), spec, CPU)
    assert ok, detail
    plain = splitkv_family.decode_splitkv_spec(head_size=64, gqa=2, block_size=16, query_dtype="bf16")
    ok, detail = problems.decode_problem(InterpretedBlob(spec, plain), spec, CPU)
    assert not ok, detail


def test_prefill_problem_passes():
    spec = prefill_family.prefill_spec(head_size=64, gqa=2, block_size=16, query_dtype="bf16", has_sinks=True)
    ok, detail = problems.prefill_problem(InterpretedBlob(spec), spec, CPU)
    assert ok, detail


@pytest.mark.parametrize("original", [True, False])
def test_dequant_problem_passes(original):
    spec = dequant_family.dequant_spec(head_size=64, block_size=16, out_dtype="fp32", original_space=original)
    ok, detail = problems.dequant_problem(InterpretedBlob(spec), spec, CPU)
    assert ok, detail


def test_problem_refuses_a_blob_of_another_config():
    spec = store_family.store_spec(head_size=64, key_dtype="bf16", slot_dtype="i64")
    other = store_family.store_spec(head_size=128, key_dtype="bf16", slot_dtype="i64")
    blob = InterpretedBlob(other)
    ok, detail = problems.store_problem(blob, spec, CPU)
    assert not ok and "not this blob's" in detail and blob.launches == 0


class _ReferenceBlob:
    """A multi-query decode "blob" (the Gluon kernel runs on sm_90 only) that writes the reference's
    answer, or ``wrong``'s corruption of it, into the launch's output: exercises the problem's
    construction, plan-key check and pass criterion on the CPU."""

    def __init__(self, spec: Specialization, wrong: bool = False) -> None:
        self.entry, self.wrong, self.launches = _Entry(spec), wrong, 0

    def launch(self, args, grid) -> None:
        from ultraquant import reference
        from ultraquant.kernels.families.decode_multiquery import MULTIQUERY_PARAMS

        self.launches += 1
        a = dict(zip((n for n, _ in MULTIQUERY_PARAMS), args, strict=True))
        has = self.entry.key
        sinks = a["sinks_ptr"] if "HAS_SINKS=True" in has else None
        window = a["window"] if "HAS_WINDOW=True" in has else None
        softcap = a["softcap"] if "HAS_SOFTCAP=True" in has else None
        want = reference.spec_decode_attention(a["q_ptr"].float(), a["cache_ptr"], a["bt_ptr"], a["seqlen_ptr"],
                                               a["qsl_ptr"], a["scale"], max_query_len=a["max_tokens"], sinks=sinks,
                                               sliding_window=window, softcap=softcap)
        if self.wrong:  # a blob that misses the last new token's causal step: its rows see one token less
            want[-1] = want[-2]
        a["out_ptr"].copy_(want)


@pytest.mark.parametrize("features", [{}, {"has_sinks": True, "has_window": True}, {"has_softcap": True}])
def test_multiquery_problem_passes_and_catches_a_wrong_blob(features, monkeypatch):
    from ultraquant.kernels.families import decode_multiquery as mq_family
    from ultraquant.kernels.families import decode_wholepage as wp_family

    monkeypatch.setattr(wp_family, "num_sms", lambda device: 132)
    spec = mq_family.decode_multiquery_spec(head_size=128, gqa=4, num_kv_heads=2, block_size=16, **features)
    ok, detail = problems.decode_multiquery_problem(_ReferenceBlob(spec), spec, CPU)
    assert ok, detail
    ok, detail = problems.decode_multiquery_problem(_ReferenceBlob(spec, wrong=True), spec, CPU)
    assert not ok, detail
    other = mq_family.decode_multiquery_spec(head_size=128, gqa=4, num_kv_heads=4, block_size=16, **features)
    blob = _ReferenceBlob(other)
    ok, detail = problems.decode_multiquery_problem(blob, spec, CPU)
    assert not ok and "not this blob's" in detail and blob.launches == 0
