"""Host cost per eager call (``ultraquant bench --host``): microseconds of host time per public-op call
back to back with no synchronization, on the AOT path and on the Triton JIT path, validation on.

Tiny problems, so the GPU never limits the rate: decode B=1, L=64 (Hq 32, Hk 8, D 128, block 16,
bf16) with ``out=`` given, and a decode step's store (1 token). Each row is the median of
``repeats`` timings of ``calls`` calls; also the bare launch layers (the blob's ``Kernel.launch``,
``try_launch`` of a ready plan, Triton's launcher) for reference. The target is
<= 15 us per decode/store call on the AOT path.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

HQ, HK, D, BS = 32, 8, 128, 16


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median over ``repeats`` of the host time per call of ``calls`` back-to-back ``fn()`` calls."""
    for _ in range(max(10, calls // 20)):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(times)


def tiny_problem(device: str) -> dict[str, Any]:
    """Tensors of the tiny decode (B=1, L=64) and of a one-token store on ``device``."""
    import torch

    import ultraquant as uq

    g = torch.Generator().manual_seed(0)
    blocks = 64 // BS
    t = {
        "q": torch.randn(1, HQ, D, generator=g).to(torch.bfloat16),
        "k": torch.randn(1, HK, D, generator=g).to(torch.bfloat16),
        "cache": torch.zeros(blocks + 1, BS, HK, uq.slot_size(D), dtype=torch.uint8),
        "table": torch.arange(blocks, dtype=torch.int32)[None],
        "lens": torch.tensor([64], dtype=torch.int32),
        "slots": torch.tensor([63], dtype=torch.int64),
    }
    t = {k: v.to(device) for k, v in t.items()}
    t["out"] = torch.empty_like(t["q"])
    return t


def op_calls(p: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The public-op calls timed: decode and store."""
    import ultraquant as uq

    scale = D ** -0.5
    return {
        "decode": lambda: uq.decode_attention(p["q"], p["cache"], p["table"], p["lens"], scale, out=p["out"]),
        "store": lambda: uq.store_kv(p["k"], p["k"], p["cache"], p["slots"]),
    }


def run_host_bench(calls: int = 2000, repeats: int = 5, backends: tuple[str, ...] = ("aot", "triton"),
                   device: str = "cuda", sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Host us per call of each op under each backend (``ULTRAQUANT_BACKEND``), plus the bare launch
    layers of the decode on the AOT path when ``aot`` is among ``backends`` and a GPU is used."""
    import torch

    from ultraquant import config
    from ultraquant.errors import UltraQuantError
    from ultraquant.kernels import plans

    if sync is None:
        sync = torch.cuda.synchronize
    p = tiny_problem(device)
    res: dict[str, float] = {}
    for mode in backends:
        with config.overridden(backend=mode):
            for name, fn in op_calls(p).items():
                try:
                    res[f"op_{name}_{mode}_us"] = per_call_us(fn, calls, repeats, sync)
                except UltraQuantError as exc:  # e.g. no blob for this config: say so, time the rest
                    print(f"host {name} {mode}: not timed: {exc}")
                    res[f"op_{name}_{mode}_us"] = float("nan")
    if device == "cuda" and not math.isnan(res.get("op_decode_aot_us", math.nan)):  # a decode blob exists
        from ultraquant.kernels import registry
        from ultraquant.runtime import launch
        from ultraquant.runtime.loader import Kernel

        with config.overridden(backend="aot"):
            plan = plans.plan_decode(p["q"], p["cache"], p["table"], p["lens"], D ** -0.5, None, None, None,
                                     p["out"])
            kernel = launch.resolve(plan.spec, torch.cuda.current_device())
            assert isinstance(kernel, Kernel), kernel
            for name, fn in (("launch_decode_aot_us", lambda: kernel.launch(plan.args, plan.grid)),
                             ("try_launch_decode_aot_us", lambda: launch.try_launch(plan)),
                             ("launch_decode_triton_us", lambda: registry.jit_launch(plan))):
                res[name] = per_call_us(fn, calls, repeats, sync)
    return res


def format_rows(res: dict[str, float]) -> str:
    """One line per measurement."""
    return "\n".join(f"host {k:<28} {v:7.2f} us/call" for k, v in res.items())
