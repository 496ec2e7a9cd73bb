"""Roofline ESTIMATE of the FlyDSL decode kernels on MI300X (gfx942) and MI355X (gfx950), from their ISA.

No AMD GPU is reachable: nothing here is measured on hardware. Each kernel is built like the backend
builds it (GQA 8, block 16, no features), and its main loop (the backward branch around the QK MFMAs)
is read from the disassembly: instructions per 16-token tile, the global loads and where the loop
waits for them (``s_waitcnt vmcnt``), VGPRs and LDS from the code object. Then, per CU:

- resident waves = min(register limit, LDS limit, 8) per SIMD x 4 SIMDs (the grid assumed large enough);
- bytes in flight per wave = the largest group of loads issued before a wait that needs them;
- issue time of a tile = VALU instructions x 4 cycles (wave64 on a 16-lane SIMD) + MFMA cycles
  (16x16x16 bf16: 16, scaled 16x16x128 with an FP8 operand: 32; published in ROCm/rocm-blogs
  matrix-cores-cdna) + other instructions x 1, summed over the waves sharing a SIMD (upper bound: no
  VALU/MFMA overlap);
- per SIMD: tile bytes x waves / max(dependent waits x LATENCY + issue time of one wave, issue time of
  all waves), a dependent wait being one that forces loads issued in the same step (see loop_profile);
- the estimate is the smaller of that x SIMDs and the HBM bandwidth.

``python tools/flydsl_roofline.py [--loop pipelined|unpipelined] --out FILE``
(needs the build venv:
flydsl, lld-19, llvm-objdump-22). Assumptions are in ``GPUS``/``LATENCY_NS`` and are written into the file.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ultraquant.codegen.archs import get_arch
from ultraquant.codegen.elf import read_code_object
from ultraquant.codegen.flydsl import backend as fb
from ultraquant.codegen.flydsl import isa
from ultraquant.errors import UltraQuantError
from ultraquant.format import slot_size

GPUS = {
    "gfx942": {"name": "MI300X", "cus": 304, "clock_ghz": 2.1, "hbm_tbs": 5.3, "hbm_tbs_measured": 4.2,
               "lds_per_cu": 64 * 1024},
    "gfx950": {"name": "MI355X", "cus": 256, "clock_ghz": 2.4, "hbm_tbs": 8.0, "hbm_tbs_measured": None,
               "lds_per_cu": 160 * 1024},
}
"""Public spec figures (AMD CDNA3/CDNA4 white papers); MI300X ~4.2 TB/s measured by others."""

LATENCY_NS = 1000.0
"""ASSUMED loaded HBM latency per dependent wait (not measured here; ~0.7-1.2 us is the usual range)."""

MFMA_CYCLES = {isa.BF16_MFMA: 16, isa.SCALED_MFMA: 32}
LOAD_BYTES = {"ubyte": 1, "sbyte": 1, "ushort": 2, "short": 2, "dword": 4, "dwordx2": 8, "dwordx3": 12,
              "dwordx4": 16}
_LINE = re.compile(r"^\s+(\S+)\s*(.*?)\s*//\s*([0-9A-Fa-f]+):.*?(?:<\w+\+0x([0-9a-f]+)>)?\s*$")


def _instructions(text: str) -> list[tuple[int, str, str, int | None]]:
    """(address, mnemonic, operands, branch target) of every instruction of the disassembly."""
    out = []
    base = None
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+) <\w+>:", line)
        if head:
            base = int(head.group(1), 16)
            continue
        m = _LINE.match(line)
        if m and base is not None:
            target = base + int(m.group(4), 16) if m.group(4) else None
            out.append((int(m.group(3), 16), m.group(1), m.group(2), target))
    return out


def main_loop(text: str) -> list[tuple[int, str, str, int | None]]:
    """The instructions of the backward-branch loop holding the most MFMAs (one 16-token tile)."""
    ins = _instructions(text)
    best: list = []
    for addr, mnem, _ops, target in ins:
        if mnem.startswith("s_cbranch") and target is not None and target < addr:
            body = [x for x in ins if target <= x[0] <= addr]
            if sum(x[1].startswith("v_mfma") for x in body) > sum(x[1].startswith("v_mfma") for x in best):
                best = body
    return best


def loop_profile(body: list[tuple[int, str, str, int | None]]) -> dict:
    """Instruction mix, load bytes per lane and the dependent waits of one loop body.

    Loads complete in order, so ``s_waitcnt vmcnt(N)`` forces all but the N most recent loads: a wait
    is *dependent* (costs a full latency) when that includes a load of this iteration issued after the
    previous dependent wait (a new round trip; waits on loads already in that round are free); loads
    still outstanding at the end of the body were issued for the next iteration (pipelined)."""
    counts = {"valu": 0, "mfma": {}, "salu": 0, "lds": 0, "loads": 0, "other": 0}
    widths: list[int] = []  # this iteration's loads, in issue order (bytes per lane)
    drained = 0  # how many of them a wait has forced
    round_start = 0  # loads issued when the last dependent wait began: later ones need a new round trip
    groups, dependent = [], 0
    for _addr, mnem, ops, _t in body:
        if mnem.startswith("v_mfma"):
            counts["mfma"][mnem] = counts["mfma"].get(mnem, 0) + 1
        elif mnem.startswith(("global_load", "buffer_load")):
            counts["loads"] += 1
            widths.append(LOAD_BYTES[mnem.split("_load_")[1].split("_")[0]])
        elif mnem == "s_waitcnt" and "vmcnt" in ops:
            keep = int(re.search(r"vmcnt\((\d+)\)", ops).group(1))
            forced = len(widths) - keep
            if forced > round_start:  # waits on a load issued after the last round trip began
                groups.append(sum(widths[round_start:]))
                dependent += 1
                round_start = len(widths)
            drained = max(drained, forced)
        elif mnem.startswith("v_"):
            counts["valu"] += 1
        elif mnem.startswith("ds_"):
            counts["lds"] += 1
        elif mnem.startswith("s_"):
            counts["salu"] += 1
        else:
            counts["other"] += 1
    carried = sum(widths[drained:])
    return {**counts, "load_bytes_per_lane": sum(widths), "load_groups_bytes_per_lane": groups + [carried],
            "dependent_waits": dependent, "carried_bytes_per_lane": carried}


def estimate(arch: str, head_size: int, resources: dict, prof: dict, waves_per_block: int) -> dict:
    """Per-CU bandwidth estimate of one kernel (see the module doc for the model)."""
    gpu = GPUS[arch]
    regs = isa.waves_per_simd(int(resources["vgpr"]), int(resources.get("agpr", 0)))
    lds = int(resources.get("lds_static", 0))
    blocks_by_lds = gpu["lds_per_cu"] // lds if lds else 10**9
    waves_simd = max(1, min(regs, isa.MAX_WAVES, blocks_by_lds * waves_per_block // 4 or 1))
    tile_bytes = 16 * slot_size(head_size)  # unique HBM bytes of one 16-token tile (K and V slots)
    mfma_cycles = sum(MFMA_CYCLES.get(k, 16) * n for k, n in prof["mfma"].items())
    issue = 4 * prof["valu"] + mfma_cycles + prof["salu"] + 4 * prof["lds"] + prof["loads"]
    clock = gpu["clock_ghz"]
    # dependent waits each cost a latency; loads carried to the next step only cost what the step's
    # own work does not cover
    if prof["dependent_waits"]:
        one_wave_ns = prof["dependent_waits"] * LATENCY_NS + issue / clock
    else:
        one_wave_ns = max(issue / clock, LATENCY_NS if prof["carried_bytes_per_lane"] else 0.0)
    all_waves_ns = waves_simd * issue / clock
    per_simd = waves_simd * tile_bytes / max(one_wave_ns, all_waves_ns)  # bytes per ns = GB/s
    per_gpu_tbs = per_simd * 4 * gpu["cus"] / 1000.0
    return {
        "waves_per_simd": waves_simd, "waves_per_simd_by_registers": regs, "tile_bytes": tile_bytes,
        "issue_cycles_per_tile": issue, "latency_bound": one_wave_ns > all_waves_ns,
        "bytes_in_flight_per_wave_max": 64 * max(prof["load_groups_bytes_per_lane"] or [0]),
        "bytes_in_flight_per_cu": 4 * waves_simd * 64 * max(prof["load_groups_bytes_per_lane"] or [0]),
        "bytes_in_flight_per_cu_needed": gpu["hbm_tbs"] * 1e12 * LATENCY_NS * 1e-9 / gpu["cus"],
        "estimate_tbs": min(per_gpu_tbs, gpu["hbm_tbs"]), "kernel_bound_tbs": per_gpu_tbs,
        "fraction_of_spec": min(per_gpu_tbs, gpu["hbm_tbs"]) / gpu["hbm_tbs"],
    }


CASES = [("gfx942", d, False) for d in (128, 256, 512)] + [("gfx950", d, mx) for mx in (False, True)
                                                          for d in (128, 256, 512)]


def run(out: Path) -> list[dict]:
    """Build every case, profile its loop, write the estimates to ``out``."""
    rows = []
    backend = fb.FlyDSLBackend()
    for arch, d, mx in CASES:
        spec = backend.specialize(fb.OP_MX if mx else fb.OP, {"head_size": d, "gqa": 8, "block_size": 16,
                                                               "query_dtype": "bf16"})
        try:
            binary, info = backend.compile(spec, get_arch(arch))
        except UltraQuantError as exc:  # a forced loop structure can fail the ISA checks (spills)
            print(f"{arch} {spec.kernel} D={d}: not built: {exc}")
            rows.append({"arch": arch, "gpu": GPUS[arch]["name"], "kernel": spec.kernel, "head_size": d,
                         "error": str(exc)})
            continue
        res = read_code_object(binary).kernels[spec.kernel].resources
        prof = loop_profile(main_loop(isa.disassemble(binary, arch)))
        row = {"arch": arch, "gpu": GPUS[arch]["name"], "kernel": spec.kernel, "head_size": d,
               "waves_per_block": info["num_warps"], "vgpr": res["vgpr"], "agpr": res.get("agpr", 0),
               "lds": res.get("lds_static", 0), "loop": prof,
               "estimate": estimate(arch, d, res, prof, info["num_warps"])}
        rows.append(row)
        e = row["estimate"]
        print(f"{arch} {spec.kernel} D={d}: {res['vgpr']} VGPR, {row['lds']} B LDS, {e['waves_per_simd']} waves/SIMD,"
              f" {prof['valu']} VALU + {prof['mfma']} per tile, {prof['loads']} loads, "
              f"{prof['dependent_waits']} dependent waits, in flight/CU {e['bytes_in_flight_per_cu']} B "
              f"(needed {e['bytes_in_flight_per_cu_needed']:.0f}), estimate {e['estimate_tbs']:.2f} TB/s "
              f"({100 * e['fraction_of_spec']:.0f}% of spec, {'latency' if e['latency_bound'] else 'issue'} bound)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"assumptions": {"gpus": GPUS, "latency_ns": LATENCY_NS, "mfma_cycles": MFMA_CYCLES,
                                               "config": "GQA 8, block 16, no features, bf16"},
                               "kernels": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/flydsl_roofline.json"))
    ap.add_argument("--loop", choices=["built", "pipelined", "unpipelined"], default="built",
                    help="the main loop as the backend builds it, or every blob with / without pipelining")
    args = ap.parse_args()
    if args.loop != "built":
        from ultraquant.codegen.flydsl import compiler

        plain = compiler.compile_decode
        compiler.compile_decode = lambda *a, **k: plain(*a, **{**k, "pipelined": args.loop == "pipelined"})
    run(args.out)
