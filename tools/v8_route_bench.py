"""Time the routed decode (``ultraquant.decode_attention``) on shapes A, B, D: v8 through its AOT blob
and through Gluon's JIT, v7 (``ULTRAQUANT_DECODE_V8=0``) through its blob and Triton's JIT, bf16 SDPA
and the read ceiling, in one run, timed like ``ultraquant bench`` (CUDA-graph replay, head-major caches).

    python tools/v8_route_bench.py --json out.json [--shapes A,B,D]

Each AOT row is refused (``ULTRAQUANT_BACKEND=aot``) unless a blob serves the call; each row records
the kernel the plan picked, so a v8 row that ran v7 cannot pass unnoticed. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ultraquant import config  # noqa: E402
from ultraquant.bench.decode import (  # noqa: E402
    SHAPES,
    backend_env,
    bench_decode,
    bench_sdpa,
    make_decode_problem,
    measure_ceiling,
)
from ultraquant.kernels import plans  # noqa: E402

VARIANTS = (("v8 aot", "aot", "1"), ("v8 jit", "triton", "1"), ("v7 aot", "aot", "0"), ("v7 jit", "triton", "0"))
"""(row name, ULTRAQUANT_BACKEND, ULTRAQUANT_DECODE_V8)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", default="A,B,D")
    a = ap.parse_args()
    ceiling = measure_ceiling()
    rows: list[dict] = []
    result = {"ceiling_tbps": ceiling, "device": torch.cuda.get_device_name(0), "rows": rows}
    print(f"ceiling {ceiling:.3f} TB/s", flush=True)

    def add(shape: str, name: str, us: float, nbytes: int, sdpa: float | None, kernel: str = "") -> None:
        tbps = nbytes / (us * 1e-6) / 1e12
        rows.append(dict(shape=shape, name=name, kernel=kernel, us=us, tbps=tbps, pct_ceiling=100 * tbps / ceiling,
                         vs_sdpa=None if sdpa is None else sdpa / us))
        print(f"{shape} {name:10s} {kernel:14s} {us:8.1f} us {100 * tbps / ceiling:5.1f}% "
              f"{'' if sdpa is None else f'{sdpa / us:.2f}x'}", flush=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)

    for shape in a.shapes.split(","):
        s = SHAPES[shape]
        p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"], head_major=True)
        sdpa = bench_sdpa(s["B"], s["L"], s["Hq"], s["Hk"], s["D"])
        add(shape, "sdpa-bf16", sdpa, 2 * s["B"] * s["L"] * s["Hk"] * s["D"] * 2, None)
        for name, backend, v8 in VARIANTS:
            os.environ["ULTRAQUANT_DECODE_V8"] = v8
            try:
                backend_env(backend)  # reloads the config (ULTRAQUANT_DECODE_V8 too) and resets the blobs
                kernel = plans.plan_decode(p.query, p.kv_cache, p.block_table, p.seq_lens, s["D"] ** -0.5, None,
                                           None, None, p.out, config.get().tuning).spec.kernel
                add(shape, name, bench_decode(p, s["D"]), p.stored_bytes, sdpa, kernel)
            except Exception:
                traceback.print_exc()
        os.environ.pop("ULTRAQUANT_DECODE_V8")
        p = None
        torch.cuda.empty_cache()
    print("\nsummary (us; speed-up of the routed AOT decode over v7 AOT and over bf16 SDPA)")
    by = {(r["shape"], r["name"]): r["us"] for r in rows}
    for shape in a.shapes.split(","):
        got = {n: by.get((shape, n)) for n in ("sdpa-bf16", *(v[0] for v in VARIANTS))}
        line = " ".join(f"{n}={'-' if u is None else f'{u:.1f}'}" for n, u in got.items())
        if got["v8 aot"] and got["v7 aot"] and got["sdpa-bf16"]:
            line += f"  v8/v7 {got['v7 aot'] / got['v8 aot']:.2f}x  v8/sdpa {got['sdpa-bf16'] / got['v8 aot']:.2f}x"
        print(f"{shape}: {line}")

if __name__ == "__main__":
    main()
