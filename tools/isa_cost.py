"""ISA cost model CLI (the library is ``codegen/cost_model.py``): build, predict, calibrate, estimate AMD.

    python tools/isa_cost.py build --out .isa/gen                      # the sm_90 calibration blobs
    python tools/isa_cost.py predict --generated .isa/gen --out P.json # model times of the configs
    python tools/isa_cost.py calibrate --generated .isa/gen --measured M.json --out C.json
    python tools/isa_cost.py census BLOB [--arch sm_90|gfx942|gfx950] [--tokens 64]  # hot-loop census
    python tools/isa_cost.py flydsl --out F.json                       # FlyDSL decode on MI300X/MI355X
    python tools/isa_cost.py blobs generated/gfx942 generated/gfx950 --out F.json  # every built FlyDSL blob

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
    """The whole-page decode blobs of every calibration config, through the product's build (no features)."""
    from ultraquant.codegen.archs import get_arch
    from ultraquant.codegen.build import BuildOptions
    from ultraquant.codegen.build import build as run_build
    from ultraquant.codegen.matrix import Selection

    keys = sorted({(c["D"], c["Hq"] // c["Hk"], c["block"]) for c in CONFIGS})
    att = tuple({"head_size": d, "gqa": g, "block_size": b, "dtype": "bf16", "has_sinks": False,
                 "has_window": False, "has_softcap": False} for d, g, b in keys)
    sel = Selection(head_sizes=tuple(sorted({k[0] for k in keys})), gqa=tuple(sorted({k[1] for k in keys})),
                    block_sizes=tuple(sorted({k[2] for k in keys})), dtypes=("bf16",),
                    ops=("decode_attention_wholepage",), kv_heads=tuple(sorted({c["Hk"] for c in CONFIGS})),
                    attention=att)
    run_build(BuildOptions(archs=[get_arch("sm_90")], selection=sel, out_dir=out, jobs=jobs, cache_dir=None))


def _blob(generated: Path, cfg: dict) -> dict:
    m = json.loads((generated / "sm_90" / "manifest.json").read_text())
    for b in m["blobs"]:
        c = b["constexprs"]
        if (b["kernel"] == "uq_decode_wholepage" and c["D"] == cfg["D"] and c["GQA"] == cfg["Hq"] // cfg["Hk"]
                and c["HK"] == cfg["Hk"] and c["BLOCK_SIZE"] == cfg["block"] and not c["HAS_SINKS"]
                and not c["HAS_WINDOW"] and not c["HAS_SOFTCAP"]):
            return b
    raise SystemExit(f"no whole-page decode blob for {cfg['name']} under {generated}")


def wholepage_splits(batch: int, max_tokens: int, sms: int = 132) -> int:
    """``ultraquant.kernels.families.decode_wholepage``'s split rule for an H200 (the plan's own)."""
    from ultraquant.kernels.families.decode_wholepage import (
        WHOLEPAGE_MIN_SPLIT_TOKENS,
        WHOLEPAGE_PROGRAMS_PER_SM,
    )

    return max(1, min((sms * WHOLEPAGE_PROGRAMS_PER_SM) // max(1, batch),
                      math.ceil(max_tokens / WHOLEPAGE_MIN_SPLIT_TOKENS)))


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
        splits = seen[cfg["name"]]["splits"] if cfg["name"] in seen else wholepage_splits(len(lens), width)
        est = cm.wholepage_time_us(prof, b["constexprs"], lens, splits, slot_bytes=slot_size(cfg["D"]))
        c = b["constexprs"]
        row = {"name": cfg["name"], "blob": b["file"], "key": b["key"], "splits": splits,
               "census": cm.census(prof.loop, c["NSUB"] * c["TW"]), "registers": prof.registers,
               "shared": prof.shared, **est}
        if cfg["name"] in seen:
            m = seen[cfg["name"]]
            row["measured_us"] = m["us"]
            row["error"] = (est["estimate_us"] - m["us"]) / m["us"]
            # the run may predate a kernel rename: the constexpr part of the key must match
            row["measured_key"] = m["key"]
            row["config_matches"] = (m["key"].split("[", 1)[1].replace("MATH=True,", "")
                                     == b["key"].split("[", 1)[1].replace("MATH=True,", ""))
        rows.append(row)
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        meas = f" measured {r['measured_us']:.1f} us, error {100 * r['error']:+.1f}%" if "measured_us" in r else ""
        print(f"{r['name']:16s} splits {r['splits']:3d}: loop {r['loop_instructions']} instr "
              f"({r['census']['per_token_head']} per token-head), {r['cycles_per_iteration']:.0f} cyc/iter "
              f"(IPC {r['issue_per_cycle_per_scheduler']:.2f}), estimate {r['estimate_us']:.1f} us "
              f"({r['bound']}; memory {r['memory_us']:.1f}){meas}")


def census_cmd(path: Path, arch: str, tokens: float = 1.0) -> None:
    if arch == "sm_90":
        ops = cm.parse_sass(sass_text(path))
    else:
        from ultraquant.codegen.flydsl import isa

        ops = cm.parse_amdgpu(isa.disassemble(path.read_bytes(), arch))
    body = cm.hot_loop(ops)
    print(json.dumps(cm.census(body, tokens), indent=1))


TARGETS = {("gfx942", 128): 3.5, ("gfx942", 256): 3.2, ("gfx950", 128): 6.0}
"""Issue 26's estimated-bandwidth gates (TB/s)."""


def _amd_cases() -> list[tuple[str, str, int, bool]]:
    """(backend, arch, head size, mx) of every AMD decode the tool estimates."""
    fly = [("flydsl", "gfx942", d, False) for d in (128, 256, 512)]
    fly += [("flydsl", "gfx950", d, mx) for mx in (False, True) for d in (128, 256, 512)]
    tri = [("triton", a, d, False) for a in ("gfx942", "gfx950") for d in (64, 128, 256)]
    return fly + tri


def flydsl(out: Path, budgets: bool = False) -> list[dict]:
    """Build the AMD decodes (FlyDSL, and the Triton fallback) like the backends do (GQA 8, block 16,
    bf16, no features) and estimate them on MI300X / MI355X at two loaded latencies; with ``budgets``
    also the VALU per tile each gate allows (:func:`codegen.cost_model.valu_budget`)."""
    from ultraquant.codegen.archs import get_arch
    from ultraquant.codegen.elf import read_code_object
    from ultraquant.codegen.flydsl import backend as fb
    from ultraquant.codegen.flydsl import isa
    from ultraquant.codegen.triton_backend import TritonBackend
    from ultraquant.errors import UltraQuantError

    rows = []
    backends = {"flydsl": fb.FlyDSLBackend(), "triton": TritonBackend()}
    for kind, arch, d, mx in _amd_cases():
        backend = backends[kind]
        op = (fb.OP_MX if mx else fb.OP) if kind == "flydsl" else "decode_attention"
        config = {"head_size": d, "gqa": 8, "block_size": 16, "query_dtype": "bf16"}
        if kind == "triton":
            config["target"] = "hip"
        spec = backend.specialize(op, config)
        try:
            binary, info = backend.compile(spec, get_arch(arch))
        except UltraQuantError as exc:
            rows.append({"arch": arch, "kernel": spec.kernel, "head_size": d, "error": str(exc)})
            continue
        res = read_code_object(binary).kernels[spec.kernel].resources
        waves_per_block = int(info.get("num_warps", spec.num_warps))
        tile = 16 if kind == "flydsl" else spec.constexprs["TILE"] // spec.num_warps
        ops = cm.parse_amdgpu(isa.disassemble(binary, arch))
        vgpr, agpr, lds = int(res["vgpr"]), int(res.get("agpr", 0)), int(res.get("lds_static", 0))
        m = cm.MACHINES[arch]
        est = {f"{int(lat)}ns": cm.flydsl_estimate(ops, m, d, vgpr, agpr, lds, waves_per_block, lat, tile)
               for lat in (1000.0, 500.0)}
        row = {"arch": arch, "gpu": m.name, "backend": kind, "kernel": spec.kernel, "head_size": d, "mx": mx,
               "vgpr": vgpr, "agpr": agpr, "lds": lds, "scratch": res.get("private_segment_fixed_size"),
               "tile_tokens_per_wave": tile, "estimate": est}
        target = TARGETS.get((arch, d))
        if budgets and target and kind == "flydsl":
            row["gate_tbs"] = target
            row["valu_budget"] = {f"{int(lat)}ns_{w or 'built'}_waves": cm.valu_budget(
                ops, m, d, vgpr, agpr, lds, waves_per_block, target, lat, w)
                for lat in (1000.0, 500.0) for w in (None, 4, 8)}
        rows.append(row)
        e = est["1000ns"]
        print(f"{arch} {kind} {spec.kernel} D={d}: {vgpr} VGPR, {e['waves_per_simd']} waves/SIMD, loop "
              f"{e['census']['instructions']} instr ({e['census']['classes']}), {e['cycles_per_tile']:.0f} cycles "
              f"per iteration of the SIMD's waves; estimate {e['estimate_tbs']:.2f} TB/s at 1 us "
              f"({e['bound']}), {est['500ns']['estimate_tbs']:.2f} at 0.5 us"
              + (f"; VALU budget for {target} TB/s: {row['valu_budget']}" if "valu_budget" in row else ""),
              flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "codegen/cost_model.py (flydsl_estimate, valu_budget)",
                               "config": "GQA 8, block 16, bf16, no features; grid large enough to fill the GPU",
                               "machines": {k: vars(v) for k, v in cm.MACHINES.items()},
                               "latencies": {"cdna": cm.CDNA_LATENCY, "note": "vm latency = the row's ns x clock"},
                               "kernels": rows}, indent=1, default=str) + "\n")
    return rows


def loads_after_first_wait(ops: list[cm.Op]) -> int:
    """Tile loads of the hot loop issued after the loop first waits for one (``s_waitcnt vmcnt``): 0 is
    one memory round trip per tile, more is a second one the waves must hide. The loop's leading index
    loads (the block-table entry: each waited for with ``vmcnt(0)`` before the next load) are not tile
    loads. Meant for the loop without software pipelining (a pipelined loop's loads are the next tile's)."""
    body = cm.hot_loop(ops)
    loads = [i for i, o in enumerate(body) if o.sets == "vm" and o.opcode.startswith(("global_load", "buffer_load"))]
    tile = list(loads)
    while tile:
        nxt = next((o for o in body[tile[0] + 1:] if o.sets == "vm" or "vm" in o.waitcnt), None)
        if nxt is None or nxt.waitcnt.get("vm") != 0:
            break
        tile.pop(0)
    if not tile:
        return 0
    first_wait = next((i for i in range(tile[0], len(body)) if "vm" in body[i].waitcnt), len(body))
    return sum(i > first_wait for i in tile)


def blobs(generated: list[Path], out: Path) -> list[dict]:
    """Estimate every FlyDSL decode blob of built arch folders (``make kernels`` / ``ultraquant build``
    output: ``<dir>/manifest.json``) on its GPU at 1 us and 0.5 us loaded latency, with the gate of
    its (arch, head size) where issue 26 names one; registers, waves and pipelining from the manifest."""
    from ultraquant.codegen.flydsl import isa

    rows = []
    for folder in generated:
        manifest = json.loads((folder / "manifest.json").read_text())
        arch = manifest["arch"]
        m = cm.MACHINES[arch]
        for e in manifest["blobs"]:
            if e.get("backend") != "flydsl":
                continue
            res, c = e["resources"], e["config"]
            ops = cm.parse_amdgpu(isa.disassemble((folder / e["file"]).read_bytes(), arch))
            waves_per_block = int(e["isa"]["waves_per_block"])
            est = {f"{int(lat)}ns": cm.flydsl_estimate(ops, m, c["head_size"], int(res["vgpr"]), int(res["agpr"]),
                                                       int(res["lds_static"]), waves_per_block, lat)
                   for lat in (1000.0, 500.0)}
            feats = "+".join(f for f in ("sinks", "window", "softcap") if c.get(f"has_{f}")) or "plain"
            gate = TARGETS.get((arch, c["head_size"]))
            e1 = est["1000ns"]
            row = {"arch": arch, "gpu": m.name, "kernel": e["kernel"], "file": e["file"], "sha256": e["sha256"],
                   "head_size": c["head_size"], "gqa": c["gqa"], "block_size": c["block_size"], "features": feats,
                   "vgpr": res["vgpr"], "agpr": res["agpr"], "lds": res["lds_static"], "scratch": res["scratch"],
                   "waves_per_block": waves_per_block, "pipelined": e["isa"]["pipelined"],
                   "waves_per_simd": e1["waves_per_simd"], "loop": e1["census"]["classes"],
                   "estimate_tbs": {k: round(v["estimate_tbs"], 3) for k, v in est.items()},
                   "bound": {k: v["bound"] for k, v in est.items()},
                   "cycles_per_tile": {k: round(v["cycles_per_tile"], 1) for k, v in est.items()},
                   "issue_bound_cycles": e1["issue_bound_cycles_all_waves"],
                   "loads_after_first_wait": None if e["isa"]["pipelined"] else loads_after_first_wait(ops),
                   "bytes_in_flight_per_cu": e1["bytes_in_flight_per_cu_max"]}
            if gate:
                row["gate_tbs"] = gate
                row["gate_met_at_1us"] = e1["estimate_tbs"] >= gate
            rows.append(row)
            print(f"{arch} {e['kernel']} D={c['head_size']} GQA={c['gqa']} {feats}: {res['vgpr']} VGPR, "
                  f"{e1['waves_per_simd']} waves, loop VALU {e1['census']['classes'].get('valu')}, "
                  f"{row['estimate_tbs']['1000ns']:.2f} TB/s at 1 us ({e1['bound']}), "
                  f"{row['estimate_tbs']['500ns']:.2f} at 0.5 us"
                  + ("" if e["isa"]["pipelined"] else f", {row['loads_after_first_wait']} loads after the first wait")
                  + (f"; gate {gate}" if gate else ""), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "codegen/cost_model.py (flydsl_estimate)",
                               "blobs_from": [str(g) for g in generated],
                               "note": "estimates from the built code objects; nothing measured on an AMD GPU",
                               "machines": {k: vars(v) for k, v in cm.MACHINES.items() if k in ("gfx942", "gfx950")},
                               "latencies": {"cdna": cm.CDNA_LATENCY, "note": "vm latency = the row's ns x clock"},
                               "rows": rows}, indent=1, default=str) + "\n")
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
    p.add_argument("--tokens", type=float, default=1.0,
                   help="token-heads one loop iteration handles (whole-page decode: NSUB x TW = 64 at D=128)")
    p = sub.add_parser("flydsl")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/isa_cost_amd.json"))
    p.add_argument("--budgets", action="store_true", help="also the VALU per tile each gate allows (slow)")
    p = sub.add_parser("blobs")
    p.add_argument("generated", type=Path, nargs="+", help="built arch folders (with manifest.json)")
    p.add_argument("--out", type=Path, required=True)
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
        census_cmd(a.blob, a.arch, a.tokens)
    elif a.cmd == "blobs":
        blobs(a.generated, a.out)
    elif a.cmd == "flydsl":
        flydsl(a.out, a.budgets)


if __name__ == "__main__":
    main()
