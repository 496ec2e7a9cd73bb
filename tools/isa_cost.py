"""ISA cost model CLI (the library is ``codegen/cost_model.py``): build, predict, calibrate, estimate AMD.

    python tools/isa_cost.py build --out .isa/gen                      # the sm_90 calibration blobs
    python tools/isa_cost.py predict --generated .isa/gen --out P.json # model times of the configs
    python tools/isa_cost.py calibrate --generated .isa/gen --measured M.json --out C.json
    python tools/isa_cost.py census BLOB [--arch sm_90|gfx942|gfx950]   # hot-loop census of one blob
    python tools/isa_cost.py flydsl --out F.json                       # FlyDSL decode on MI300X/MI355X

``predict`` and ``calibrate`` read the blobs' manifest (constexprs, registers, shared memory) and
their SASS (the ``cuobjdump`` Triton ships); ``M.json`` is ``tools/isa_cost_device.py``'s output,
whose recorded splits and grids the comparison uses. ``flydsl`` needs the FlyDSL tools
(``make flydsl-env``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codegen import cost_model as cm  # noqa: E402
from tools.isa_cost_device import CONFIGS, lengths  # noqa: E402

GATE = 0.25
"""Calibration gate: |model - measured| / measured within 25% (issue 26)."""


def cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass_text(path: Path) -> str:
    return subprocess.run([cuobjdump(), "-sass", str(path)], check=True, capture_output=True, text=True).stdout


def build(out: Path, jobs: int = 2) -> None:
    """The decode v8 blobs of every calibration config, through the product's build (no features)."""
    from ultraquant.codegen.archs import get_arch
    from ultraquant.codegen.build import BuildOptions
    from ultraquant.codegen.build import build as run_build
    from ultraquant.codegen.matrix import Selection

    keys = sorted({(c["D"], c["Hq"] // c["Hk"], c["block"]) for c in CONFIGS})
    att = tuple({"head_size": d, "gqa": g, "block_size": b, "dtype": "bf16", "has_sinks": False,
                 "has_window": False, "has_softcap": False} for d, g, b in keys)
    sel = Selection(head_sizes=tuple(sorted({k[0] for k in keys})), gqa=tuple(sorted({k[1] for k in keys})),
                    block_sizes=tuple(sorted({k[2] for k in keys})), dtypes=("bf16",), ops=("decode_attention_v8",),
                    kv_heads=tuple(sorted({c["Hk"] for c in CONFIGS})), attention=att)
    run_build(BuildOptions(archs=[get_arch("sm_90")], selection=sel, out_dir=out, jobs=jobs, cache_dir=None))


def _blob(generated: Path, cfg: dict) -> dict:
    m = json.loads((generated / "sm_90" / "manifest.json").read_text())
    for b in m["blobs"]:
        c = b["constexprs"]
        if (b["kernel"] == "uq_decode_v8" and c["D"] == cfg["D"] and c["GQA"] == cfg["Hq"] // cfg["Hk"]
                and c["HK"] == cfg["Hk"] and c["BLOCK_SIZE"] == cfg["block"] and not c["HAS_SINKS"]
                and not c["HAS_WINDOW"] and not c["HAS_SOFTCAP"]):
            return b
    raise SystemExit(f"no v8 blob for {cfg['name']} under {generated}")


def v8_splits(batch: int, max_tokens: int, sms: int = 132) -> int:
    """``ultraquant.kernels.decode_v8_plan.v8_splits`` for an H200 (the plan's own rule)."""
    from ultraquant.kernels.decode_v8_plan import V8_MIN_SPLIT_TOKENS, V8_PROGRAMS_PER_SM

    return max(1, min((sms * V8_PROGRAMS_PER_SM) // max(1, batch), math.ceil(max_tokens / V8_MIN_SPLIT_TOKENS)))


def predict(generated: Path, measured: dict | None = None) -> list[dict]:
    """Model rows of every config (splits from the measured run's plan when given, else the rule)."""
    from ultraquant.format import slot_size

    seen = {r["name"]: r for r in (measured or {}).get("rows", [])}
    profiles: dict[str, cm.KernelProfile] = {}
    rows = []
    for cfg in CONFIGS:
        lens = lengths(cfg["lens"])
        b = _blob(generated, cfg)
        if b["file"] not in profiles:
            ops = cm.parse_sass(sass_text(generated / "sm_90" / b["file"]))
            profiles[b["file"]] = cm.profile_sass(ops, b["resources"]["registers"], b["launch"]["shared"],
                                                  b["launch"]["threads"])
        prof = profiles[b["file"]]
        width = max(-(-n // cfg["block"]) for n in lens) * cfg["block"]
        splits = seen[cfg["name"]]["splits"] if cfg["name"] in seen else v8_splits(len(lens), width)
        est = cm.v8_time_us(prof, b["constexprs"], lens, splits, slot_bytes=slot_size(cfg["D"]))
        c = b["constexprs"]
        row = {"name": cfg["name"], "blob": b["file"], "key": b["key"], "splits": splits,
               "census": cm.census(prof.loop, c["NSUB"] * c["TW"]), "registers": prof.registers,
               "shared": prof.shared, **est}
        if cfg["name"] in seen:
            m = seen[cfg["name"]]
            row["measured_us"] = m["us"]
            row["error"] = (est["estimate_us"] - m["us"]) / m["us"]
            row["key_matches"] = m["key"] == b["key"]
        rows.append(row)
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        meas = f" measured {r['measured_us']:.1f} us, error {100 * r['error']:+.1f}%" if "measured_us" in r else ""
        print(f"{r['name']:16s} splits {r['splits']:3d}: loop {r['loop_instructions']} instr "
              f"({r['census']['per_token_head']} per token-head), {r['cycles_per_iteration']:.0f} cyc/iter "
              f"(IPC {r['issue_per_cycle_per_scheduler']:.2f}), estimate {r['estimate_us']:.1f} us "
              f"({r['bound']}; memory {r['memory_us']:.1f}){meas}")


def census_cmd(path: Path, arch: str) -> None:
    if arch == "sm_90":
        ops = cm.parse_sass(sass_text(path))
    else:
        from ultraquant.codegen.flydsl import isa

        ops = cm.parse_amdgpu(isa.disassemble(path.read_bytes(), arch))
    body = cm.hot_loop(ops)
    print(json.dumps(cm.census(body), indent=1))


def flydsl(out: Path) -> list[dict]:
    """Build the FlyDSL decodes like the backend does and estimate them on MI300X / MI355X."""
    from ultraquant.codegen.archs import get_arch
    from ultraquant.codegen.elf import read_code_object
    from ultraquant.codegen.flydsl import backend as fb
    from ultraquant.codegen.flydsl import isa
    from ultraquant.errors import UltraQuantError

    rows = []
    backend = fb.FlyDSLBackend()
    for arch, d, mx in [("gfx942", d, False) for d in (128, 256, 512)] + [
            ("gfx950", d, mx) for mx in (False, True) for d in (128, 256, 512)]:
        spec = backend.specialize(fb.OP_MX if mx else fb.OP, {"head_size": d, "gqa": 8, "block_size": 16,
                                                               "query_dtype": "bf16"})
        try:
            binary, info = backend.compile(spec, get_arch(arch))
        except UltraQuantError as exc:
            rows.append({"arch": arch, "kernel": spec.kernel, "head_size": d, "error": str(exc)})
            continue
        res = read_code_object(binary).kernels[spec.kernel].resources
        ops = cm.parse_amdgpu(isa.disassemble(binary, arch))
        est = cm.flydsl_estimate(ops, cm.MACHINES[arch], d, int(res["vgpr"]), int(res.get("agpr", 0)),
                                 int(res.get("lds_static", 0)), int(info["num_warps"]))
        row = {"arch": arch, "gpu": cm.MACHINES[arch].name, "kernel": spec.kernel, "head_size": d, "mx": mx,
               "vgpr": res["vgpr"], "agpr": res.get("agpr", 0), "lds": res.get("lds_static", 0), **est}
        rows.append(row)
        print(f"{arch} {spec.kernel} D={d}: {row['vgpr']} VGPR, {est['waves_per_simd']} waves/SIMD, loop "
              f"{est['census']['instructions']} instr ({est['census']['classes']}), "
              f"{est['cycles_per_tile']:.0f} cyc per 16-token tile per SIMD, estimate {est['estimate_tbs']:.2f} TB/s "
              f"({est['bound']} bound)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machines": {k: vars(v) for k, v in cm.MACHINES.items()}, "kernels": rows},
                              indent=1, default=str) + "\n")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--jobs", type=int, default=2)
    for name in ("predict", "calibrate"):
        p = sub.add_parser(name)
        p.add_argument("--generated", type=Path, required=True)
        p.add_argument("--out", type=Path)
        if name == "calibrate":
            p.add_argument("--measured", type=Path, required=True)
    p = sub.add_parser("census")
    p.add_argument("blob", type=Path)
    p.add_argument("--arch", default="sm_90")
    p = sub.add_parser("flydsl")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/isa_cost_flydsl.json"))
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out, a.jobs)
    elif a.cmd in ("predict", "calibrate"):
        measured = json.loads(a.measured.read_text()) if a.cmd == "calibrate" else None
        rows = predict(a.generated, measured)
        _print(rows)
        result = {"model": "codegen/cost_model.py", "machine": vars(cm.H200), "rows": rows}
        if measured:
            ok = [r for r in rows if "error" in r and abs(r["error"]) <= GATE]
            result.update(measured_file=str(a.measured), ceiling_tbs=measured.get("ceiling_tbs"),
                          clocks=measured.get("sm_clock_mhz_samples"),
                          within_gate=len(ok), gate=f"|error| <= {GATE:.0%} on >= 6 configs",
                          gate_met=len(ok) >= 6)
            print(f"within {GATE:.0%}: {len(ok)} of {len(rows)} configs; gate {'met' if len(ok) >= 6 else 'NOT met'}")
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    elif a.cmd == "census":
        census_cmd(a.blob, a.arch)
    elif a.cmd == "flydsl":
        flydsl(a.out)


if __name__ == "__main__":
    main()
