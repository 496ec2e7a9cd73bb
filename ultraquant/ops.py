"""The public UltraQuant ops: same signatures as :mod:`ultraquant.reference`, kernels behind them.

``store_kv``, ``decode_attention`` and ``prefill_attention`` are registered as PyTorch custom ops
(``torch.ops.ultraquant.*``, mutating ``kv_cache`` / ``out``) with fake implementations, so
``torch.compile`` traces through them and CUDA graphs capture their launches. Each call validates
metadata on the host (no device sync on GPU tensors), then :mod:`ultraquant.policy` picks the
backend: the Triton kernels (or an AOT blob in front of them) on a GPU, the reference on the CPU.

``dequant_kv`` returns per-request lists (data-dependent shapes), so it reads ``seq_lens`` on the
host; :func:`dequant_kv_packed` is its sync-free form writing into caller-provided buffers.
"""

from __future__ import annotations

import torch

from . import config, policy, reference, validate
from .errors import UltraQuantError
from .kernels import flags, heuristics, plans
from .kernels.flags import KernelError

__all__ = ["store_kv", "decode_attention", "dequant_kv", "dequant_kv_packed", "prefill_attention",
           "spec_decode_attention", "spec_decode_takes_kernel", "spec_decode_served",
           "check_errors", "KernelError", "CONTINUATION_THRESHOLD"]

CONTINUATION_THRESHOLD = heuristics.CONTINUATION_THRESHOLD
"""Small/large continuation-chunk boundary (new tokens) the attention layer reads."""


def _validating() -> bool:
    """Validate on eager calls; skip while torch.compile traces (CPU value checks would read data and
    break the graph; the eager warm-up call that precedes capture/compile validated the same shapes)."""
    return not torch.compiler.is_compiling()


def _op(name: str, impl):
    """The callable for one op: under torch.compile the registered custom op (so the graph holds it),
    in eager mode its implementation directly. Calling through ``torch.ops`` in eager mode imports
    ``torch._dynamo`` on the first call (about 4.5 s), which would dwarf the AOT path's start-up gain."""
    return getattr(torch.ops.ultraquant, name) if torch.compiler.is_compiling() else impl


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dimension with stride 1; copy only when that is not so."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_errors(device: torch.device | str | None = None) -> KernelError:
    """Out-of-range values the kernels met since the last call (on ``device``; every device when None),
    then reset: :class:`KernelError` bits, 0 when none. The kernels only store a word on device
    memory (no sync on the hot path); this call copies the words to the host, so it waits for the
    current stream: call it between steps (never inside a captured graph). The CPU value checks
    (and ``ULTRAQUANT_CHECK_VALUES=1``) reject such values before a launch instead."""
    return flags.read_errors(device)


# ---------------------------------------------------------------- the cached host path
#
# Eager calls of one signature (every tensor's class, shape, strides, dtype and device, the scalar
# options, the config) validate the same static facts and plan the same launch. The first call of a
# signature validates and plans; later calls look the plan up and only swap in their own tensors.
# Value checks (CPU tensors, ULTRAQUANT_CHECK_VALUES=1) still run on every call.


class _Prepared:
    """One signature's launch minus the call's own tensors: ``args = pick(inputs + consts)``."""

    __slots__ = ("aot", "grid", "consts", "pick", "validate_each_call")

    def __init__(self, plan: plans.LaunchPlan, inputs: tuple, validate_each_call: bool) -> None:
        from operator import itemgetter

        # The plans list the call's tensors in the call's order, among constants (workspaces, stand-ins
        # for absent options, static scalars): match them in order (so aliased inputs stay apart), and
        # refuse a plan that does not use each given tensor once (it used a copy).
        consts, index, nxt = [], [], 0
        for a in plan.args:
            hit = next((i for i in range(nxt, len(inputs)) if inputs[i] is a), None) \
                if isinstance(a, torch.Tensor) else None
            if hit is None:
                index.append(len(inputs) + len(consts))
                consts.append(a)
            else:
                index.append(hit)
                nxt = hit + 1
        if sorted(i for i in index if i < len(inputs)) != [i for i, x in enumerate(inputs) if x is not None]:
            raise _NotCacheable
        self.grid, self.consts = plan.grid, tuple(consts)
        self.pick = itemgetter(*index)
        self.aot = policy.prepare(plan)
        self.validate_each_call = validate_each_call

    def run(self, inputs: tuple) -> None:
        policy.launch_prepared(self.aot, self.pick(inputs + self.consts), self.grid)


class _NotCacheable(Exception):
    pass


_PREPARED: dict[tuple, _Prepared] = {}
_PREPARED_CONFIG: list[config.Config | None] = [None]
MAX_SIGNATURES = 4096
"""Signatures kept before the cache starts over (shapes a server sees are few; this bounds a sweep)."""


def _t(t: object) -> tuple | None:
    """The static facts of an optional tensor argument (None stays None). The required ones are
    spelled out in the callers (one flat tuple, no call per tensor); what the plans and validation
    ignore (seq_lens' and slot_mapping's strides: read as contiguous) is left out."""
    return None if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device)


def _prepared(sig: tuple) -> _Prepared | None:
    cfg = config.get()
    if _PREPARED_CONFIG[0] is not cfg:  # a switch changed (config.reload()): plans may differ
        _PREPARED.clear()
        _PREPARED_CONFIG[0] = cfg
        return None
    return _PREPARED.get(sig)


def _prepare(sig: tuple, plan: plans.LaunchPlan, inputs: tuple, *value_tensors: torch.Tensor) -> None:
    """Remember ``plan`` for calls of signature ``sig`` (unless it depends on more than ``inputs``)."""
    try:
        prepared = _Prepared(plan, inputs, validate.values_checkable(*value_tensors))
    except _NotCacheable:
        return
    if len(_PREPARED) >= MAX_SIGNATURES:
        _PREPARED.clear()
    _PREPARED[sig] = prepared


def forget_prepared() -> None:
    """Drop every cached plan (tests; the next call of each signature validates and plans again)."""
    _PREPARED.clear()


# ---------------------------------------------------------------- store


def _store_kv_impl(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 encoder: str) -> None:
    _store_kv_run(key, value, kv_cache, slot_mapping, encoder, None)


def _store_kv_run(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  encoder: str, sig: tuple | None) -> None:
    """The store's implementation; with ``sig``, its plan is kept for later calls of that signature."""
    if policy.route(key.device) == "reference":
        reference.store_kv(key, value, kv_cache, slot_mapping, encoder=encoder)
        return
    plan = plans.plan_store(_last_dim_contiguous(key), _last_dim_contiguous(value), kv_cache, slot_mapping, encoder)
    if sig is not None:
        _prepare(sig, plan, (key, value, kv_cache, slot_mapping), slot_mapping)
    policy.launch(plan)


_store_kv_op = torch.library.custom_op("ultraquant::store_kv", _store_kv_impl, mutates_args=("kv_cache",))


@_store_kv_op.register_fake
def _store_kv_fake(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   encoder: str) -> None:
    return None


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             *, encoder: str = "rne") -> None:
    """Quantize each token's K (rotated) and V into ``kv_cache`` at ``slot_mapping`` (negative: skip).

    See :func:`ultraquant.reference.store_kv`; the kernel writes the same bytes.
    """
    if torch.compiler.is_compiling():
        torch.ops.ultraquant.store_kv(key, value, kv_cache, slot_mapping, encoder)
        return
    try:
        sig = ("store", key.__class__, key.shape, key.stride(), key.dtype, key.device,
               value.__class__, value.shape, value.stride(), value.dtype, value.device,
               kv_cache.__class__, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
               slot_mapping.__class__, slot_mapping.shape, slot_mapping.dtype, slot_mapping.device, encoder)
        prepared = _prepared(sig)
    except (AttributeError, TypeError):  # not tensors (validation words it) or unhashable options
        sig = prepared = None
    if prepared is not None:
        if prepared.validate_each_call:
            validate.check_store(key, value, kv_cache, slot_mapping, encoder)
        prepared.run((key, value, kv_cache, slot_mapping))
        return
    validate.check_store(key, value, kv_cache, slot_mapping, encoder)
    if key.shape[0] == 0:
        return
    _store_kv_run(key, value, kv_cache, slot_mapping, encoder, sig)


# ---------------------------------------------------------------- decode


def _decode_impl(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
               out: torch.Tensor) -> None:
    _decode_run(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out, None)


def _decode_run(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                scale: float, sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                out: torch.Tensor, sig: tuple | None) -> None:
    """The decode's implementation; with ``sig``, its plan is kept for later calls of that signature."""
    if policy.route(query.device) == "reference":
        reference.decode_attention(query, kv_cache, block_table, seq_lens, scale, sinks=sinks,
                                   sliding_window=sliding_window, softcap=softcap, out=out)
        return
    plan = plans.plan_decode(_last_dim_contiguous(query), kv_cache, block_table, seq_lens, scale, sinks,
                             sliding_window, softcap, out, config.get().tuning)
    if sig is not None:
        _prepare(sig, plan, (query, kv_cache, block_table, seq_lens, sinks, out), block_table, seq_lens)
    policy.launch(plan)


_decode_op = torch.library.custom_op("ultraquant::decode_attention", _decode_impl, mutates_args=("out",))


@_decode_op.register_fake
def _decode_fake(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                 out: torch.Tensor) -> None:
    return None


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, *, sinks: torch.Tensor | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per request over its paged, quantized sequence: (B, Hq, D) into ``out``.

    On a GPU this is one kernel launch with a grid fixed by static shapes (graph-capturable);
    ``out`` must have a unit stride on its last dimension.
    """
    if torch.compiler.is_compiling():
        out = torch.empty_like(query) if out is None else out
        if query.shape[0]:
            torch.ops.ultraquant.decode_attention(query, kv_cache, block_table, seq_lens, float(scale), sinks,
                                                  sliding_window, None if softcap is None else float(softcap), out)
        return out
    try:
        sig = ("decode", query.__class__, query.shape, query.stride(), query.dtype, query.device,
               kv_cache.__class__, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
               kv_cache.data_ptr() % 16,  # the plan's rule reads it (the whole-page decode needs 16-byte aligned pages)
               block_table.__class__, block_table.shape, block_table.stride(), block_table.dtype,
               block_table.device, seq_lens.__class__, seq_lens.shape, seq_lens.dtype, seq_lens.device,
               _t(sinks), _t(out),
               scale.__class__, scale, sliding_window.__class__, sliding_window, softcap.__class__, softcap)
        prepared = _prepared(sig)
    except (AttributeError, TypeError):
        sig = prepared = None
    if prepared is not None:
        if prepared.validate_each_call:
            validate.check_decode(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap,
                                  out)
        if out is None:
            out = torch.empty_like(query)
        prepared.run((query, kv_cache, block_table, seq_lens, sinks, out))
        return out
    validate.check_decode(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out)
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(-1) != 1:
        raise UltraQuantError("out: the last dimension must be contiguous")
    if query.shape[0]:
        _decode_run(query, kv_cache, block_table, seq_lens, float(scale), sinks, sliding_window,
                    None if softcap is None else float(softcap), out, sig)
    return out


# ---------------------------------------------------------------- prefill


def _prefill_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                out: torch.Tensor) -> None:
    if policy.route(query.device) == "reference":
        reference.prefill_attention(query, key, value, kv_cache, block_table, seq_lens, query_start_loc, scale,
                                    sinks=sinks, sliding_window=sliding_window, softcap=softcap, out=out)
        return
    policy.launch(plans.plan_prefill(_last_dim_contiguous(query), _last_dim_contiguous(key),
                                       _last_dim_contiguous(value), kv_cache, block_table, seq_lens,
                                       query_start_loc, scale, sinks, sliding_window, softcap, out,
                                       config.get().tuning))


_prefill_op = torch.library.custom_op("ultraquant::prefill_attention", _prefill_impl, mutates_args=("out",))


@_prefill_op.register_fake
def _prefill_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                  sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                  out: torch.Tensor) -> None:
    return None


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      scale: float, *, sinks: torch.Tensor | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen prefill chunks over the cached prefix and, causally, the chunk's raw K/V: (N, Hq, D).

    One kernel launch whose grid is bounded from N and B (no host sync), so it also serves small
    continuation chunks (decode-shaped, many queries per kv head).
    """
    if _validating():
        validate.check_prefill(query, key, value, kv_cache, block_table, seq_lens, query_start_loc, scale,
                               sinks, sliding_window, softcap, out)
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(-1) != 1:
        raise UltraQuantError("out: the last dimension must be contiguous")
    if query.shape[0]:
        _op("prefill_attention", _prefill_impl)(query, key, value, kv_cache, block_table, seq_lens,
                                                query_start_loc, float(scale), sinks, sliding_window,
                                                None if softcap is None else float(softcap), out)
    return out


# ---------------------------------------------------------------- speculative-decoding steps


def spec_decode_takes_kernel(query: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int) -> bool:
    """True when :func:`spec_decode_attention` on these tensors runs the multi-query decode kernel
    (NVIDIA sm_90 coverage, :func:`ultraquant.kernels.plans.takes_multiquery`); False where the
    attention layer keeps the step on ``prefill_attention`` (CPU, AMD, D=256, token-major caches)."""
    if policy.route(query.device) == "reference":
        return False
    hk = kv_cache.shape[2]
    return plans.takes_multiquery(query.shape[2], query.shape[1] // hk, hk, kv_cache.shape[1],
                                  tuple(kv_cache.stride()), query.device, int(max_query_len), config.get().tuning,
                                  kv_cache.data_ptr() % 16 == 0)


def spec_decode_served(query: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int) -> bool:
    """True when :func:`spec_decode_attention` serves these tensors: the reference (CPU tensors) or the
    multi-query decode (:func:`spec_decode_takes_kernel`)."""
    return policy.route(query.device) == "reference" or spec_decode_takes_kernel(query, kv_cache, max_query_len)


def _spec_decode_impl(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                      sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                      out: torch.Tensor) -> None:
    if policy.route(query.device) == "reference":
        reference.spec_decode_attention(query, kv_cache, block_table, seq_lens, query_start_loc, scale,
                                        max_query_len=max_query_len, sinks=sinks, sliding_window=sliding_window,
                                        softcap=softcap, out=out)
        return
    if not spec_decode_takes_kernel(query, kv_cache, max_query_len):
        raise UltraQuantError(
            "spec_decode_attention: no kernel serves this step here (the multi-query decode needs sm_90, D=128, "
            "a head-major 16-byte aligned cache, <= 16 new tokens per request); use prefill_attention with the "
            "step's raw K/V")
    policy.launch(plans.plan_spec_decode(_last_dim_contiguous(query), kv_cache, block_table, seq_lens,
                                         query_start_loc, max_query_len, scale, sinks, sliding_window, softcap, out,
                                         config.get().tuning))


_spec_decode_op = torch.library.custom_op("ultraquant::spec_decode_attention", _spec_decode_impl,
                                          mutates_args=("out",))


@_spec_decode_op.register_fake
def _spec_decode_fake(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                      sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                      out: torch.Tensor) -> None:
    return None


def spec_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                          max_query_len: int, sinks: torch.Tensor | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """A speculative-decoding step: up to ``max_query_len`` (<= 16) new tokens per request, whose K/V
    the step already stored in the cache, each attending causally to the cache: (N, Hq, D).

    One launch of the multi-query decode (grid from static shapes and ``max_query_len``; per-request
    counts read from ``query_start_loc`` on the device: graph-capturable at the largest count). See
    :func:`ultraquant.reference.spec_decode_attention`; :func:`spec_decode_takes_kernel` says where a
    kernel serves it.
    """
    if _validating():
        validate.check_spec_decode(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                                   sinks, sliding_window, softcap, out)
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(-1) != 1:
        raise UltraQuantError("out: the last dimension must be contiguous")
    if query.shape[0] and seq_lens.shape[0]:
        _op("spec_decode_attention", _spec_decode_impl)(query, kv_cache, block_table, seq_lens, query_start_loc,
                                                        int(max_query_len), float(scale), sinks, sliding_window,
                                                        None if softcap is None else float(softcap), out)
    return out


# ---------------------------------------------------------------- dequant


def dequant_kv_packed(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      cu_seqlens: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor, *,
                      original_space: bool = True) -> None:
    """Sync-free dequant: request b's tokens go to rows ``cu_seqlens[b]:cu_seqlens[b]+seq_lens[b]``.

    ``k_out``/``v_out``: (total, Hk, D) float16/bfloat16/float32 with a unit last stride; K comes back
    in the original space (or the rotated one the cache holds when ``original_space=False``). This is
    what a large prefill continuation feeds to dense attention. The Triton kernel serves GPU tensors
    (and CPU tensors under ``TRITON_INTERPRET=1``, for tests); other CPU tensors, or
    ``ULTRAQUANT_BACKEND=reference``, get the reference's values (float64 decode, rounded once to
    the output dtype), read on the host.
    """
    validate.check_tensor("k_out", k_out, dtypes=validate.FLOAT_DTYPES, ndim=3)
    d = k_out.shape[2]
    geo = validate.check_dequant(kv_cache, block_table, seq_lens, d)
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        validate.check_tensor(name, t, dtypes=validate.FLOAT_DTYPES, ndim=3, device=kv_cache.device)
        validate.check_shape(name, t, (None, geo.num_kv_heads, d))
        if t.stride(-1) != 1:
            raise UltraQuantError(f"{name}: the last dimension must be contiguous")
    validate.check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1, device=kv_cache.device)
    validate.check_shape("cu_seqlens", cu_seqlens, (seq_lens.shape[0] + 1,))
    if policy.host_reference(kv_cache.device):
        for b, (start, length) in enumerate(zip(cu_seqlens.tolist()[:-1], seq_lens.tolist(), strict=True)):
            slots = reference._request_slots(kv_cache, block_table, b, 0, length)
            k_out[start:start + length], v_out[start:start + length] = reference.decode_slots(
                slots, d, original_space=original_space)
        return
    policy.launch(plans.plan_dequant(kv_cache, block_table, seq_lens, cu_seqlens, k_out, v_out, d,
                                       original_space))


def dequant_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
               head_size: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each request's cached K (original space) and V: two lists of float32 (L_i, Hk, D) tensors.

    Reads ``seq_lens`` on the host (the result's shapes depend on it): not for a captured path.
    """
    if policy.route(kv_cache.device) == "reference":
        return reference.dequant_kv(kv_cache, block_table, seq_lens, head_size=head_size)
    # this op reads seq_lens on the host anyway (the result's shapes), so it checks every value too:
    # a garbage length would otherwise size a huge allocation
    geo = validate.check_dequant(kv_cache, block_table, seq_lens, head_size, read_values=True)
    lens = seq_lens.tolist()
    total = sum(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=kv_cache.device)
    if lens:
        cu[1:] = torch.cumsum(seq_lens, 0)
    k = torch.empty(total, geo.num_kv_heads, geo.head_size, dtype=torch.float32, device=kv_cache.device)
    v = torch.empty_like(k)
    if total:
        dequant_kv_packed(kv_cache, block_table, seq_lens, cu, k, v, original_space=True)
    return list(k.split(lens)), list(v.split(lens))
