"""Measured side of the ISA cost model's calibration: time the sm_90 decode blobs on the GPU.

For every config of :data:`CONFIGS` (uniform shapes A-D of ``ultraquant bench`` and others, plus
ragged batches whose requests differ in length) it fills a head-major cache through
``ultraquant.store_kv``, times ``ultraquant.decode_attention`` through the AOT blobs only
(``ULTRAQUANT_BACKEND=aot``, the blobs of ``$ULTRAQUANT_GENERATED``) as a CUDA-graph replay
(``ultraquant.bench.decode.time_graph``), and records the plan it ran (kernel key, grid, splits) and
the SM clock, so ``tools/isa_cost.py calibrate`` can compare the model with the same launches.

    ULTRAQUANT_GENERATED=<blobs> python tools/isa_cost_device.py --out $OUT/calibration.json
    python tools/isa_cost_device.py --list          # the configs and lengths, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

CONFIGS: list[dict] = [
    # name, head size, query heads, kv heads, block size, lengths (uniform: B x L)
    {"name": "A", "D": 128, "Hq": 32, "Hk": 8, "block": 64, "lens": ("uniform", 8, 32768)},
    {"name": "B", "D": 128, "Hq": 32, "Hk": 8, "block": 64, "lens": ("uniform", 32, 8192)},
    {"name": "C", "D": 256, "Hq": 16, "Hk": 2, "block": 64, "lens": ("uniform", 8, 32768)},
    {"name": "D", "D": 128, "Hq": 32, "Hk": 8, "block": 64, "lens": ("uniform", 64, 2048)},
    {"name": "E_blk16", "D": 128, "Hq": 32, "Hk": 8, "block": 16, "lens": ("uniform", 16, 16384)},
    {"name": "F_gqa16", "D": 128, "Hq": 32, "Hk": 2, "block": 64, "lens": ("uniform", 16, 16384)},
    {"name": "G_hk1", "D": 128, "Hq": 8, "Hk": 1, "block": 16, "lens": ("uniform", 32, 8192)},
    {"name": "R1_ragged", "D": 128, "Hq": 32, "Hk": 8, "block": 64, "lens": ("random", 16, 512, 32768, 1)},
    {"name": "R2_one_long", "D": 256, "Hq": 16, "Hk": 2, "block": 64, "lens": ("one_long", 16, 65536, 2048)},
    {"name": "R3_ragged_blk16", "D": 128, "Hq": 32, "Hk": 8, "block": 16, "lens": ("random", 64, 128, 8192, 2)},
]
"""The calibration configs (bf16, no sinks/window/softcap). Their blobs: ``tools/isa_cost.py build``."""


def lengths(spec: tuple) -> list[int]:
    """The request lengths of one config (seeded: the same on every machine)."""
    kind = spec[0]
    if kind == "uniform":
        return [spec[2]] * spec[1]
    if kind == "random":
        rng = random.Random(spec[4])
        return [rng.randint(spec[2], spec[3]) for _ in range(spec[1])]
    if kind == "one_long":
        return [spec[2]] + [spec[3]] * (spec[1] - 1)
    raise ValueError(kind)


def make_problem(cfg: dict, lens: list[int], seed: int = 0):
    """Head-major cache holding exactly the requests' blocks (shuffled), filled through store_kv."""
    import torch

    import ultraquant as uq

    d, hk, hq, blk = cfg["D"], cfg["Hk"], cfg["Hq"], cfg["block"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per = [-(-n // blk) for n in lens]
    nblk = sum(per)
    width = max(per)
    slot = uq.slot_size(d)
    raw = torch.empty((nblk, hk, blk, slot), dtype=torch.uint8, device="cuda")
    cache = raw.permute(0, 2, 1, 3)
    perm = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32)
    bt = torch.zeros((len(lens), width), dtype=torch.int32, device="cuda")
    at = 0
    for r, p in enumerate(per):
        bt[r, :p] = perm[at:at + p]
        at += p
    for r, n in enumerate(lens):
        for s in range(0, n, 16384):
            m = min(16384, n - s)
            pos = torch.arange(s, s + m, device="cuda")
            slots = bt[r, pos // blk].long() * blk + pos % blk
            k = torch.randn(m, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(m, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            uq.store_kv(k, v, cache, slots)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, cache, bt, seq, sum(lens) * hk * slot


def smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    if args.list:
        for c in CONFIGS:
            n = lengths(c["lens"])
            print(c["name"], c["D"], c["Hq"], c["Hk"], c["block"], len(n), sum(n), min(n), max(n))
        return
    import torch

    import ultraquant as uq
    from ultraquant import config as uq_config
    from ultraquant.bench.decode import measure_ceiling, time_graph
    from ultraquant.kernels.plans import plan_decode

    rows = []
    out = {"device": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "clocks_before": smi("clocks.sm,clocks.max.sm,clocks.mem"), "rows": rows}
    t0 = time.time()
    sampler = None
    if args.out:  # the SM clock while the decodes run (nvidia-smi every 100 ms), ended after the loop
        try:
            sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                                        "-lms", "100"], stdout=subprocess.PIPE, text=True)
        except OSError:
            sampler = None
    for c in CONFIGS:
        if only and c["name"] not in only:
            continue
        lens = lengths(c["lens"])
        with uq_config.overridden(backend="triton"):  # the fill: the store through the JIT
            q, cache, bt, seq, nbytes = make_problem(c, lens)
        torch.cuda.synchronize()
        o = torch.empty_like(q)
        prob = (q, cache, bt, seq, o)
        scale = c["D"] ** -0.5
        plan = plan_decode(q, cache, bt, seq, scale, None, None, None, o)
        try:
            with uq_config.overridden(backend="aot"):  # the decode: blobs only (an error when none serves it)
                us = time_graph(lambda p=prob, s=scale: uq.decode_attention(p[0], p[1], p[2], p[3], s, out=p[4]))
            err = ""
        except Exception as exc:  # a missing blob: record and go on
            us, err = float("nan"), f"{type(exc).__name__}: {exc}"
        row = {"name": c["name"], "D": c["D"], "Hq": c["Hq"], "Hk": c["Hk"], "block": c["block"], "lens": lens,
               "us": us, "bytes": nbytes, "tbs": nbytes / (us * 1e-6) / 1e12 if us == us else None,
               "kernel": plan.spec.kernel, "key": plan.spec.key(), "grid": list(plan.grid),
               "splits": plan.notes.get("num_splits"), "error": err}
        rows.append(row)
        print(f"{c['name']}: {us:.1f} us, {row['tbs'] or 0:.2f} TB/s, {plan.spec.kernel} grid {plan.grid} {err}",
              flush=True)
        plan = None
        torch.cuda.empty_cache()
    if sampler is not None:
        sampler.terminate()
        text = sampler.communicate(timeout=10)[0]
        mhz = [int(x) for x in text.split() if x.isdigit()]
        out["sm_clock_mhz_samples"] = {"n": len(mhz), "min": min(mhz, default=0), "max": max(mhz, default=0),
                                       "median": sorted(mhz)[len(mhz) // 2] if mhz else 0}
    out["ceiling_tbs"] = measure_ceiling()
    out["clocks_after"] = smi("clocks.sm,clocks.max.sm,clocks.mem")
    out["wall_s"] = time.time() - t0
    print(f"ceiling {out['ceiling_tbs']:.2f} TB/s, clocks {out['clocks_before']} / {out['clocks_after']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
