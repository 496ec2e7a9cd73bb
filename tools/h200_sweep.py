"""Time decode launch variants on a CUDA GPU (tuning, not a test): one row per (shape, warps, tile, splits).

The variants go through the plans' tuning variables (``ULTRAQUANT_DECODE_WARPS/TILE/SPLITS``), so what
is timed is exactly what a deployment would launch with those settings. Usage on the device:

    python3 tools/h200_sweep.py --json sweep.json A:4x32:8,16 C:8x32:33,66 D:4x64s3r112:1,2

A variant is ``<warps>x<tile>`` with optional ``s<num_stages>`` and ``r<max registers>`` (``maxnreg``).
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch

from ultraquant import config as uq_config
from ultraquant.bench.decode import SHAPES, bench_decode, make_decode_problem, measure_ceiling


def parse(arg: str) -> tuple[str, list[dict[str, str]], list[int]]:
    """``A:4x32,8x64s3r112:8,16`` -> ("A", [{warps, tile}, {warps, tile, stages, maxnreg}], [8, 16])."""
    name, configs, splits = arg.split(":")
    variants = []
    for c in configs.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)(?:s(\d+))?(?:r(\d+))?", c)
        if not m:
            raise SystemExit(f"bad variant {c!r}")
        keys = ("WARPS", "TILE", "STAGES", "MAXNREG")
        variants.append({f"ULTRAQUANT_DECODE_{k}": v for k, v in zip(keys, m.groups(), strict=True) if v})
    return name, variants, [int(s) for s in splits.split(",")]


def _clear() -> None:
    for k in ("WARPS", "TILE", "STAGES", "MAXNREG", "SPLITS"):
        os.environ.pop(f"ULTRAQUANT_DECODE_{k}", None)
    uq_config.reload()


def main(argv: list[str]) -> None:
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    ceiling = measure_ceiling()
    print(f"ceiling {ceiling:.2f} TB/s", flush=True)
    rows = []
    for arg in argv:
        name, variants, splits = parse(arg)
        s = SHAPES[name]
        p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"])
        for variant in variants:
            for sp in splits:
                _clear()
                os.environ.update(variant, ULTRAQUANT_DECODE_SPLITS=str(sp))
                uq_config.reload()
                label = " ".join(f"{k.split('_')[-1].lower()}={v}" for k, v in variant.items())
                try:
                    us = bench_decode(p, s["D"])
                except Exception as exc:  # a variant that fails to compile is a finding
                    print(f"{name} {label} splits={sp}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                pct = 100 * p.stored_bytes / (us * 1e-6) / 1e12 / ceiling
                rows.append({"shape": name, **variant, "splits": sp, "us": us, "pct": pct})
                print(f"{name} {label} splits={sp}: {us:.1f} us ({pct:.1f}% of ceiling)", flush=True)
        del p
        torch.cuda.empty_cache()
    _clear()
    if out:
        with open(out, "w") as f:
            json.dump({"ceiling_tbps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
