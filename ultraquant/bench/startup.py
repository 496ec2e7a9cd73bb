"""Runtime benchmark (GPU): time to the first decode result with blobs vs with a cold Triton JIT, and
host cost per decode call (ctypes AOT launcher vs Triton's launcher).

``python -m ultraquant.bench.startup [--json FILE]``. First-result runs are fresh subprocesses
(``--child MODE``): each reports, relative to the moment the parent spawned it, when torch and the
CUDA context were ready, when ``ultraquant`` was imported, and when the first store + decode result
was on the host. Modes: ``aot-cold`` (blobs, empty self-test verdict cache: the self-tests run),
``aot-warm`` (blobs, verdicts cached), ``jit-cold`` (Triton JIT, empty Triton cache), ``jit-warm``
(Triton JIT, cache filled by the cold run). Host cost: a tiny decode (B=1, L=64) called back to back,
host time per call without synchronizing, through the full op and through the bare launch layer.
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

from ultraquant import config as uq_config

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
    """One first-result run; prints a JSON line of times. ``*_at``: seconds since the parent spawned
    this process; ``kernels_ready_s``: making the store + decode kernels launchable (AOT: manifest,
    sha256, module load, self-tests unless cached; JIT: compile or cache load), timed alone;
    ``first_ops_s``: the first store + decode op calls to the result on the host;
    ``second_ops_s``: the same calls again (steady state)."""
    t_spawn = float(os.environ["UQ_BENCH_SPAWN"])
    marks: dict[str, Any] = {"mode": mode}
    import torch

    dev = os.environ.get("UQ_BENCH_DEVICE", "cuda")  # "cpu": a dry run of the script's logic
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.zeros(1, device=dev)
    sync()
    marks["torch_cuda_ready_at"] = time.time() - t_spawn
    import ultraquant as uq
    from ultraquant.kernels import plans

    marks["ultraquant_imported_at"] = time.time() - t_spawn
    p = _problem([256, 256], dev)
    out = torch.empty_like(p["q"])
    sync()
    store = plans.plan_store(p["k"], p["v"], p["cache"], p["slots"])
    decode = plans.plan_decode(p["q"], p["cache"], p["table"], p["lens"], D ** -0.5, None, None, None, out)
    t0 = time.time()
    if dev == "cuda" and mode.startswith("aot"):
        from ultraquant.runtime import warmup

        report = warmup([store.spec, decode.spec])
        assert set(report.values()) == {"aot"}, report
    elif dev == "cuda":
        from ultraquant.kernels import registry

        registry.jit_launch(store)
        registry.jit_launch(decode)
    sync()
    marks["kernels_ready_s"] = time.time() - t0
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


def host_cost(calls: int = 2000) -> dict[str, float]:
    """Host microseconds per decode call: full op and bare launch, AOT vs Triton JIT."""
    import torch

    import ultraquant as uq
    from ultraquant.kernels import plans, registry
    from ultraquant.runtime import launch
    from ultraquant.runtime.loader import Kernel

    p = _problem([64])
    out = torch.empty_like(p["q"])
    res: dict[str, float] = {}
    for mode in ("aot", "triton"):
        os.environ["ULTRAQUANT_BACKEND"] = mode
        uq_config.reload()
        for _ in range(50):
            uq.decode_attention(p["q"], p["cache"], p["table"], p["lens"], D ** -0.5, out=out)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            uq.decode_attention(p["q"], p["cache"], p["table"], p["lens"], D ** -0.5, out=out)
        res[f"op_{mode}_us"] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    plan = plans.plan_decode(p["q"], p["cache"], p["table"], p["lens"], D ** -0.5, None, None, None, out)
    os.environ["ULTRAQUANT_BACKEND"] = "aot"
    uq_config.reload()
    kernel = launch.resolve(plan.spec, torch.cuda.current_device())
    assert isinstance(kernel, Kernel), kernel
    for name, fn in (("launch_aot_us", lambda: kernel.launch(plan.args, plan.grid)),
                     ("try_launch_aot_us", lambda: launch.try_launch(plan)),
                     ("launch_triton_us", lambda: registry.jit_launch(plan))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        res[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    os.environ.pop("ULTRAQUANT_BACKEND", None)
    uq_config.reload()
    return res


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
    host = host_cost() if os.environ.get("UQ_BENCH_DEVICE", "cuda") == "cuda" else {}
    print(f"{'mode':<9} {'torch+CUDA at':>13} {'import at':>10} {'kernels ready s':>16} {'1st ops s':>10} "
          f"{'2nd ops s':>10} {'1st result at':>14}")
    for m, r in runs.items():
        print(f"{m:<9} {r['torch_cuda_ready_at']:13.3f} {r['ultraquant_imported_at']:10.3f} "
              f"{r['kernels_ready_s']:16.4f} {r['first_ops_s']:10.4f} {r['second_ops_s']:10.4f} "
              f"{r['first_result_at']:14.3f}")
    jc, aw, ac = runs["jit-cold"], runs["aot-warm"], runs["aot-cold"]
    ready = jc["kernels_ready_s"]
    print(f"kernels ready: cold JIT / AOT (verdicts cached) = {ready / max(aw['kernels_ready_s'], 1e-9):.0f}x, "
          f"cold JIT / AOT (self-tests run) = {ready / max(ac['kernels_ready_s'], 1e-9):.1f}x; "
          f"process start -> first result: cold JIT / AOT = {jc['first_result_at'] / aw['first_result_at']:.2f}x")
    for k, v in host.items():
        print(f"host {k:<20} {v:7.1f} us/call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_result": runs, "host_us": host}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
