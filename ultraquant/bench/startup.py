"""Start-up benchmark (GPU): process start -> first decode result, with blobs and with Triton's JIT,
all modes from one run of this script.

``python -m ultraquant.bench.startup [--json FILE]``. Each mode is a fresh subprocess (``--child
MODE``) that does what a user's first step does: import torch and create the CUDA context, import
``ultraquant``, then call ``store_kv`` + ``decode_attention`` (B=2, L=256, Hq 32, Hk 8, D 128, block
16, bf16) and copy the result to the host. It reports, in seconds since the parent spawned it, when
torch+CUDA were ready, when ultraquant was imported and when the first result was on the host, plus
the same two calls again (steady state). Modes, in this order: ``aot-cold`` (blobs, empty self-test
verdict cache: the self-tests run), ``aot-warm`` (blobs, the verdicts aot-cold recorded),
``jit-cold`` (Triton JIT, empty Triton cache), ``jit-warm`` (the cache jit-cold filled). The host
cost per call is ``ultraquant bench --host`` (:mod:`ultraquant.bench.host`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HQ, HK, D, BS = 32, 8, 128, 16


def _problem(lens: list[int], dev: str = "cuda"):
    import torch

    import ultraquant as uq

    g = torch.Generator().manual_seed(0)
    need = [-(-n // BS) for n in lens]
    nblocks = sum(need)
    table = torch.arange(nblocks, dtype=torch.int32).reshape(len(lens), -1) if len(set(need)) == 1 else None
    assert table is not None, "equal lengths only"
    slots = torch.cat([table[i].long().repeat_interleave(BS)[:n] * BS + torch.arange(n) % BS
                       for i, n in enumerate(lens)])
    k = torch.randn(sum(lens), HK, D, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens), HK, D, generator=g).to(torch.bfloat16)
    q = torch.randn(len(lens), HQ, D, generator=g).to(torch.bfloat16)
    cache = torch.zeros(nblocks, BS, HK, uq.slot_size(D), dtype=torch.uint8)
    t = [x.to(dev) for x in (k, v, q, cache, table, slots, torch.tensor(lens, dtype=torch.int32))]
    return dict(zip(("k", "v", "q", "cache", "table", "slots", "lens"), t, strict=True))


def child(mode: str) -> None:
    """One first-result run; prints a JSON line of times (``*_at``: seconds since the parent spawned
    this process; ``first_ops_s``: the first store + decode calls to the result on the host, kernel
    loading, self-tests or compiles included; ``second_ops_s``: the same calls again)."""
    t_spawn = float(os.environ["UQ_BENCH_SPAWN"])
    marks: dict[str, Any] = {"mode": mode}
    import torch

    dev = os.environ.get("UQ_BENCH_DEVICE", "cuda")  # "cpu": a dry run of the script's logic
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.zeros(1, device=dev)
    sync()
    marks["torch_cuda_ready_at"] = time.time() - t_spawn
    import ultraquant as uq

    marks["ultraquant_imported_at"] = time.time() - t_spawn
    p = _problem([256, 256], dev)
    sync()
    marks["inputs_ready_at"] = time.time() - t_spawn
    for name in ("first_ops_s", "second_ops_s"):
        t1 = time.time()
        uq.store_kv(p["k"], p["v"], p["cache"], p["slots"])
        res = uq.decode_attention(p["q"], p["cache"], p["table"], p["lens"], D ** -0.5).float().cpu()
        marks[name] = time.time() - t1
        if name == "first_ops_s":
            marks["first_result_at"] = time.time() - t_spawn
    marks["finite"] = bool(torch.isfinite(res).all())
    print("UQ_BENCH " + json.dumps(marks))


def first_result(mode: str, env: dict[str, str]) -> dict[str, Any]:
    """Spawn one child run of ``mode`` and parse its report."""
    env = {**os.environ, **env, "UQ_BENCH_SPAWN": repr(time.time())}
    if env.get("UQ_BENCH_DEVICE", "cuda") != "cuda":
        env["ULTRAQUANT_BACKEND"] = "reference"
    # Run this file as a script (not ``-m ultraquant...``, which would import the package before the
    # child's clock starts).
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode], env=env,
                       capture_output=True, text=True, timeout=600)
    for line in r.stdout.splitlines():
        if line.startswith("UQ_BENCH "):
            return json.loads(line[len("UQ_BENCH "):])
    raise RuntimeError(f"{mode} run failed ({r.returncode}): {r.stdout[-1500:]} {r.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    tmp = tempfile.mkdtemp(prefix="uq_bench_")
    verdicts, tcache = os.path.join(tmp, "verdicts"), os.path.join(tmp, "triton")
    runs = {}
    runs["aot-cold"] = first_result("aot-cold", {"ULTRAQUANT_BACKEND": "aot", "ULTRAQUANT_CACHE_DIR": verdicts})
    runs["aot-warm"] = first_result("aot-warm", {"ULTRAQUANT_BACKEND": "aot", "ULTRAQUANT_CACHE_DIR": verdicts})
    runs["jit-cold"] = first_result("jit-cold", {"ULTRAQUANT_BACKEND": "triton", "TRITON_CACHE_DIR": tcache})
    runs["jit-warm"] = first_result("jit-warm", {"ULTRAQUANT_BACKEND": "triton", "TRITON_CACHE_DIR": tcache})
    print(f"{'mode':<9} {'torch+CUDA at':>13} {'import at':>10} {'1st ops s':>10} {'2nd ops s':>10} "
          f"{'start -> 1st result s':>22}")
    for m, r in runs.items():
        print(f"{m:<9} {r['torch_cuda_ready_at']:13.3f} {r['ultraquant_imported_at']:10.3f} "
              f"{r['first_ops_s']:10.4f} {r['second_ops_s']:10.4f} {r['first_result_at']:22.3f}")
    jc, ac, aw = (runs[m]["first_result_at"] for m in ("jit-cold", "aot-cold", "aot-warm"))
    print(f"process start -> first decode result: cold JIT {jc:.2f} s, cold AOT {ac:.2f} s ({jc / ac:.2f}x sooner), "
          f"warm AOT {aw:.2f} s ({jc / aw:.2f}x sooner)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_result": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
