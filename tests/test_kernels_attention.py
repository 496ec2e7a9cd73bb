"""The Triton decode and prefill kernels under TRITON_INTERPRET=1 against ultraquant.reference.

Same cache for both sides (written by the reference), bf16 inputs; the reference runs in float64 on
a float32 copy of the query, the kernels use bf16 MMA operands (query split hi + lo). Outputs are
poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.helpers import make_paged
from ultraquant import reference as R
from ultraquant.kernels import catalog, plans, workspace
from ultraquant.kernels.families import decode_splitkv as splitkv_family
from ultraquant.kernels.families import decode_wholepage as wholepage_family
from ultraquant.kernels.families import dequant as dequant_family
from ultraquant.kernels.families import prefill as prefill_family
from ultraquant.kernels.families import store as store_family
from ultraquant.kernels.interpret import interpreted_registry

MAX_REL = 1e-2
MIN_COS = 0.9999


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    interpreted_registry()


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")


def check_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert not got.isnan().any(), "unwritten (NaN-poisoned) output elements"
    g, r = got.double().flatten(), ref.double().flatten()
    if r.norm() == 0:
        assert g.norm() == 0
        return
    rel = float((g - r).norm() / r.norm())
    cos = float(torch.nn.functional.cosine_similarity(g, r, dim=0))
    assert rel <= MAX_REL and cos >= MIN_COS, f"rel {rel:.2e} cos {cos:.6f}"


DECODE_CASES = [
    # (seq_lens, Hq, Hk, D, block, sinks, window, softcap, head_major)
    ([1, 37, 80], 8, 2, 64, 16, False, None, None, False),
    ([100, 0, 33], 6, 1, 128, 32, True, None, None, True),
    ([70, 16], 4, 4, 64, 16, True, 20, 30.0, False),
    ([65], 16, 1, 64, 64, False, 64, None, True),
]


@pytest.mark.parametrize("splits", ["1", "3"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"decode{i}" for i in range(len(DECODE_CASES))])
def test_decode_matches_reference(monkeypatch, case, splits):
    lens, hq, hk, d, bs, sinks, window, softcap, head_major = case
    monkeypatch.setenv("ULTRAQUANT_DECODE_SPLITS", splits)
    prob = make_paged(lens, hk, d, bs, seed=len(lens) + d, dtype=torch.bfloat16, head_major=head_major)
    gen = torch.Generator().manual_seed(d)
    query = (torch.randn(len(lens), hq, d, generator=gen) * 3).to(torch.bfloat16)
    sk = torch.randn(hq, generator=gen) if sinks else None
    scale = d ** -0.5
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk,
                             sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    got = uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk,
                              sliding_window=window, softcap=softcap, out=out)
    assert got is out
    check_close(out, ref)
    for i, n in enumerate(lens):
        if n == 0:
            assert bool((out[i] == 0).all()), "seq_len 0 must give zeros"


def test_decode_twice_reuses_tickets(monkeypatch):
    """The split tickets reset themselves: a second call (a graph replay) is right too."""
    monkeypatch.setenv("ULTRAQUANT_DECODE_SPLITS", "4")
    prob = make_paged([50, 9], 2, 64, 16, seed=3, dtype=torch.bfloat16)
    query = torch.randn(2, 4, 64).to(torch.bfloat16)
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 0.125)
    for _ in range(2):
        out = torch.full_like(query, float("nan"))
        uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125, out=out)
        check_close(out, ref)


def test_decode_large_query_values_stay_finite():
    """Rotated queries far above FP8's 448 must not turn into NaN (no unscaled FP8 cast)."""
    prob = make_paged([20], 1, 64, 16, seed=4, dtype=torch.bfloat16)
    query = torch.full((1, 1, 64), 2000.0).to(torch.bfloat16)
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 1e-4)
    out = uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, 1e-4)
    check_close(out, ref)


def wide_range_problem(lens: list[int], d: int, bs: int, query: torch.Tensor, device: str = "cpu"):
    """One kv head per request (GQA 1): K/V whose per-(token, 32-group) magnitudes span 2**-3..2**3
    (diffuse attention), plus outlier tokens (every 37th) with V 2**20 larger but K = -3q (a logit
    about 35 log2 units below the rest, so they contribute ~2**-15 of the output). Stresses the
    kernels' per-token fp16 scaling: a reference exponent taken from the V scales alone would push the
    probabilities of the tokens that matter into fp16 subnormals (a few % error)."""
    gen = torch.Generator().manual_seed(sum(lens) + d)

    def tensor(n: int) -> torch.Tensor:
        x = torch.randn(n, 1, d // 32, 32, generator=gen)
        return (x * torch.exp2(torch.randint(-3, 4, (n, 1, d // 32, 1), generator=gen).float())).reshape(n, 1, d)

    def store(key, value, kv_cache, slot_mapping, encoder="rne"):
        k, v = tensor(key.shape[0]), tensor(key.shape[0])
        row = 0
        for i, n in enumerate(lens):
            k[row : row + n : 37] = -3.0 * query[i].float()
            v[row : row + n : 37] *= 2.0 ** 20
            row += n
        R.store_kv(k.to(key), v.to(value), kv_cache, slot_mapping, encoder=encoder)

    return make_paged(lens, 1, d, bs, seed=7, dtype=torch.bfloat16, device=device, store=store)


@pytest.mark.parametrize("splits", ["1", "2"])
def test_decode_wide_dynamic_range(monkeypatch, splits):
    """Scales 2**6 apart within a token and V outliers 2**20 above the rest: usual bounds hold."""
    monkeypatch.setenv("ULTRAQUANT_DECODE_SPLITS", splits)
    query = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    prob = wide_range_problem([150, 64], 64, 16, query)
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 0.125)
    out = torch.full_like(query, float("nan"))
    uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125, out=out)
    check_close(out, ref)


PREFILL_CASES = [
    # (seq_lens, q_lens, Hq, Hk, D, block, sinks, window, softcap)
    ([10, 50, 7], [10, 5, 3], 4, 2, 64, 16, False, None, None),
    ([40, 3], [17, 3], 6, 1, 128, 32, True, None, None),
    ([70, 33], [1, 20], 4, 4, 64, 16, True, 20, 30.0),
]


@pytest.mark.parametrize("splits", ["1", "3"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"prefill{i}" for i in range(len(PREFILL_CASES))])
def test_prefill_matches_reference(monkeypatch, case, splits):
    lens, q_lens, hq, hk, d, bs, sinks, window, softcap = case
    monkeypatch.setenv("ULTRAQUANT_PREFILL_SPLITS", splits)
    prefix = [n - q for n, q in zip(lens, q_lens, strict=True)]
    prob = make_paged(prefix, hk, d, bs, seed=d, dtype=torch.bfloat16)
    need = max(-(-n // bs) for n in lens)
    block_table = torch.zeros(len(lens), max(need, prob.block_table.shape[1]), dtype=torch.int32)
    block_table[:, : prob.block_table.shape[1]] = prob.block_table
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    n = int(qsl[-1])
    gen = torch.Generator().manual_seed(n)
    query = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16)
    key = torch.randn(n, hk, d, generator=gen).to(torch.bfloat16)
    value = torch.randn(n, hk, d, generator=gen).to(torch.bfloat16)
    sk = torch.randn(hq, generator=gen) if sinks else None
    args = (prob.kv_cache, block_table, seq_lens, qsl, d ** -0.5)
    ref = R.prefill_attention(query.float(), key, value, *args, sinks=sk, sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    uq.prefill_attention(query, key, value, *args, sinks=sk, sliding_window=window, softcap=softcap, out=out)
    check_close(out, ref)


def test_plans_match_kernel_parameters():
    """plans.py's parameter lists and constexprs name exactly the kernels' parameters, in order."""
    registry = interpreted_registry()
    cfg = dict(head_size=128, gqa=4, block_size=16)
    for op, spec in [("store_kv", store_family.store_spec(head_size=128)),
                     ("dequant_kv", dequant_family.dequant_spec(head_size=128, block_size=16)),
                     ("decode_attention", splitkv_family.decode_splitkv_spec(**cfg)),
                     ("prefill_attention", prefill_family.prefill_spec(**cfg)),
                     ("decode_attention_wholepage", wholepage_family.decode_wholepage_spec(**cfg, num_kv_heads=2,
                                                                                           token_major=True))]:
        names = registry.KERNELS[spec.kernel].arg_names
        assert names == list(spec.signature) + list(spec.constexprs), op
        assert catalog.specializer(op) is not None
    # head-major keys leave out TOKEN_MAJOR (the kernel's last constexpr, default False): a prefix
    head = wholepage_family.decode_wholepage_spec(**cfg, num_kv_heads=2)
    names = registry.KERNELS[head.kernel].arg_names
    assert names[:-1] == list(head.signature) + list(head.constexprs) and names[-1] == "TOKEN_MAJOR"


def test_decode_grid_is_static(monkeypatch):
    """The decode grid depends on static shapes only, not on seq_lens (graph replay)."""
    monkeypatch.delenv("ULTRAQUANT_DECODE_SPLITS", raising=False)
    query = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(10, 64, 8, uq.slot_size(128), dtype=torch.uint8)
    bt = torch.zeros(8, 512, dtype=torch.int32)
    grids = {plans.plan_decode(query, cache, bt, torch.full((8,), n, dtype=torch.int32), 0.1, None, None, None,
                               query).grid for n in (1, 1000, 32768)}
    assert len(grids) == 1


def test_workspace_growth_keeps_old_buffers_alive():
    """A larger call replaces the workspace but never frees the old one (captured graphs use it)."""
    dev = torch.device("cpu")
    small = workspace.decode_workspace(dev, 10, 10, 2)
    want = small[0].numel() + 1000
    big = workspace.decode_workspace(dev, want, 10, 2)
    assert big[0].numel() >= want and big[0].data_ptr() != small[0].data_ptr()
    assert any(ws[0] is small[0] for ws in workspace._retired)
    assert int(big[2].sum()) == 0
