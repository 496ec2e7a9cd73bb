"""Time decode launch variants on a CUDA GPU (tuning, not a test): one row per (shape, warps, tile, splits).

The variants go through the plans' tuning variables (``ULTRAQUANT_DECODE_WARPS/TILE/SPLITS``), so what
is timed is exactly what a deployment would launch with those settings. Usage on the device:

    python3 tools/h200_sweep.py --json sweep.json A:4x32:8,16 C:8x32:33,66 D:4x64:1,2
"""

from __future__ import annotations

import json
import os
import sys

import torch

from ultraquant.commands.bench import SHAPES, bench_decode, make_decode_problem, measure_ceiling


def parse(arg: str) -> tuple[str, list[tuple[int, int]], list[int]]:
    """``A:4x32,8x64:8,16`` -> ("A", [(4, 32), (8, 64)], [8, 16])."""
    name, configs, splits = arg.split(":")
    pairs = [tuple(int(x) for x in c.split("x")) for c in configs.split(",")]
    return name, pairs, [int(s) for s in splits.split(",")]


def main(argv: list[str]) -> None:
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    ceiling = measure_ceiling()
    print(f"ceiling {ceiling:.2f} TB/s", flush=True)
    rows = []
    for arg in argv:
        name, pairs, splits = parse(arg)
        s = SHAPES[name]
        p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"])
        for warps, tile in pairs:
            for sp in splits:
                os.environ.update(ULTRAQUANT_DECODE_WARPS=str(warps), ULTRAQUANT_DECODE_TILE=str(tile),
                                  ULTRAQUANT_DECODE_SPLITS=str(sp))
                try:
                    us = bench_decode(p, s["D"])
                except Exception as exc:  # a variant that fails to compile is a finding
                    print(f"{name} w{warps} t{tile} s{sp}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                pct = 100 * p.stored_bytes / (us * 1e-6) / 1e12 / ceiling
                rows.append({"shape": name, "warps": warps, "tile": tile, "splits": sp, "us": us, "pct": pct})
                print(f"{name} warps={warps} tile={tile} splits={sp}: {us:.1f} us ({pct:.1f}% of ceiling)",
                      flush=True)
        del p
        torch.cuda.empty_cache()
    for var in ("ULTRAQUANT_DECODE_WARPS", "ULTRAQUANT_DECODE_TILE", "ULTRAQUANT_DECODE_SPLITS"):
        os.environ.pop(var, None)
    if out:
        with open(out, "w") as f:
            json.dump({"ceiling_tbps": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
