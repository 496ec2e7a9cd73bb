"""The Triton kernels on a GPU against ultraquant.reference (run on the H200 via tests/gpu/check.sh).

* store: bytes equal to the reference's (V exactly; K within the documented near-tie bound: at most
  a few codes per million, each one step apart) for D 64..512, all encoders, bf16/fp16;
* decode/prefill: rel err <= 1e-2 and cosine >= 0.9999 against the float64 reference over the same
  cache, over D {64,128,256,512}, GQA {1,4,6,8,16}, block {16,32,64,128}, sinks/window/soft cap,
  batch 1..64 with ragged lengths 1..32768 (block and split boundaries included);
* a decode CUDA graph captured once and replayed with new seq_lens; a non-default stream; outputs
  poisoned with NaN before every run.
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.helpers import carved_cache, make_paged
from tests.test_kernels_store import ALIGNMENT_CASES
from ultraquant import reference as R
from ultraquant.bench.decode import STORE_VARIANTS
from ultraquant.format import SlotLayout
from ultraquant.kernels import plans

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU"),
]

MAX_REL = 1e-2
MIN_COS = 0.9999
NEAR_TIES_PER_MILLION = 5


def check_close(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> tuple[float, float]:
    assert not got.isnan().any(), f"{what}: unwritten (NaN-poisoned) output elements"
    g, r = got.double().flatten().cpu(), ref.double().flatten().cpu()
    if r.norm() == 0:
        assert g.norm() == 0, what
        return 0.0, 1.0
    rel = float((g - r).norm() / r.norm())
    cos = float(torch.nn.functional.cosine_similarity(g, r, dim=0))
    assert rel <= MAX_REL and cos >= MIN_COS, f"{what}: rel {rel:.2e} cos {cos:.6f}"
    return rel, cos


@pytest.fixture(params=["native", "portable"])
def fp4_path(request, monkeypatch) -> str:
    """Run the attention tests with both Triton FP4 decodes: the device's own ("native": the inline-PTX
    one on NVIDIA) and the plain-Triton one (``FP4_PTX=False``) AMD GPUs compile and every AMD blob
    falls back to, which the plan otherwise never picks on an NVIDIA GPU."""
    if request.param == "portable":
        monkeypatch.setattr(plans, "target_of", lambda device: "portable")
    return request.param


def _assert_path(fp4_path: str, plan) -> None:
    native_ptx = fp4_path == "native" and torch.version.hip is None
    if plan.spec.kernel == "uq_decode_wholepage":  # the plan's rule on NVIDIA (inline-PTX FP4 too)
        assert native_ptx, plan.spec.key()
        return
    assert plan.spec.constexprs["FP4_PTX"] is native_ptx, plan.spec.constexprs


def k_code_mismatches(got: torch.Tensor, ref: torch.Tensor, head_size: int) -> int:
    """Assert V bytes and K scales equal; return the number of differing K codes (each one step)."""
    lay = SlotLayout(head_size)
    assert torch.equal(got[..., lay.k_scales:], ref[..., lay.k_scales:]), "V bytes or K scales differ"
    kg = R.unpack_nibbles(got[..., : lay.k_scales]).to(torch.int32)
    kr = R.unpack_nibbles(ref[..., : lay.k_scales]).to(torch.int32)
    diff = kg != kr
    if diff.any():
        step = ((kg[diff] & 7) - (kr[diff] & 7)).abs()
        assert bool((step == 1).all()), "a differing K code is more than one step away"
    return int(diff.sum())


def _store_slots_and_cache(key: torch.Tensor, value: torch.Tensor, bs: int, gen: torch.Generator
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Puts a zero group and a NaN group into ``value`` and returns shuffled slots (one skipped) and a
    randomly poisoned cache of blocks of ``bs`` with two spare blocks."""
    n, hk, d = key.shape
    value[0, 0, :32] = 0
    value[5, 1, 3] = float("nan")
    nblk = -(-n // bs) + 2
    slots = torch.randperm(nblk * bs, device="cuda", generator=gen)[:n]
    slots[7] = -1
    poison = torch.randint(0, 256, (nblk, bs, hk, uq.slot_size(d)), dtype=torch.uint8, device="cuda",
                           generator=gen)
    return slots, poison


@pytest.mark.parametrize("head_size,encoder,dtype", [
    (64, "rne", torch.bfloat16), (128, "rne", torch.bfloat16), (128, "upstream", torch.bfloat16),
    (128, "mse", torch.float16), (256, "rne", torch.float16), (512, "upstream", torch.bfloat16),
])
def test_store_bytes(head_size, encoder, dtype):
    n, hk = 4099, 8
    gen = torch.Generator(device="cuda").manual_seed(head_size)
    key = torch.randn(n, hk, head_size, device="cuda", generator=gen).to(dtype)
    value = (torch.randn(n, hk, head_size, device="cuda", generator=gen) * 4).to(dtype)
    slots, poison = _store_slots_and_cache(key, value, 16, gen)
    got, ref = poison.clone(), poison.clone()
    uq.store_kv(key, value, got, slots, encoder=encoder)
    R.store_kv(key, value, ref, slots, encoder=encoder)
    torch.cuda.synchronize()
    bad = k_code_mismatches(got.cpu(), ref.cpu(), head_size)
    assert bad <= max(2, NEAR_TIES_PER_MILLION * n * hk * head_size // 1_000_000), f"{bad} K near-tie codes"


def test_store_head_major_int32_slots():
    n, hk, d, bs = 300, 4, 128, 32
    key = torch.randn(n, hk, d, device="cuda").to(torch.bfloat16)
    value = torch.randn(n, hk, d, device="cuda").to(torch.bfloat16)
    raw = torch.zeros(12, hk, bs, uq.slot_size(d), dtype=torch.uint8, device="cuda")
    got = raw.permute(0, 2, 1, 3)
    ref = torch.zeros(12, bs, hk, uq.slot_size(d), dtype=torch.uint8, device="cuda")
    slots = torch.randperm(12 * bs, device="cuda")[:n].to(torch.int32)
    uq.store_kv(key, value, got, slots)
    R.store_kv(key, value, ref, slots)
    assert k_code_mismatches(got.cpu(), ref.cpu(), d) <= 2


@pytest.mark.parametrize("few_rows", [False, True])
@pytest.mark.parametrize(("head_size", "offset", "extra", "align"), ALIGNMENT_CASES)
def test_store_alignment_fallback(head_size, offset, extra, align, few_rows):
    """Caches whose base or slot stride breaks the dense layout's alignment: the plan must bake the
    smaller ALIGN (a misaligned vector store would fault here) and the bytes stay the reference's."""
    from ultraquant.kernels.registry import jit_launch

    n, hk, bs, nblocks = 700, 8, 16, 60
    gen = torch.Generator().manual_seed(head_size + offset + extra)
    key = torch.randn(n, hk, head_size, generator=gen).to(torch.bfloat16).cuda()
    value = torch.randn(n, hk, head_size, generator=gen).to(torch.bfloat16).cuda()
    got = carved_cache(nblocks, bs, hk, uq.slot_size(head_size) + extra, offset, seed=offset, device="cuda")
    assert got.data_ptr() % 16 == offset % 16
    ref = got.clone()
    slots = torch.randperm(nblocks * bs, generator=gen)[:n].cuda()
    slots[3] = -1
    plan = plans.plan_store(key, value, got, slots, few_rows=few_rows)
    assert plan.spec.constexprs["ALIGN"] == align
    jit_launch(plan)
    R.store_kv(key, value, ref, slots)
    torch.cuda.synchronize()
    assert torch.equal(got[..., uq.slot_size(head_size):].cpu(), ref[..., uq.slot_size(head_size):].cpu())
    assert k_code_mismatches(got.cpu(), ref.cpu(), head_size) <= 2


@pytest.mark.parametrize("variant", STORE_VARIANTS)
def test_store_variants_same_bytes_as_the_plan(variant):
    """Every launch shape ``bench --store-variants`` times (LANES layouts, V loaded up front, ...)
    writes exactly the plan's bytes on the GPU (the same butterfly roundings, so no near-tie
    allowance), poisoned slots around them untouched, on a store large enough for thousands of
    programs and with E2M1 decision points in V."""
    from ultraquant.bench.decode import store_variant_launch
    from ultraquant.kernels.registry import jit_launch

    n, hk, d = 5000, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(31)
    key = (torch.randn(n, hk, d, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], device="cuda")
    value = (points[torch.randint(0, 8, (n, hk, d), device="cuda", generator=gen)]
             * torch.randn(n, hk, 1, device="cuda", generator=gen).sign()).to(torch.bfloat16)
    slots, poison = _store_slots_and_cache(key, value, 64, gen)
    want, got = poison.clone(), poison.clone()
    uq.store_kv(key, value, want, slots)
    jit_launch(store_variant_launch(key, value, got, slots, variant))
    torch.cuda.synchronize()
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"


def _problem(lens, hq, hk, d, bs, head_major, seed, sinks):
    prob = make_paged(lens, hk, d, bs, seed=seed, dtype=torch.bfloat16, device="cuda", head_major=head_major)
    gen = torch.Generator().manual_seed(seed)
    query = (torch.randn(len(lens), hq, d, generator=gen) * 2).to(torch.bfloat16).cuda()
    sk = (torch.randn(hq, generator=gen) * 2).cuda() if sinks else None
    return prob, query, sk


DECODE_CASES = {
    # name: (seq_lens, Hq, Hk, D, block, sinks, window, softcap, head_major)
    "d64-gqa1-b16-sinks": ([1, 15, 16, 17, 300], 2, 2, 64, 16, True, None, None, False),
    "d128-gqa4-b64-long": ([32768, 1, 8191, 8192, 8193, 20000, 64, 65], 32, 8, 128, 64, False, None, None, True),
    "d128-gqa6-b32-window-softcap": ([5000, 31, 33, 1], 12, 2, 128, 32, False, 1000, 30.0, False),
    "d128-gqa8-b128-sinks-window": ([4000, 129, 127], 8, 1, 128, 128, True, 128, None, True),
    "d256-gqa8-b64-softcap": ([3000, 2047, 64], 16, 2, 256, 64, False, None, 50.0, True),
    "d512-gqa16-b16": ([700, 17], 16, 1, 512, 16, False, None, None, False),
    "d128-gqa16-b16-batch64": ([(i * 977) % 2048 + 1 for i in range(64)], 16, 1, 128, 16, True, 500, None, True),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode(name, fp4_path):
    lens, hq, hk, d, bs, sinks, window, softcap, head_major = DECODE_CASES[name]
    prob, query, sk = _problem(lens, hq, hk, d, bs, head_major, seed=len(name), sinks=sinks)
    scale = d ** -0.5
    _assert_path(fp4_path, plans.plan_decode(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sk,
                                             window, softcap, torch.empty_like(query)))
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk,
                             sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk,
                        sliding_window=window, softcap=softcap, out=out)
    torch.cuda.synchronize()
    check_close(out, ref, name)


def test_decode_wide_dynamic_range(fp4_path):
    """The CPU dynamic-range case (V outliers 2**20 above the rest with almost no attention) on the
    GPU kernels, whose NVIDIA build decodes FP4 with inline PTX (the CPU runs the portable path)."""
    from tests.test_kernels_attention import wide_range_problem

    query = torch.randn(3, 1, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    prob = wide_range_problem([3000, 64, 700], 128, 32, query, device="cuda")
    query = query.cuda()
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 0.125)
    out = torch.full_like(query, float("nan"))
    uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125, out=out)
    torch.cuda.synchronize()
    check_close(out, ref, "wide range")


def check_graph_replay_and_stream(decode) -> None:
    """Capture ``decode(query, kv_cache, block_table, seq_lens, scale, out=out)`` once on a side stream,
    replay it with other seq_lens (right each time), then call it eagerly on that stream."""
    capacity = [4000, 4000, 2500, 4000]  # blocks allocated per request; replays stay within them
    hq, hk, d, bs = 16, 4, 128, 32
    prob, query, _ = _problem(capacity, hq, hk, d, bs, True, seed=99, sinks=False)
    seq_lens = torch.tensor([4000, 1, 2500, 64], dtype=torch.int32, device="cuda")
    out = torch.full_like(query, float("nan"))
    scale = d ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode(query, prob.kv_cache, prob.block_table, seq_lens, scale, out=out)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        decode(query, prob.kv_cache, prob.block_table, seq_lens, scale, out=out)
    for new in ([4000, 1, 2500, 64], [17, 3999, 0, 33], [1, 1, 1, 1], [2048, 2049, 31, 4000]):
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, seq_lens, scale)
        check_close(out, ref, f"replay {new}")
    # and eagerly on a non-default stream
    with torch.cuda.stream(stream):
        out.fill_(float("nan"))
        decode(query, prob.kv_cache, prob.block_table, seq_lens, scale, out=out)
    stream.synchronize()
    check_close(out, R.decode_attention(query.float(), prob.kv_cache, prob.block_table, seq_lens, scale), "stream")


def test_decode_graph_replay_new_seq_lens_and_stream():
    """Capture once (on a side stream), replay with other seq_lens: right each time."""
    check_graph_replay_and_stream(uq.decode_attention)


PREFILL_CASES = {
    # name: (seq_lens, q_lens, Hq, Hk, D, block, sinks, window, softcap)
    "first-chunks-d128-gqa4": ([100, 37, 1], [100, 37, 1], 8, 2, 128, 16, False, None, None),
    "continuation-d128-gqa8-b64": ([5000, 300, 70], [16, 128, 7], 16, 2, 128, 64, True, None, None),
    "continuation-d64-gqa6-window-softcap": ([2000, 129], [200, 129], 12, 2, 64, 32, False, 256, 20.0),
    "continuation-d256-gqa1-b128": ([1500, 40], [33, 40], 2, 2, 256, 128, True, 100, None),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill(name, fp4_path):
    lens, q_lens, hq, hk, d, bs, sinks, window, softcap = PREFILL_CASES[name]
    prefix = [n - q for n, q in zip(lens, q_lens, strict=True)]
    prob = make_paged(prefix, hk, d, bs, seed=len(name), dtype=torch.bfloat16, device="cuda")
    need = max(-(-n // bs) for n in lens)
    spare = torch.arange(prob.kv_cache.shape[0], prob.kv_cache.shape[0] + need, dtype=torch.int32)
    # Extend the cache so the chunks' own blocks exist (the kernel never reads them: raw K/V).
    cache = torch.cat([prob.kv_cache, torch.zeros((need,) + tuple(prob.kv_cache.shape[1:]), dtype=torch.uint8,
                                                  device="cuda")])
    block_table = spare.repeat(len(lens), 1).cuda()
    block_table[:, : prob.block_table.shape[1]] = prob.block_table
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    qsl = qsl.cuda()
    n = sum(q_lens)
    gen = torch.Generator().manual_seed(n)
    query = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16).cuda()
    key = torch.randn(n, hk, d, generator=gen).to(torch.bfloat16).cuda()
    value = torch.randn(n, hk, d, generator=gen).to(torch.bfloat16).cuda()
    sk = torch.randn(hq, generator=gen).cuda() if sinks else None
    args = (cache, block_table, seq_lens, qsl, d ** -0.5)
    ref = R.prefill_attention(query.float(), key, value, *args, sinks=sk, sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    _assert_path(fp4_path, plans.plan_prefill(query, key, value, *args, sk, window, softcap, out))
    uq.prefill_attention(query, key, value, *args, sinks=sk, sliding_window=window, softcap=softcap, out=out)
    torch.cuda.synchronize()
    check_close(out, ref, name)


@pytest.mark.parametrize("head_major", [False, True])
def test_dequant(head_major):
    prob = make_paged([1, 64, 65, 3000], 4, 128, 64, seed=5, device="cuda", head_major=head_major)
    got_k, got_v = uq.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    ref_k, ref_v = R.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    for a, b in zip(got_k + got_v, ref_k + ref_v, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
