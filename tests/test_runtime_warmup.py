"""Issue 17, item 6: ``ultraquant.warmup([{model config}])`` plans exactly the variants the public ops
plan for that model: both store layouts (a decode step's few rows, a prefill's many), decode and
prefill for the device's target (FP4_PTX on NVIDIA), dequant in the query dtype (the dense route).

The real calls run on CPU tensors with ``ULTRAQUANT_BACKEND=triton`` and the JIT launch replaced by a
recorder, so what is compared is the plans' specializations, not kernel results.
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.helpers import force_target
from ultraquant import ops, policy
from ultraquant.errors import UltraQuantError
from ultraquant.kernels import heuristics, registry

MODELS = [
    {"head_size": 128, "num_q_heads": 32, "num_kv_heads": 8, "block_size": 16, "dtype": "bf16"},
    {"head_size": 64, "num_q_heads": 16, "num_kv_heads": 2, "block_size": 32, "dtype": "fp16",
     "has_sinks": True, "has_window": True, "has_softcap": True},
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def planned_by_calls(model: dict, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Keys of every launch the public ops plan for one decode step, one large prefill store, one
    small continuation and one dense-route dequant of ``model``."""
    seen: list[str] = []
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")
    monkeypatch.setattr(registry, "jit_launch", lambda plan: seen.append(plan.spec.key()))
    d, hq, hk, bs = model["head_size"], model["num_q_heads"], model["num_kv_heads"], model["block_size"]
    dt = DTYPES[model["dtype"]]
    many = heuristics.STORE_FEW_ROWS_PER_SM * heuristics.num_sms(torch.device("cpu")) // hk + 1
    blocks = -(-many // bs)
    cache = torch.zeros(blocks, bs, hk, uq.slot_size(d), dtype=torch.uint8)
    opts = {"sinks": torch.zeros(hq) if model.get("has_sinks") else None,
            "sliding_window": 64 if model.get("has_window") else None,
            "softcap": 30.0 if model.get("has_softcap") else None}
    # a prefill's store (many rows) and a decode step's store (few rows)
    kv = torch.randn(many, hk, d).to(dt)
    uq.store_kv(kv, kv, cache, torch.arange(many, dtype=torch.int64))
    uq.store_kv(kv[:3], kv[:3], cache, torch.arange(3, dtype=torch.int64))
    bt = torch.arange(blocks, dtype=torch.int32)[None].repeat(3, 1)
    lens = torch.tensor([5, 40, 17], dtype=torch.int32)
    uq.decode_attention(torch.randn(3, hq, d).to(dt), cache, bt, lens, 0.1, **opts)
    q = torch.randn(6, hq, d).to(dt)
    uq.prefill_attention(q, kv[:6], kv[:6], cache, bt, lens, torch.tensor([0, 1, 4, 6], dtype=torch.int32), 0.1,
                         **opts)
    out = torch.empty(62, hk, d, dtype=dt)
    ops.dequant_kv_packed(cache, bt, lens, torch.tensor([0, 5, 45, 62], dtype=torch.int32), out, out.clone())
    return set(seen)


@pytest.mark.parametrize("model", MODELS, ids=["bf16-D128", "fp16-D64-all-features"])
def test_warmup_plans_what_the_calls_plan(model, monkeypatch):
    calls = planned_by_calls(model, monkeypatch)
    assert len(calls) == 5  # two store layouts, decode, prefill, dequant
    assert {s.key() for s in policy.model_specializations(model, torch.device("cpu"))} == calls


@pytest.mark.parametrize("model", MODELS, ids=["bf16-D128", "fp16-D64-all-features"])
def test_warmup_plans_the_target_the_device_implies(model, monkeypatch):
    """On an NVIDIA device the calls plan the inline-PTX (FP4_PTX) split-KV decode and prefill, or the
    whole-page decode (token-major: the dense cache) where it covers the config; warmup for a CUDA device
    index must too (it planned the portable variants before)."""
    monkeypatch.setattr(torch.version, "hip", None)
    want = policy.model_specializations(model, 0)
    ptx = {s.kernel: s.constexprs["FP4_PTX"] for s in want if "FP4_PTX" in s.constexprs}
    wholepage = [s for s in want if s.kernel == "uq_decode_wholepage"]
    if model["head_size"] == 128:  # whole-page's rule: D=128 GQA 4, 8 kv heads, block 16
        assert ptx == {"uq_prefill": True} and len(wholepage) == 1 and wholepage[0].constexprs["TOKEN_MAJOR"]
    else:
        assert ptx == {"uq_decode_splitkv": True, "uq_prefill": True} and not wholepage
    # The calls derive the target from their tensors' device through the same function: make CPU tensors
    # look like an NVIDIA GPU's and the calls plan exactly warmup's set for cuda:0.
    force_target(monkeypatch, "cuda")
    assert planned_by_calls(model, monkeypatch) == {s.key() for s in want}


def test_model_config_mistakes_are_clear_errors():
    base = dict(MODELS[0])
    with pytest.raises(UltraQuantError, match="unknown model keys.*head_dim"):
        policy.model_specializations({**base, "head_dim": 128}, torch.device("cpu"))
    with pytest.raises(UltraQuantError, match="bfloat16x"):
        policy.model_specializations({**base, "dtype": "bfloat16x"}, torch.device("cpu"))
    with pytest.raises(UltraQuantError, match="decode_attention needs more"):
        policy.model_specializations({"head_size": 128, "ops": ["decode_attention"]}, torch.device("cpu"))
    with pytest.raises(UltraQuantError, match="unknown op"):
        policy.model_specializations({"head_size": 128, "ops": ["attn"]}, torch.device("cpu"))
    assert policy.model_specializations({**base, "dtype": torch.bfloat16}, torch.device("cpu")) == \
        policy.model_specializations(base, torch.device("cpu"))
