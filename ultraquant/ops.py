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


# ---------------------------------------------------------------- store


def _store_kv_impl(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 encoder: str) -> None:
    if policy.route(key.device) == "reference":
        reference.store_kv(key, value, kv_cache, slot_mapping, encoder=encoder)
        return
    policy.launch(plans.plan_store(_last_dim_contiguous(key), _last_dim_contiguous(value), kv_cache,
                                     slot_mapping, encoder))


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
    if _validating():
        validate.check_store(key, value, kv_cache, slot_mapping, encoder)
    if key.shape[0] == 0:
        return
    _op("store_kv", _store_kv_impl)(key, value, kv_cache, slot_mapping, encoder)


# ---------------------------------------------------------------- decode


def _decode_impl(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
               out: torch.Tensor) -> None:
    if policy.route(query.device) == "reference":
        reference.decode_attention(query, kv_cache, block_table, seq_lens, scale, sinks=sinks,
                                   sliding_window=sliding_window, softcap=softcap, out=out)
        return
    policy.launch(plans.plan_decode(_last_dim_contiguous(query), kv_cache, block_table, seq_lens, scale,
                                      sinks, sliding_window, softcap, out, config.get().tuning))


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
    if _validating():
        validate.check_decode(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap,
                              out)
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(-1) != 1:
        raise UltraQuantError("out: the last dimension must be contiguous")
    if query.shape[0]:
        _op("decode_attention", _decode_impl)(query, kv_cache, block_table, seq_lens, float(scale), sinks,
                                              sliding_window, None if softcap is None else float(softcap), out)
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
