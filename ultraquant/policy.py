"""The one backend policy: which path runs an op, which kernel variants a model needs, and the one place
a :class:`LaunchPlan` is run.

The chain is AOT blob -> Triton JIT -> reference, steered by :mod:`ultraquant.config`:

* :func:`route` names the path of a call on ``device``: ``"kernel"`` (a GPU, or CPU tensors under
  ``TRITON_INTERPRET=1`` with ``ULTRAQUANT_BACKEND=triton``, which is how CI runs the kernels; ``aot``
  always, so a CPU call is refused by the runtime) or
  ``"reference"`` (CPU tensors, or ``ULTRAQUANT_BACKEND=reference``).
* :func:`launch` runs a kernel plan: the AOT runtime first (it returns False on a miss, with the
  reason logged once; under ``aot``/``ULTRAQUANT_REQUIRE_AOT=1`` a miss raises: ``Config.strict``),
  then Triton's JIT. :func:`prepare` gives the ops' per-signature cache its AOT launcher.
* :func:`warmup` / :func:`model_specializations`: a model config -> exactly the variants the ops plan
  for it on a device (the plans' own rules), loaded before CUDA graph capture.

The runtime only loads and launches what it is handed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from . import config
from .errors import UltraQuantError
from .kernels import catalog, plans
from .kernels.families import dequant as dequant_family
from .kernels.families import store as store_family
from .kernels.families.decode_multiquery import MULTIQUERY_MAX_TOKENS, MULTIQUERY_TILES, decode_multiquery_spec
from .kernels.specialization import DTYPE_NAMES, LaunchPlan, Specialization, slot_alignment, target_of
from .runtime import launch as runtime_launch
from .runtime import try_launch
from .runtime.launch import Prepared


def route(device: torch.device) -> str:
    """``"kernel"`` or ``"reference"`` for an op whose tensors live on ``device``."""
    mode = config.get().backend
    if mode == "reference":
        return "reference"
    if mode in ("triton", "aot"):  # aot on CPU tensors: the runtime refuses with its own message
        return "kernel"
    return "reference" if device.type == "cpu" else "kernel"


def host_reference(device: torch.device) -> bool:
    """Whether a host-side op (dequant into caller buffers) computes on the host: the route is the
    reference and, on the CPU, Triton's interpreter is off (under it the kernel runs CPU tensors)."""
    cfg = config.get()
    if route(device) != "reference":
        return False
    return cfg.backend == "reference" or not cfg.triton_interpret


def launch(plan: LaunchPlan) -> None:
    """Run ``plan``: its AOT blob when the runtime has a usable one, else Triton's JIT."""
    if try_launch(plan):
        return
    from .kernels import registry  # imports triton: only when a kernel really runs through it

    registry.jit_launch(plan)


def launch_prepared(aot: Prepared, args: tuple[Any, ...], grid: tuple[int, int, int]) -> None:
    """:func:`launch` of a plan the ops cached per call signature (``aot``: its runtime launcher)."""
    if aot(args, grid):
        return
    from .kernels import registry

    registry.jit_launch(LaunchPlan(aot.spec, args, grid))


def prepare(plan: LaunchPlan) -> Prepared:
    """The AOT launcher of ``plan``'s specialization on its device, for the ops' per-signature cache."""
    return Prepared(plan.spec, runtime_launch.plan_device(plan))


def warmup(configs: Iterable[Any], device: Any = None) -> dict[str, str]:
    """Load (and self-test) every blob a model needs on ``device`` before CUDA graph capture.

    ``configs`` holds :class:`Specialization` or :class:`LaunchPlan` objects, or dicts of model
    parameters that :func:`model_specializations` turns into exactly the variants the calls on
    ``device`` plan. Returns config key -> ``"aot"`` or the miss reason. Under
    ``ULTRAQUANT_REQUIRE_AOT=1`` a miss raises."""
    dev = runtime_launch.device_of(device)
    specs: list[Any] = []
    for c in configs:
        specs.extend(model_specializations(c, dev) if isinstance(c, dict) else [c])
    return runtime_launch.warmup(specs, dev)


MODEL_OPS = ("store_kv", "dequant_kv", "decode_attention", "prefill_attention")
"""The public ops warmup plans for by default (decode covers both decode families: the plan's rule picks)."""

MODEL_KEYS = ("head_size", "block_size", "gqa", "num_q_heads", "num_kv_heads", "dtype", "query_dtype", "key_dtype",
              "out_dtype", "slot_dtype", "has_sinks", "has_window", "has_softcap", "encoder", "cache_strides", "ops")
"""Keys a model-config dict of :func:`warmup` may hold."""


def _torch_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _dtype_name(value: Any, what: str) -> str:
    name = DTYPE_NAMES.get(value, value)
    if name not in ("bf16", "fp16", "fp32"):
        raise UltraQuantError(f"configs: {what} {value!r} is not one of bf16, fp16, fp32 (or a torch dtype)")
    return name


def model_specializations(model: dict[str, Any], device: Any = None) -> list[Specialization]:
    """Every kernel variant the public ops plan for a model config on ``device`` (default: the current
    GPU): the same spec functions the calls use, so warmup loads exactly what they will launch.

    ``model``: ``head_size``, ``block_size``, ``gqa`` (or ``num_q_heads`` and ``num_kv_heads``),
    ``dtype`` (or ``query_dtype``/``key_dtype``/``out_dtype``), optional ``slot_dtype`` (default int64,
    vLLM's), ``has_sinks``/``has_window``/``has_softcap``, ``encoder``, ``cache_strides`` (the cache's
    first three strides when it is not the dense layout) and ``ops`` (default: all four). Stores get
    both layouts (a decode step's few rows, a prefill's many), the device's target and the strides'
    slot alignment; dequant the query dtype (the dense prefill route's); decode/prefill the device's
    target and ``ULTRAQUANT_DECODE_*`` tuning; the whole-page decode
    where the plan's rule takes it (``num_kv_heads`` and head-major ``cache_strides`` given); with
    ``spec_decode_attention`` in ``ops`` (not a default), the multi-query decode (both tile counts per
    program) where ``takes_multiquery`` takes it (the same two keys needed)."""
    unknown = sorted(set(model) - set(MODEL_KEYS))
    if unknown:
        raise UltraQuantError(f"configs: unknown model keys {unknown} (known: {', '.join(MODEL_KEYS)})")
    ops = tuple(model.get("ops", MODEL_OPS))
    for op in ops:
        if op not in catalog.OPS:
            raise UltraQuantError(f"configs: unknown op {op!r} (ops are {', '.join(catalog.OPS)})")
    dtype = model.get("dtype", "bf16")
    q = _dtype_name(model.get("query_dtype", dtype), "query_dtype")
    k = _dtype_name(model.get("key_dtype", q), "key_dtype")
    o = _dtype_name(model.get("out_dtype", q), "out_dtype")
    flags = tuple(bool(model.get(f, False)) for f in ("has_sinks", "has_window", "has_softcap"))
    strides = model.get("cache_strides")
    strides = None if strides is None else tuple(int(x) for x in strides)
    dev = _torch_device(device)
    out: list[Specialization] = []
    for op in ops:
        try:
            d = int(model["head_size"])
            if op == "store_kv":
                out += [store_family.store_spec(head_size=d, key_dtype=k, slot_dtype=model.get("slot_dtype", "i64"),
                                                encoder=model.get("encoder", "rne"), few_rows=few,
                                                align=None if strides is None else slot_alignment(d, strides),
                                                target=target_of(dev)) for few in (True, False)]
                continue
            bs = int(model["block_size"])
            if op == "dequant_kv":
                out.append(dequant_family.dequant_spec(head_size=d, block_size=bs, out_dtype=q))
                continue
            gqa = int(model["gqa"]) if "gqa" in model else int(model["num_q_heads"]) // int(model["num_kv_heads"])
            if op == "spec_decode_attention":  # where the plan's rule takes the multi-query decode (GPU, head-major)
                hk = int(model["num_kv_heads"]) if "num_kv_heads" in model else None
                if hk is not None and strides is not None and plans.takes_multiquery(
                        d, gqa, hk, bs, strides, dev, MULTIQUERY_MAX_TOKENS, config.get().tuning):
                    out += [decode_multiquery_spec(head_size=d, gqa=gqa, num_kv_heads=hk, block_size=bs,
                                                   query_dtype=q, out_dtype=o, has_sinks=flags[0],
                                                   has_window=flags[1], has_softcap=flags[2], tiles=t)
                            for t in MULTIQUERY_TILES]
                continue
            if op in ("decode_attention", "decode_attention_wholepage"):  # the plan's rule picks the family
                hk = int(model["num_kv_heads"]) if "num_kv_heads" in model else None
                out.append(plans.decode_call_spec(d, gqa, bs, q, o, *flags, strides, dev, config.get().tuning, hk))
            else:
                out.append(plans.prefill_call_spec(d, gqa, bs, q, k, o, *flags, strides, dev))
        except KeyError as exc:
            raise UltraQuantError(f"configs: {op} needs more of the model config (missing {exc})") from None
        except (TypeError, ValueError) as exc:
            raise UltraQuantError(f"configs: {op}: bad model config ({exc})") from None
    return out
