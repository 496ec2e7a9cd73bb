"""The ISA cost model (codegen/cost_model.py) on hand-written disassembly: control bits, waits, pipes."""

from __future__ import annotations

import json
from pathlib import Path

from ultraquant.codegen import cost_model as cm

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _ctrl(stall: int = 1, wrbar: int = 7, rdbar: int = 7, wait: int = 0, yld: int = 1) -> int:
    return (stall | yld << 4 | wrbar << 5 | rdbar << 8 | wait << 11) << 41


def _sass(lines: list[tuple[str, int]]) -> str:
    out = ["\tcode for sm_90a", "\t\tFunction : k"]
    for i, (ins, ctrl) in enumerate(lines):
        out.append(f"        /*{16 * i:04x}*/                   {ins} ;   /* 0x0000000000000000 */")
        out.append(f"                                                    /* 0x{ctrl:016x} */")
    return "\n".join(out) + "\n"


def test_control_bits_from_real_cuobjdump_lines() -> None:
    # two instructions of a real sm_90 blob (uq_decode_wholepage's first lines, cuobjdump 12.x)
    pad = " " * 30
    text = (f"        /*0000*/  LDC R1, c[0x0][0x28] ;{pad}/* 0x00000a00ff017b82 */\n"
            f"{pad}/* 0x000e700000000800 */\n"
            f"        /*00a0*/  VIADD R1, R1, 0xfffffff8 ;{pad}/* 0xfffffff801017836 */\n"
            f"{pad}/* 0x002fe20000000000 */\n")
    ldc, viadd = cm.parse_sass("\t\tFunction : k\n" + text)
    assert (ldc.stall, ldc.sets, ldc.waits) == (8, 1, ())
    assert (viadd.stall, viadd.sets, viadd.waits) == (1, None, (1,))
    assert viadd.pipe == "alu" and ldc.cls == "misc"


def test_pipes_and_classes() -> None:
    ops = cm.parse_sass(_sass([("FFMA R0, R1, R2, R3", _ctrl()), ("LOP3.LUT R0, R1, R2, RZ, 0xc0, !PT", _ctrl()),
                               ("HMMA.16816.F32 R0, R4, R8, R0", _ctrl()), ("LDS.64 R2, [R3]", _ctrl(wrbar=0)),
                               ("MUFU.EX2 R5, R6", _ctrl(wrbar=1)), ("ULDC UR4, c[0x0][0x0]", _ctrl())]))
    assert [(o.cls, o.pipe, o.occupancy) for o in ops] == [
        ("fma", "fma", 1), ("alu", "alu", 2), ("mma", "tensor", 8), ("lds", "mio", 8), ("xu", "xu", 8),
        ("uniform", "uniform", 1)]


def _loop(body: list[tuple[str, int]]) -> list[cm.Op]:
    lines = body + [(f"BRA 0x{0:x}", _ctrl())]
    return cm.hot_loop(cm.parse_sass(_sass(lines))) or cm.parse_sass(_sass(lines))


def test_issue_and_pipe_limits() -> None:
    ffma = _loop([("FFMA R0, R1, R2, R3", _ctrl())] * 20)
    assert abs(cm.simulate(ffma, 1)["cycles_per_iteration"] - 21) <= 1  # 1 issue per cycle
    assert abs(cm.simulate(ffma, 2)["cycles_per_iteration"] - 42) <= 2  # two warps share the scheduler
    lop = _loop([("LOP3.LUT R0, R1, R2, RZ, 0xc0, !PT", _ctrl())] * 20)
    assert abs(cm.simulate(lop, 2)["cycles_per_iteration"] - 80) <= 3  # ALU pipe: 2 cycles per warp op


def test_latency_is_hidden_by_more_warps() -> None:
    # each iteration: an LDS whose result the next op waits for (scoreboard 0), then 8 FFMAs
    body = _loop([("LDS R2, [R3]", _ctrl(wrbar=0)), ("FFMA R0, R2, R2, R0", _ctrl(wait=1))]
                 + [("FFMA R4, R5, R6, R7", _ctrl())] * 8)
    one = cm.simulate(body, 1)["cycles_per_iteration"]
    four = cm.simulate(body, 4)["cycles_per_iteration"]
    assert one >= cm.SM90_LATENCY["lds"]  # the exposed latency
    assert four < 4 * one * 0.6  # four warps overlap their waits


def test_cdna_waitcnt_counts_outstanding_loads() -> None:
    text = "\n".join([
        "0000000000001000 <k>:",
        "\tglobal_load_dwordx4 v[0:3], v[4:5], off                   // 000000001000: DEADBEEF",
        "\tglobal_load_dwordx4 v[6:9], v[4:5], off                   // 000000001008: DEADBEEF",
        "\ts_waitcnt vmcnt(1)                                        // 000000001010: BF8C0F70",
        "\tv_mfma_f32_16x16x16_bf16 v[0:3], v[0:1], v[2:3], v[0:3]   // 000000001014: D3E10000",
        "\ts_waitcnt vmcnt(0)                                        // 000000001018: BF8C0F70",
        "\tv_add_f32_e32 v1, v2, v3                                  // 00000000101C: 02020503",
        "\ts_cbranch_scc1 65530                                      // 000000001020: BF85FFFA <k+0x0>",
    ])
    ops = cm.parse_amdgpu(text)
    body = cm.hot_loop(ops)
    assert [o.cls for o in body] == ["vmem", "vmem", "waitcnt", "mfma", "waitcnt", "valu", "branch"]
    assert body[2].waitcnt == {"vm": 1} and body[0].sets == "vm"
    one = cm.simulate(body, 1, multi_issue=True)["cycles_per_iteration"]
    assert one >= cm.CDNA_LATENCY["vmem"]  # both loads' round trip is exposed with one wave
    eight = cm.simulate(body, 8, iterations=6, multi_issue=True)["cycles_per_iteration"]
    assert eight < 8 * one * 0.5


def test_calibration_record_is_consistent() -> None:
    """The committed H200 calibration: errors recomputed from its rows, and the gate count with them."""
    cal = json.loads((RESULTS / "isa_cost_calibration_h200.json").read_text())
    measured = json.loads((RESULTS / "isa_cost_calibration_h200_measured.json").read_text())
    by_name = {r["name"]: r for r in measured["rows"]}
    within = 0
    for row in cal["rows"]:
        m = by_name[row["name"]]
        assert row["measured_us"] == m["us"] and row["splits"] == m["splits"] and row["config_matches"]
        err = (row["estimate_us"] - m["us"]) / m["us"]
        assert abs(err - row["error"]) < 1e-9
        within += abs(err) <= 0.25
    assert within == cal["within_gate"] and cal["gate_met"] == (within >= 6)
    assert len({tuple(r["lens"]) for r in measured["rows"] if len(set(r["lens"])) > 1}) >= 2  # ragged batches


def _isa_cost_tool():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "isa_cost.py"
    spec = importlib.util.spec_from_file_location("isa_cost_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _amd_loop(lines: list[str]) -> list[cm.Op]:
    rows = ["0000000000001000 <k>:"]
    for i, line in enumerate(lines):
        rows.append(f"\t{line:58s}// {0x1000 + 4 * i:012X}: DEADBEEF")
    rows.append(f"\ts_cbranch_scc1 65530{'':38s}// {0x1000 + 4 * len(lines):012X}: BF85FFFA <k+0x0>")
    return cm.parse_amdgpu("\n".join(rows))


def test_loads_after_first_wait_counts_a_second_round_trip() -> None:
    """The tool's schedule check: the block-table entry (waited for with vmcnt(0) before any other
    load) is not a tile load; a tile load issued after the first wait on the tile's loads is."""
    tool = _isa_cost_tool()
    head = ["global_load_dword v9, v8, s[2:3]", "s_waitcnt vmcnt(0)",
            "global_load_dword v0, v[4:5], off", "global_load_ubyte v1, v[4:5], off offset:68"]
    mfma = "v_mfma_f32_16x16x16_f16 v[0:3], v[0:1], v[2:3], 0"
    one_trip = head + ["global_load_ubyte v2, v[6:7], off offset:68", "s_waitcnt vmcnt(1)", mfma,
                       "s_waitcnt vmcnt(0)", "v_add_f32_e32 v1, v2, v3"]
    two_trips = head + ["s_waitcnt vmcnt(1)", mfma, "global_load_ubyte v2, v[6:7], off offset:68",
                        "s_waitcnt vmcnt(0)", "v_add_f32_e32 v1, v2, v3"]
    assert tool.loads_after_first_wait(_amd_loop(one_trip)) == 0
    assert tool.loads_after_first_wait(_amd_loop(two_trips)) == 1
