"""One H200 run for issue 14 gate 0: v7 decode through its AOT blob vs through the Triton JIT.

Per shape A-D (head-major cache), one process, CUDA-graph timing as ``ultraquant bench``:
``jit`` (BACKEND=triton), ``aot`` (the blobs of $NEW: dense-row strides in the key, compiled with
tt.divisibility=16 like the JIT), ``aot-old`` (the blobs of $OLD: main's build, no integer
divisibility), ``jit-cubin-rt`` (the JIT's own cubin launched through the ctypes runtime: separates
binary from launch path) and ``aot+prefer-shared`` (the new blob after cuFuncSetCacheConfig(PREFER_SHARED),
what Triton's loader does for > 48 KB of shared memory; the 2026-12-01 run passed PREFER_L1 here by
mistake, see its log). Also registers per binary, output agreement.

    cd .dev14b && PYTHONPATH=. python tools/h200_aot_jit.py NEW_DIR OLD_DIR OUT_DIR
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import torch

from ultraquant.bench.decode import SHAPES, backend_env, bench_decode, make_decode_problem, measure_ceiling, time_graph

CU_FUNC_CACHE_PREFER_NONE, CU_FUNC_CACHE_PREFER_SHARED = 0, 1


def _kernel_of_state():
    from ultraquant.runtime import launch

    got = [st for st in launch.state().values() if hasattr(st, "function")]
    return got[0] if got else None


def _jit_kernels():
    """Every JIT-compiled uq_decode in Triton's in-process cache."""
    from ultraquant.kernels.registry import KERNELS

    for cache in getattr(KERNELS["uq_decode"], "device_caches", {}).values():
        yield from cache[0].values()


def main(new: str, old: str, out: str) -> None:
    ceiling = measure_ceiling()
    print(f"ceiling {ceiling:.2f} TB/s", flush=True)
    result = {"ceiling_tbps": ceiling, "device": torch.cuda.get_device_name(0), "shapes": {}}
    for name, s in SHAPES.items():
        backend_env("triton")
        p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"])
        row: dict = {}
        row["jit"] = bench_decode(p, s["D"])
        ref = p.out.clone()
        for tag, root in (("aot", new), ("aot-old", old)):
            os.environ["ULTRAQUANT_GENERATED"] = root
            backend_env("aot")
            try:
                row[tag] = bench_decode(p, s["D"])
                row[f"{tag}-maxdiff"] = float((p.out.float() - ref.float()).abs().max())
                k = _kernel_of_state()
                row[f"{tag}-attrs"] = k.driver.function_attributes(k.device, k.function)
                row[f"{tag}-key"] = k.entry.key
                if tag == "aot":
                    packer, blob = k.packer, k
            except Exception as exc:  # a finding, not a crash
                row[tag] = f"{type(exc).__name__}: {exc}"[:300]
        # The JIT's own cubin through the ctypes runtime (same packer as the new blob).
        try:
            from ultraquant.kernels import plans

            ck = [c for c in _jit_kernels() if c.metadata.num_warps == blob.entry.num_warps
                  and c.metadata.shared == blob.entry.shared][-1]
            drv, dev = blob.driver, blob.device
            mod = drv.load_module(dev, ck.asm["cubin"])
            fun = drv.get_function(dev, mod, ck.metadata.name)
            drv.prepare_function(dev, fun, int(ck.metadata.shared))
            row["jit-cubin-attrs"] = drv.function_attributes(dev, fun)
            with open(os.path.join(out, f"jit_{name}.cubin"), "wb") as f:
                f.write(ck.asm["cubin"])
            plan = plans.plan_decode(p.query, p.kv_cache, p.block_table, p.seq_lens, s["D"] ** -0.5, None, None,
                                     None, p.out)

            def run(fun=fun, plan=plan, drv=drv, dev=dev, threads=blob.threads, shared=int(ck.metadata.shared),
                    pack=packer.pack) -> None:
                drv.launch(dev, fun, plan.grid, threads, shared, torch.cuda.current_stream().cuda_stream,
                           pack(plan.args))

            row["jit-cubin-rt"] = time_graph(run)
            # Triton's loader sets PREFER_SHARED for > 48 KB kernels; try it on the new blob.
            drv.lib.cuFuncSetCacheConfig(ctypes.c_void_p(blob.function), ctypes.c_int(CU_FUNC_CACHE_PREFER_SHARED))
            os.environ["ULTRAQUANT_GENERATED"] = new
            backend_env("aot")
            row["aot+prefer-shared"] = bench_decode(p, s["D"])
            drv.lib.cuFuncSetCacheConfig(ctypes.c_void_p(blob.function), ctypes.c_int(CU_FUNC_CACHE_PREFER_NONE))
        except Exception as exc:
            row["jit-cubin-rt"] = f"{type(exc).__name__}: {exc}"[:300]
        result["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
        del p
        torch.cuda.empty_cache()
    print(f"\nceiling {ceiling:.2f} TB/s")
    print(f"{'shape':6s} {'jit us':>8s} {'aot us':>8s} {'aot/jit':>8s} {'old us':>8s} {'old/jit':>8s} "
          f"{'jitbin-rt':>9s} {'aot+pref':>8s} {'%ceil aot':>9s}")
    for name, r in result["shapes"].items():
        s = SHAPES[name]
        nbytes = s["B"] * s["L"] * s["Hk"] * (s["D"] + s["D"] // 16)

        def f(v):
            return f"{v:8.1f}" if isinstance(v, float) else f"{'err':>8s}"

        def q(a, b):
            return f"{a / b:8.3f}" if isinstance(a, float) and isinstance(b, float) else f"{'-':>8s}"

        pct = 100 * nbytes / (r["aot"] * 1e-6) / 1e12 / ceiling if isinstance(r.get("aot"), float) else 0.0
        print(f"{name:6s} {f(r['jit'])} {f(r.get('aot'))} {q(r.get('aot'), r['jit'])} {f(r.get('aot-old'))} "
              f"{q(r.get('aot-old'), r['jit'])} {f(r.get('jit-cubin-rt'))} {f(r.get('aot+prefer-shared'))} "
              f"{pct:9.1f}")
    with open(os.path.join(out, "aot_vs_jit.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
