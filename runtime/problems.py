"""The self-test problems, one per kernel: small inputs matching a blob's constexprs, launched through
the blob, checked against :mod:`ultraquant.reference`.

Each problem builds its launch with the same ``plan_*`` function dispatch uses and first checks that
the plan's config key is the blob's (a problem that would test another variant is a failure, not a
pass). Sizes are chosen to cross the interesting boundaries cheaply: several programs per launch,
more than one KV split in decode, a skipped slot in store, a cached prefix plus a causal chunk in
prefill. Inputs come from a fixed-seed CPU generator, so a verdict is reproducible.

Pass criteria are loose enough for legitimate rounding (bf16 outputs, butterfly vs matmul rotation
near ties) and far tighter than any wrong kernel: a blob with the wrong encoder, head size or
feature flags fails them.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ultraquant import reference
from ultraquant.format import SlotLayout, hadamard, slot_size
from ultraquant.kernels import plans, specialization
from ultraquant.kernels.families import store as store_family
from ultraquant.kernels.plans import LaunchPlan
from ultraquant.kernels.specialization import Specialization

from .loader import Kernel

Problem = Callable[[Kernel, Specialization, int], tuple[bool, str]]
"""(kernel under test, its specialization, device index) -> (passed, detail)."""

PROBLEMS: dict[str, Problem] = {}
"""Kernel name -> its self-test problem (:func:`register`); :mod:`.selftest` runs them."""


def register(kernel_name: str) -> Callable[[Problem], Problem]:
    """Decorator: the self-test problem for blobs of kernel ``kernel_name``."""

    def deco(fn: Problem) -> Problem:
        PROBLEMS[kernel_name] = fn
        return fn

    return deco


SELFTEST_VERSION = 11
"""Version of the self-test problems and pass criteria below, part of every cached verdict's key: bump
it whenever this file changes what a self-test launches or accepts, so verdicts recorded with the old
problems are not trusted. 1: the problems of sessions 1-2; 2: verdicts also bound to the manifest key;
3: a problem accepts blobs whose key differs only in the alignment facts (``Specialization.runnable_as``);
4: the decode problem's query blocks differ in scale and keys weigh K positions 16-63 (MFMA layouts);
5: the whole-page decode problem (head-major cache, several splits); 6: a few-rows store blob is told by its
target's spec (8 rows on NVIDIA); 7: kernels renamed by design (``uq_decode_splitkv``,
``uq_decode_wholepage``: manifest keys changed); 8: the multi-query decode problem
(``uq_decode_multiquery``), the whole-page problem on several programs of the balanced schedule;
9: the decode problem's K and V groups scaled per token by 2**-12..2**12, with outliers, a zero group
and negative zeros (the FlyDSL fp16 decode, issue 26); 10: the multi-query problem launches the blob's
own M tiles per program (``TILES``); 11: the whole-page problem over token-major pages for a ``TOKEN_MAJOR`` blob."""

PROBLEMS_SOURCE_SHA256 = "9bb44480293382f5023659a535c3a268808c79a5303546dba64e239bad35d60a"
"""sha256 of this file with this line's hash blanked (see :func:`source_hash`); a test fails when the
file changes and this is not updated, the reminder to bump :data:`SELFTEST_VERSION`."""

_DTYPES = {name: dtype for dtype, name in specialization.DTYPE_NAMES.items()}
_ENCODERS = {i: name for name, i in store_family.ENCODER_IDS.items()}
TIE_VALUES = (6.0, 0.75, 1.75, 2.5, 3.5, 5.0, 0.25, 1.25)
"""A group with absmax 6 has scale 1, so these land exactly on E2M1 decision points: encoders that
break ties differently (rne vs upstream) write different codes for them."""

Device = int | torch.device
"""A CUDA device index, or any torch device (the CPU tests run the problems under Triton's interpreter)."""

ATTENTION_RTOL = 2e-2
"""Relative (Frobenius) error allowed for attention/dequant outputs against the float64 reference."""


def _dtype(spec: Specialization, param: str) -> torch.dtype:
    return _DTYPES[spec.signature[param].lstrip("*")]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(20261129)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _launch(kernel: Kernel, plan: LaunchPlan, dev: Device) -> str | None:
    """Launch ``plan`` through ``kernel`` and wait; the reason it cannot be used, if any."""
    e = kernel.entry
    if e.kernel != plan.spec.kernel and e.alternate_of != plan.spec.kernel or \
            e.key not in {s.key() for s in plan.spec.runnable_as(e.kernel)}:
        return f"the self-test problem planned {plan.spec.key()}, not this blob's {kernel.entry.key}"
    kernel.launch(plan.args, plan.grid)
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)
    return None


def _paged(dev: Device, lens: list[int], hk: int, d: int, block_size: int, kv_dtype: torch.dtype,
           gen: torch.Generator, key_weight: torch.Tensor | None = None, group_scales: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A reference-filled cache with a shuffled block table; returns cache, table, lens, raw K, raw V.
    ``key_weight`` (D,): per-position weight of the keys in the rotated space the cache holds.
    ``group_scales``: K and V groups scaled per token by powers of two (:func:`scaled_groups`)."""
    nblocks = sum(-(-n // block_size) for n in lens) + 1
    cache = torch.randint(0, 256, (nblocks, block_size, hk, slot_size(d)), dtype=torch.uint8, generator=gen)
    table, slots = reference.allocate_blocks(lens, block_size, nblocks, gen)
    total = sum(lens)
    k = torch.randn(total, hk, d, generator=gen)
    v = torch.randn(total, hk, d, generator=gen)
    if key_weight is not None:
        k = k * key_weight
    if group_scales:
        k, v = scaled_groups(k, GROUP_EXPONENTS_K, gen), scaled_groups(v, GROUP_EXPONENTS_V, gen)
        k = k * (d**0.5 / k.norm(dim=-1, keepdim=True).clamp_min(1e-30))  # moderate logits
    if key_weight is not None or group_scales:
        k = k @ hadamard(d)  # H is symmetric and orthonormal: the store rotates it back
    k = k.to(kv_dtype)
    v = v.to(kv_dtype)
    cache, table, k, v = (t.to(dev) for t in (cache, table, k, v))
    reference.store_kv(k, v, cache, slots.to(dev))
    return cache, table, torch.tensor(lens, dtype=torch.int32, device=dev), k, v


def _options(c: dict, hq: int, gen: torch.Generator, dev: Device) -> tuple:
    sinks = torch.randn(hq, generator=gen).to(dev) if c.get("HAS_SINKS") else None
    window = 24 if c.get("HAS_WINDOW") else None
    softcap = 1.5 if c.get("HAS_SOFTCAP") else None  # small: the cap must change the result
    return sinks, window, softcap


@register("uq_store_kv")
def store_problem(kernel: Kernel, spec: Specialization, dev: Device) -> tuple[bool, str]:
    """19 tokens x 2 kv heads (two programs, a partial one), one skipped slot, tie values in V."""
    c, gen = spec.constexprs, _gen()
    d, encoder = c["D"], _ENCODERS[c["ENCODER"]]
    n, hk, bs, nblocks = 19, 2, 16, 3
    key = (torch.randn(n, hk, d, generator=gen) * 2).to(_dtype(spec, "key_ptr"))
    value = (torch.randn(n, hk, d, generator=gen) * 2)
    value[0, 0, :32] = torch.tensor(TIE_VALUES * 4) * torch.tensor([1.0, -1.0] * 16)
    value = value.to(_dtype(spec, "value_ptr"))
    slots = torch.randperm(nblocks * bs, generator=gen)[:n]
    slots[3] = -1
    slots = slots.to(_dtype(spec, "slot_ptr"))
    poison = torch.randint(0, 256, (nblocks, bs, hk, slot_size(d)), dtype=torch.uint8, generator=gen)
    key, value, slots, ours = (t.to(dev) for t in (key, value, slots, poison))
    want = ours.clone()
    few = store_family.store_spec(head_size=d, encoder=encoder, few_rows=True,
                           target=plans.target_of(key.device)).constexprs["BLOCK_R"] == c["BLOCK_R"]
    why = _launch(kernel, plans.plan_store(key, value, ours, slots, encoder, few_rows=few), dev)
    if why:
        return False, why
    reference.store_kv(key, value, want, slots, encoder=encoder)
    lay = SlotLayout(d)
    v_bad = int((ours[..., lay.v_codes:] != want[..., lay.v_codes:]).sum())
    k_bad = int((ours[..., : lay.v_codes] != want[..., : lay.v_codes]).sum())
    written = slots[slots >= 0].long()
    k_err = _rel_err(*(reference.dequantize(t[..., : lay.k_scales], t[..., lay.k_scales: lay.v_codes],
                                            rotate=True)
                       for t in (ours.flatten(0, 1)[written], want.flatten(0, 1)[written])))
    ok = v_bad == 0 and k_bad <= 0.02 * ours[..., : lay.v_codes].numel() and k_err <= ATTENTION_RTOL
    return ok, f"V/untouched bytes differing: {v_bad}; K bytes differing: {k_bad}; K rel err {k_err:.2e}"


BLOCK_EXPONENTS = (-8, 4)
"""Range of the power-of-two scale of each rotated 32-element query block in the decode problem."""


def block_scaled_query(shape: tuple[int, ...], d: int, gen: torch.Generator) -> torch.Tensor:
    """A query whose rotated 32-element blocks differ in scale by up to 2**12 (random per block),
    normalized to norm sqrt(D) so the logits stay moderate; returned in the original space.

    A kernel that scales a block by another block's scale (the gfx950 scaled MFMA takes one E8M0
    scale per 32-element K block), or pairs query and key elements wrongly, is far off on it."""
    rot = torch.randn(*shape, d, generator=gen)
    exps = torch.randint(BLOCK_EXPONENTS[0], BLOCK_EXPONENTS[1] + 1, (*shape, d // 32), generator=gen)
    rot = rot * torch.exp2(exps.float()).repeat_interleave(32, dim=-1)
    rot = rot * (d**0.5 / rot.norm(dim=-1, keepdim=True))
    return rot @ hadamard(d)


GROUP_EXPONENTS_V = (-12, 12)
GROUP_EXPONENTS_K = (-6, 6)
"""Ranges of the per-(token, 32-group) power-of-two factors of V and of the rotated K in the decode
problem (K is then normalized per token, so its groups span 2**12 too)."""


def scaled_groups(x: torch.Tensor, exps: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """(..., D) values whose 32-element groups are scaled by random powers of two in ``exps``, with
    what a decode that folds a group's scale into another operand can get wrong: one outlier (x64)
    per group of the first token, an all-zero group and negative zeros (codes of sign 1, value 0).

    A kernel that applies one group's or token's scale to another, overflows or flushes a range of
    scales, or turns -0 into a nonzero value is far off on it."""
    sh = x.shape
    g = x.reshape(*sh[:-1], sh[-1] // 32, 32).clone()
    e = torch.randint(exps[0], exps[1] + 1, g.shape[:-1], generator=gen)
    g = g * torch.exp2(e.float())[..., None]
    g[0, ..., 5] *= 64.0  # outliers: the group's scale follows them, its other codes get coarse
    g[1, ..., 1, :] = 0.0  # an all-zero group (scale byte 0)
    g[2, ..., ::3] = -0.0  # negative zeros among the codes
    return g.reshape(sh)


def key_weight(d: int) -> torch.Tensor:
    """Rotated-space key weights: K positions 16..63 of every 128 count 4x, so a kernel that gets the
    pairing of those positions wrong (the FP8 operand's second lane group and halves) fails."""
    pos = torch.arange(d) % 128
    return torch.where((pos >= 16) & (pos < 64), 4.0, 1.0)


@register("uq_decode_splitkv")
def decode_problem(kernel: Kernel, spec: Specialization, dev: Device) -> tuple[bool, str]:
    """3 requests (300, 1, 45 tokens) x 2 kv heads: at least two KV splits, one single-token request;
    a block-scaled query (:func:`block_scaled_query`) against keys weighted by :func:`key_weight`, K
    and V groups scaled per token (:func:`scaled_groups`: the FlyDSL fp16 decode applies K's scale
    after each group's MFMAs and folds V's into P)."""
    return _decode_check(kernel, spec, dev, [300, 1, 45], 2, False, plans.plan_decode, group_scales=True)


@register("uq_decode_wholepage")
def decode_wholepage_problem(kernel: Kernel, spec: Specialization, dev: Device) -> tuple[bool, str]:
    """The whole-page decode over a head-major copy of a paged cache (token-major pages for a ``TOKEN_MAJOR``
    blob): 3 requests (1100, 1, 45 tokens) x the blob's kv heads, so the longest takes several splits (512
    tokens each at least) and the ring's last stage is partial; the block-scaled query and weighted keys of
    :func:`decode_problem`."""
    from ultraquant.kernels.families.decode_wholepage import plan_decode_wholepage

    head_major = not spec.constexprs.get("TOKEN_MAJOR", False)
    return _decode_check(kernel, spec, dev, [1100, 1, 45], spec.constexprs["HK"], head_major, plan_decode_wholepage)


def _decode_check(kernel: Kernel, spec: Specialization, dev: Device, lens: list[int], hk: int, head_major: bool,
                  planner: Callable[..., LaunchPlan], group_scales: bool = False) -> tuple[bool, str]:
    """Launch ``planner``'s decode of ``lens`` x ``hk`` kv heads (a head-major copy of the cache if
    ``head_major``) through ``kernel``; the verdict against the float64 reference."""
    c, gen = spec.constexprs, _gen()
    d, gqa, bs = c["D"], c["GQA"], c["BLOCK_SIZE"]
    hq = gqa * hk
    qd, od = _dtype(spec, "q_ptr"), _dtype(spec, "out_ptr")
    cache, table, seq_lens, _, _ = _paged(dev, lens, hk, d, bs, torch.float32, gen, key_weight(d), group_scales)
    if head_major:  # whole 16-token runs per kv head: what the whole-page decode reads
        paged, cache = cache, torch.empty((cache.shape[0], hk, bs, cache.shape[3]), dtype=cache.dtype,
                                          device=dev).transpose(1, 2)
        cache.copy_(paged)
    n = len(lens)
    query = block_scaled_query((n, hq), d, gen).to(qd).to(dev)
    sinks, window, softcap = _options(c, hq, gen, dev)
    scale = d ** -0.5
    out = torch.full((n, hq, d), float("nan"), dtype=od, device=dev)
    why = _launch(kernel, planner(query, cache, table, seq_lens, scale, sinks, window, softcap, out), dev)
    if why:
        return False, why
    want = reference.decode_attention(query.float(), cache, table, seq_lens, scale, sinks=sinks,
                                      sliding_window=window, softcap=softcap)
    err = _rel_err(out, want)
    return bool(torch.isfinite(out).all()) and err <= ATTENTION_RTOL, f"rel err {err:.2e}"


@register("uq_decode_multiquery")
def decode_multiquery_problem(kernel: Kernel, spec: Specialization, dev: Device) -> tuple[bool, str]:
    """A speculative-decoding step over a head-major copy of a paged cache: 4 requests (1100, 5, 45, 30
    tokens) x the blob's kv heads with 8, 5, 1 and 0 new tokens (ragged; two M tiles at GQA >= 3), their
    K/V in the cache; the longest spans several pieces of the balanced schedule. Block-scaled query, weighted
    keys."""
    from ultraquant.kernels.families.decode_multiquery import plan_decode_multiquery

    c, gen = spec.constexprs, _gen()
    d, gqa, bs, hk = c["D"], c["GQA"], c["BLOCK_SIZE"], c["HK"]
    hq, lens, news = gqa * hk, [1100, 5, 45, 30], [8, 5, 1, 0]
    qd, od = _dtype(spec, "q_ptr"), _dtype(spec, "out_ptr")
    paged, table, seq_lens, _, _ = _paged(dev, lens, hk, d, bs, torch.float32, gen, key_weight(d))
    cache = torch.empty((paged.shape[0], hk, bs, paged.shape[3]), dtype=paged.dtype, device=dev).transpose(1, 2)
    cache.copy_(paged)
    n = sum(news)
    qsl = torch.tensor([0, *itertools.accumulate(news)], dtype=torch.int32, device=dev)
    query = block_scaled_query((n, hq), d, gen).to(qd).to(dev)
    sinks, window, softcap = _options(c, hq, gen, dev)
    scale = d ** -0.5
    out = torch.full((n, hq, d), float("nan"), dtype=od, device=dev)
    plan = plan_decode_multiquery(query, cache, table, seq_lens, qsl, 8, scale, sinks, window, softcap, out,
                                  program_tiles=c["TILES"])
    why = _launch(kernel, plan, dev)
    if why:
        return False, why
    want = reference.spec_decode_attention(query.float(), cache, table, seq_lens, qsl, scale, max_query_len=8,
                                           sinks=sinks, sliding_window=window, softcap=softcap)
    err = _rel_err(out, want)
    return bool(torch.isfinite(out).all()) and err <= ATTENTION_RTOL, f"rel err {err:.2e}"


@register("uq_prefill")
def prefill_problem(kernel: Kernel, spec: Specialization, dev: Device) -> tuple[bool, str]:
    """A continuation (40 cached + 7 new tokens) and a first chunk (5 new) in one launch."""
    c, gen = spec.constexprs, _gen()
    d, gqa, bs = c["D"], c["GQA"], c["BLOCK_SIZE"]
    hk = 2
    hq = gqa * hk
    qd, kd, od = _dtype(spec, "q_ptr"), _dtype(spec, "k_ptr"), _dtype(spec, "out_ptr")
    cache, table, lens, k_all, v_all = _paged(dev, [47, 5], hk, d, bs, kd, gen)
    new = torch.cat([torch.arange(40, 47), torch.arange(47, 52)]).to(dev)
    key, value = k_all[new].contiguous(), v_all[new].contiguous()
    qsl = torch.tensor([0, 7, 12], dtype=torch.int32, device=dev)
    query = torch.randn(12, hq, d, generator=gen).to(qd).to(dev)
    sinks, window, softcap = _options(c, hq, gen, dev)
    scale = d ** -0.5
    out = torch.full((12, hq, d), float("nan"), dtype=od, device=dev)
    plan = plans.plan_prefill(query, key, value, cache, table, lens, qsl, scale, sinks, window, softcap, out)
    why = _launch(kernel, plan, dev)
    if why:
        return False, why
    want = reference.prefill_attention(query.float(), key.float(), value.float(), cache, table, lens, qsl,
                                       scale, sinks=sinks, sliding_window=window, softcap=softcap)
    err = _rel_err(out, want)
    return bool(torch.isfinite(out).all()) and err <= ATTENTION_RTOL, f"rel err {err:.2e}"


@register("uq_dequant_kv")
def dequant_problem(kernel: Kernel, spec: Specialization, dev: Device) -> tuple[bool, str]:
    """2 requests (70 and 3 tokens) x 2 kv heads back to K (original or rotated space) and V."""
    c, gen = spec.constexprs, _gen()
    d, bs = c["D"], c["BLOCK_SIZE"]
    hk, lens = 2, [70, 3]
    od = _dtype(spec, "k_out_ptr")
    cache, table, seq_lens, _, _ = _paged(dev, lens, hk, d, bs, torch.float32, gen)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=dev)
    k_out = torch.full((sum(lens), hk, d), float("nan"), dtype=od, device=dev)
    v_out = torch.full_like(k_out, float("nan"))
    plan = plans.plan_dequant(cache, table, seq_lens, cu, k_out, v_out, d, bool(c["ORIGINAL_SPACE"]))
    why = _launch(kernel, plan, dev)
    if why:
        return False, why
    keys, values = reference.dequant_kv(cache, table, seq_lens)
    want_k, want_v = torch.cat(keys), torch.cat(values)
    if not c["ORIGINAL_SPACE"]:
        want_k = want_k @ hadamard(d, device=want_k.device, dtype=want_k.dtype)
    err = max(_rel_err(k_out, want_k), _rel_err(v_out, want_v))
    return bool(torch.isfinite(k_out).all() and torch.isfinite(v_out).all()) and err <= ATTENTION_RTOL, \
        f"rel err {err:.2e}"


def source_hash() -> str:
    """sha256 of this file's source with the value of :data:`PROBLEMS_SOURCE_SHA256` blanked."""
    text = Path(__file__).read_text()
    text = re.sub(r'^PROBLEMS_SOURCE_SHA256 = "[0-9a-f]*"', 'PROBLEMS_SOURCE_SHA256 = ""', text, flags=re.M)
    return hashlib.sha256(text.encode()).hexdigest()
