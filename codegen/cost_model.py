"""ISA cost model of the decode kernels: from a built blob's disassembly to an estimated time and bound.

One method for both vendors, so it can be checked where hardware exists (NVIDIA) before it is trusted
where none does (AMD):

1. **Parse** the disassembly (``cuobjdump -sass`` text for a cubin, ``llvm-objdump -d`` text for a
   HSACO) into :class:`Op` records: opcode, class, the execution pipe it occupies and for how long,
   how long the same warp/wave must wait before its next instruction, and which earlier variable-latency
   results it waits for.
   - sm_90: the wait and the stall come from the **control bits ptxas writes into every instruction**
     (stall count, yield, write/read scoreboard, wait mask; bits 105-125 of the 128-bit word, layout
     as decoded by Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking",
     arXiv:1804.06826, section 2.1, unchanged through Hopper), so fixed-latency dependencies cost
     exactly what the compiler scheduled.
   - CDNA: the hardware interlocks VALU dependencies; a wave waits only at ``s_waitcnt`` (vm/lgkm
     counters: AMD CDNA3 ISA guide, section 4.4 "Data dependency resolution") and ``s_nop``.
2. **Find the hot loop** (the backward branch whose body holds the most matrix instructions) and count
   it by class per token-head (:func:`census`).
3. **Simulate one scheduler** (an sm_90 SMSP, a CDNA SIMD) issuing the loop for its resident
   warps/waves (:func:`simulate`): in order per warp, one issue per cycle per scheduler, each pipe busy
   for its occupancy (:data:`SM90_PIPES`, :data:`CDNA_PIPES`), variable-latency results after their
   latency, barriers joining the warps. The steady-state cycles per iteration combine issue, pipe
   throughput and latency the way the hardware does, instead of a ``max`` of separate bounds.
4. **Memory**: the bytes a loop iteration reads, bytes in flight against latency (Little's law), and
   the HBM bandwidth; the estimate is the slower of the issue time and the memory time.

The launch-level composition (programs, splits, iterations per warp, waves of programs on the
machine) is per kernel: :func:`wholepage_time_us` for NVIDIA's whole-page decode
(``uq_decode_wholepage``), :func:`flydsl_estimate` for the CDNA decodes (FlyDSL, and the split-KV
Triton kernel's HSACO). Every figure below names its source; those marked ASSUMED are not published and are
what the calibration on the H200 tests (``benchmarks/results/isa_cost_calibration_h200.json``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------------------------------
# Machines


@dataclass(frozen=True)
class Machine:
    """Published figures of one GPU (sources in ``sources``)."""

    name: str
    arch: str
    units: int
    """SMs (NVIDIA) or CUs (AMD)."""
    schedulers_per_unit: int
    """SMSPs per SM (4) or SIMDs per CU (4)."""
    clock_ghz: float
    """Peak clock, ASSUMED sustained (the H200 held 1980 MHz through the calibration run; an MI300X
    may clock lower under load, which would lower the issue-bound estimates in proportion)."""
    hbm_tbs: float
    lds_bytes: int
    """Shared memory / LDS per SM or CU."""
    regs_per_scheduler: int
    """32-bit registers of one scheduler (sm_90: 65536 per SM / 4) or VGPRs per SIMD lane (CDNA: 512)."""
    max_waves_per_scheduler: int
    wave: int
    """Threads per warp (32) or wave (64)."""
    dram_latency_ns: float
    """ASSUMED loaded DRAM latency for Little's law (not published by either vendor)."""
    sources: tuple[str, ...] = ()


H200 = Machine(
    "H200", "sm_90", 132, 4, 1.98, 4.8, 228 * 1024, 16384, 16, 32, 1000.0,
    ("132 SMs, 4 SM sub-partitions (one warp scheduler, 1 warp instruction/clock each), 228 KB shared "
     "memory per SM, 64K 32-bit registers per SM: NVIDIA H100 Tensor Core GPU Architecture white paper "
     "(2022), 'H100 SM architecture'; H200 is the same GH100 with HBM3e",
     "1980 MHz max SM clock: nvidia-smi -q -d CLOCK on the H200 (recorded in the calibration run)",
     "4.8 TB/s HBM3e: NVIDIA H200 product page / datasheet"))

MI300X = Machine(
    "MI300X", "gfx942", 304, 4, 2.1, 5.3, 64 * 1024, 512, 8, 64, 1000.0,
    ("304 CUs, 64 KiB LDS, 512 KiB VGPR file per CU (512 VGPRs per SIMD lane), wave64: ROCm 'AMD GPU "
     "specifications' table (rocm.docs.amd.com/en/latest/reference/gpu-specs.html)",
     "2100 MHz peak engine clock, 5.3 TB/s HBM3: AMD CDNA 3 architecture white paper and the AMD "
     "Instinct MI300X data sheet (consistent: 163.4 TFLOPS FP32 vector = 304 CUs x 256 FLOP/clk x 2.1 GHz)",
     "at most 8 waves per SIMD; by registers 512 / (VGPRs rounded up to 8): AMD CDNA3 ISA guide"))

MI355X = Machine(
    "MI355X", "gfx950", 256, 4, 2.4, 8.0, 160 * 1024, 512, 8, 64, 1000.0,
    ("256 CUs, 160 KiB LDS, 512 KiB VGPR file per CU: ROCm 'AMD GPU specifications' table",
     "2400 MHz peak engine clock, 8 TB/s HBM3E: AMD CDNA 4 architecture white paper "
     "(amd.com/.../amd-cdna-4-architecture-whitepaper.pdf) and the MI355X data sheet"))

MACHINES = {"sm_90": H200, "gfx942": MI300X, "gfx950": MI355X}


# --------------------------------------------------------------------------------------------------
# Instructions


@dataclass
class Op:
    """One instruction as the simulator sees it."""

    addr: int
    opcode: str
    text: str
    cls: str
    """Census class: alu, fma, fp16, xu, mma, lds, sts, global, cpasync, shfl, uniform, branch, barrier,
    wait, misc (sm_90); valu, salu, mfma, lds, vmem, smem, waitcnt, branch, barrier, misc (CDNA)."""
    pipe: str
    occupancy: int
    """Cycles the pipe stays busy (the scheduler cannot issue another op to it)."""
    stall: int = 1
    """Cycles before the same warp may issue its next instruction."""
    sets: int | None = None
    """sm_90: write scoreboard index (0-5) released after ``latency``; CDNA: the counter (``vm``/``lgkm``)."""
    latency: int = 0
    waits: tuple[int, ...] = ()
    """sm_90: scoreboard indices waited for; CDNA: empty (see ``waitcnt``)."""
    waitcnt: dict[str, int] = field(default_factory=dict)
    """CDNA ``s_waitcnt``: counter -> how many may stay outstanding."""
    target: int | None = None
    """Branch target address (backward branches close loops)."""
    sync: bool = False
    """A barrier across the program's warps (BAR.SYNC, s_barrier)."""
    async_mem: bool = False
    """cp.async / buffer load into LDS: completion waited by DEPBAR, whose cost Little's law accounts."""


# sm_90 pipes: (pipe, occupancy cycles per warp instruction on one SMSP).
# Source: CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table, compute capability 9.0
# (results per clock per SM: FP32 add/mul/fma 128, FP16x2 256 (=128 instr-lanes), 32-bit integer
# add/logic/shift/compare 64, conversions 16, MUFU 16, warp shuffle 32); per SMSP divide by 4 and by
# the 32 lanes of a warp: 128 -> 1 cycle, 64 -> 2 cycles, 16 -> 8 cycles.
# Shared memory: 128 bytes per clock per SM (H100 white paper), i.e. an LDS.32 of a warp (128 B) takes
# the SM's MIO for 1 cycle = 4 SMSP-cycles when all four SMSPs load; LDS.64 twice, LDS.128 four times.
# HMMA.16816 (mma.sync m16n8k16, 4096 FLOP): ASSUMED 8 cycles per SMSP = half the dense FP16 tensor rate
# of the white paper (989 TFLOPS at 132 SMs x 1.98 GHz = 512 FMA/clk/SMSP -> 4 cycles); Luo et al.,
# "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture" (arXiv:2402.13499) measure
# mma.sync on Hopper at about 60% of wgmma's rate.
SM90_ALU = ("LOP3", "LOP", "SHF", "SHL", "SHR", "IADD3", "ISETP", "FSETP", "HSETP2", "PRMT", "SEL", "FSEL",
            "IMNMX", "VIMNMX", "FMNMX", "BMSK", "LEA", "MOV", "P2R", "R2P", "PLOP3", "VIADD", "IABS", "FLO",
            "POPC", "BREV", "CS2R", "SGXT", "F2FP", "IADD", "VIADDMNMX", "MOV32I", "FCHK", "HMNMX2")
SM90_FMA = ("FFMA", "FMUL", "FADD", "FFMA32I", "FMUL32I", "FADD32I", "FSWZADD", "I2FP")
SM90_FMAHEAVY = ("IMAD", "IMUL", "IMAD32I", "IDP", "IMNMX.U32")
SM90_FP16 = ("HFMA2", "HMUL2", "HADD2", "HFMA2.MMA")
SM90_XU = ("MUFU", "F2I", "I2F", "F2F", "FRND")
SM90_LDS_WIDTH = {"": 1, ".U8": 1, ".S8": 1, ".U16": 1, ".S16": 1, ".64": 2, ".128": 4}

SM90_LATENCY = {"lds": 30, "ldsm": 33, "shfl": 28, "xu": 20, "global": 600, "l1": 40, "s2r": 25, "ldc": 30,
                "sts": 12, "misc": 20, "mma": 33}
"""Cycles until a variable-latency result's scoreboard is released. LDS ~30 / LDSM ~33 / shuffle ~28:
Luo et al. (arXiv:2402.13499) shared-memory latency on Hopper ~29-33 cycles; MUFU ~20 and S2R ~25:
Jia et al. (Volta/Turing measurements, ASSUMED unchanged); global 600 cycles ~ 300 ns unloaded DRAM
latency (ASSUMED) for the prologue's first touches; ``l1`` 40 cycles (Luo et al.: Hopper L1 hit ~33-40)
for global loads inside a hot loop, which read small tables (block ids) that the program's earlier
iterations and other warps already brought into L1 (:func:`profile_sass`). The ring's bulk copies
(cp.async) are waited by DEPBAR, whose cost Little's law accounts for."""


def _sm90_pipe(op: str, text: str) -> tuple[str, str, int]:
    """(census class, pipe, occupancy cycles) of one sm_90 opcode (``op`` with its modifiers)."""
    base = op.split(".")[0]
    if base.startswith("U"):
        return "uniform", "uniform", 1
    if base in ("HMMA", "IMMA", "DMMA", "HGMMA"):
        return "mma", "tensor", 8 if ".16816" in op else 4
    if base in SM90_FP16:
        return "fp16", "fma", 1
    if base in SM90_FMA:
        return "fma", "fma", 1
    if base in SM90_FMAHEAVY or op.startswith("IMAD"):
        return "fma", "fmaheavy", 2
    if base in SM90_XU:
        return "xu", "xu", 8
    if base in ("LDS", "LDSM"):
        width = 4 if base == "LDSM" and ".x4" in op.lower() else 2 if base == "LDSM" and ".x2" in op.lower() else 1
        if base == "LDS":
            width = SM90_LDS_WIDTH.get(op[3:].split(".U.")[0] if op[3:] else "", 1)
            for suffix, w in SM90_LDS_WIDTH.items():
                if suffix and op.endswith(suffix):
                    width = w
        return ("ldsm" if base == "LDSM" else "lds"), "mio", 4 * width
    if base in ("STS",):
        width = next((w for s, w in SM90_LDS_WIDTH.items() if s and op.endswith(s)), 1)
        return "sts", "mio", 4 * width
    if base == "SHFL":
        return "shfl", "mio", 4
    if base == "LDGSTS":
        return "cpasync", "lsu", 4
    if base in ("LDG", "STG", "LD", "ST", "ATOMG", "ATOM", "RED", "LDL", "STL", "ATOMS"):
        return "global", "lsu", 4
    if base in ("BAR", "DEPBAR", "LDGDEPBAR", "MEMBAR", "WARPSYNC", "ERRBAR", "CCTL", "FENCE"):
        return ("barrier" if base in ("BAR",) else "wait"), "cbu", 1
    if base in ("BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "BREAK", "JMP", "YIELD", "NOP", "WARPSYNC", "BPT"):
        return "branch", "cbu", 1
    if base in ("S2R", "S2UR", "CS2R", "LDC", "ULDC"):
        return "misc", "mio", 1
    if base in SM90_ALU:
        return "alu", "alu", 2
    return "misc", "alu", 2


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\*\s*0x([0-9a-f]{16})\s*\*/")
_SASS_CTRL = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")


def parse_sass(text: str, function: str | None = None) -> list[Op]:
    """:class:`Op` list of one function of ``cuobjdump -sass`` text (the first, or ``function``).

    The control word is the second 64-bit half of each instruction: bits 41-44 stall cycles, 46-48
    write scoreboard (7 = none), 49-51 read scoreboard, 52-57 wait mask (Jia et al. 2018)."""
    ops: list[Op] = []
    lines = text.splitlines()
    current = None
    pending: tuple[int, str] | None = None
    for line in lines:
        head = re.search(r"Function\s*:\s*(\S+)", line)
        if head:
            if current is not None and ops and (function is None or current == function):
                break
            current = head.group(1)
            ops = [] if function is None or current == function else ops
            continue
        if function is not None and current != function:
            continue
        m = _SASS_LINE.search(line)
        if m:
            pending = (int(m.group(1), 16), m.group(2).strip())
            continue
        c = _SASS_CTRL.match(line)
        if c and pending is not None:
            addr, ins = pending
            pending = None
            ctrl = int(c.group(1), 16) >> 41
            stall, wrbar, _rdbar, wait = ctrl & 0xF, (ctrl >> 5) & 7, (ctrl >> 8) & 7, (ctrl >> 11) & 0x3F
            body = re.sub(r"^@!?U?P[T0-9]+\s+", "", ins)
            opcode = body.split()[0]
            cls, pipe, occ = _sm90_pipe(opcode, body)
            target = None
            if opcode.split(".")[0] == "BRA":
                t = re.search(r"0x([0-9a-f]+)", body)
                target = int(t.group(1), 16) if t else None
            lat_key = {"lds": "lds", "ldsm": "ldsm", "shfl": "shfl", "xu": "xu", "global": "global",
                       "mma": "mma", "sts": "sts"}.get(cls, "misc")
            if opcode.startswith("S2R") or opcode.startswith("S2UR"):
                lat_key = "s2r"
            if opcode.startswith("LDC"):
                lat_key = "ldc"
            ops.append(Op(addr, opcode, body, cls, pipe, occ, stall=max(1, stall),
                          sets=None if wrbar == 7 else wrbar, latency=SM90_LATENCY[lat_key],
                          waits=tuple(i for i in range(6) if wait >> i & 1), target=target,
                          sync=opcode.startswith("BAR.SYNC") or opcode == "BAR",
                          async_mem=opcode.startswith("LDGSTS")))
    return ops


# CDNA pipes: VALU of wave64 on a 16-lane SIMD: 4 cycles per instruction (AMD CDNA3 ISA guide, section
# 1 "Terminology"/"the SIMD ... processes a wavefront in 4 cycles"); MFMA occupancy = passes x 4 cycles
# (v_mfma_f32_16x16x16_bf16: 8 passes on CDNA3 = 32 cycles? The Matrix Instruction Calculator gives
# 16x16x16 bf16 "8 passes"; the ROCm matrix-cores blog gives 16 cycles for CDNA3 16x16x16: we use the
# calculator's passes x 4 / 2 (two MFMA units' worth of the dense rate) = 16 cycles, as
# the earlier roofline tool did; scaled 16x16x128 f8f6f4 on CDNA4: 32 cycles (same sources)).
# Scalar, LDS, vector memory and branch instructions go to their own units (one issue each per cycle
# from different waves: the CU's instruction arbiter, CDNA3 ISA guide section 2).
CDNA_MFMA_CYCLES = {"v_mfma_f32_16x16x16_bf16": 16, "v_mfma_f32_16x16x16bf16_1k": 16,
                    "v_mfma_f32_16x16x32_bf16": 16, "v_mfma_f32_16x16x32_fp8_fp8": 16,
                    "v_mfma_f32_16x16x32_bf8_bf8": 16, "v_mfma_scale_f32_16x16x128_f8f6f4": 32,
                    "v_mfma_f32_16x16x128_f8f6f4": 32, "v_mfma_f32_32x32x8_bf16": 32}
CDNA_LATENCY = {"lds": 64, "smem": 40, "vmem": 1000, "table": 300}
"""Cycles until an LDS (~64: AMD LDS latency, ASSUMED from public microbenchmarks of CDNA), scalar
(~40, ASSUMED) or vector memory result returns. ``vmem`` is replaced by the estimate's loaded HBM
latency (:func:`flydsl_estimate`); ``table`` (ASSUMED 300 cycles, a vector L1/L2 hit) is for a loop's
index loads: a vector load the loop waits for (``vmcnt(0)``) before it issues any other, i.e. the
block-table entry whose value addresses the tile (16 entries share 64 bytes: after the first tile a
cache hit). The H200 model treats the same loads the same way (its ``l1`` latency)."""


def _cdna_op(addr: int, mnem: str, ops: str, target: int | None) -> Op:
    if mnem.startswith("v_mfma"):
        return Op(addr, mnem, ops, "mfma", "xdl", CDNA_MFMA_CYCLES.get(mnem, 16), stall=4)
    if mnem.startswith(("global_load", "buffer_load", "flat_load")):
        return Op(addr, mnem, ops, "vmem", "vmem", 4, stall=4, sets="vm", latency=CDNA_LATENCY["vmem"],
                  async_mem=" lds" in ops or mnem.endswith("_lds"))
    if mnem.startswith(("global_store", "buffer_store", "flat_store", "global_atomic", "buffer_atomic")):
        return Op(addr, mnem, ops, "vmem", "vmem", 4, stall=4, sets="vm", latency=CDNA_LATENCY["vmem"])
    if mnem.startswith("ds_"):
        return Op(addr, mnem, ops, "lds", "lds", 4 if "b128" not in mnem and "b96" not in mnem else 8, stall=4,
                  sets="lgkm", latency=CDNA_LATENCY["lds"])
    if mnem.startswith(("s_load", "s_buffer_load")):
        return Op(addr, mnem, ops, "smem", "salu", 1, stall=1, sets="lgkm", latency=CDNA_LATENCY["smem"])
    if mnem == "s_waitcnt":
        cnt = {k: int(v) for k, v in re.findall(r"(vmcnt|lgkmcnt)\((\d+)\)", ops)}
        return Op(addr, mnem, ops, "waitcnt", "salu", 1, stall=1,
                  waitcnt={k.replace("cnt", ""): v for k, v in cnt.items()})
    if mnem == "s_barrier":
        return Op(addr, mnem, ops, "barrier", "salu", 1, stall=1, sync=True)
    if mnem == "s_nop":
        n = int(ops.split()[0], 0) if ops.split() else 0
        return Op(addr, mnem, ops, "misc", "salu", 1, stall=n + 1)
    if mnem.startswith("s_cbranch") or mnem.startswith("s_branch"):
        return Op(addr, mnem, ops, "branch", "branch", 1, stall=1, target=target)
    if mnem.startswith("s_"):
        return Op(addr, mnem, ops, "salu", "salu", 1, stall=1)
    if mnem.startswith("v_"):
        # v_pk_* / 64-bit ops on CDNA3 run at the same 4-cycle wave64 cadence (packed FP32 is one pass)
        return Op(addr, mnem, ops, "valu", "valu", 4, stall=4)
    return Op(addr, mnem, ops, "misc", "salu", 1, stall=1)


_AMD_LINE = re.compile(r"^\s+(\S+)\s*(.*?)\s*//\s*([0-9A-Fa-f]+):.*?(?:<\w+\+0x([0-9a-f]+)>)?\s*$")


def parse_amdgpu(text: str) -> list[Op]:
    """:class:`Op` list of ``llvm-objdump -d`` text of a HSACO (every function, in address order)."""
    out = []
    base = None
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+) <\w+>:", line)
        if head:
            base = int(head.group(1), 16)
            continue
        m = _AMD_LINE.match(line)
        if m and base is not None:
            target = base + int(m.group(4), 16) if m.group(4) else None
            out.append(_cdna_op(int(m.group(3), 16), m.group(1), m.group(2), target))
    return out


# --------------------------------------------------------------------------------------------------
# Loops and census


def loops(ops: list[Op]) -> list[tuple[int, int]]:
    """(start, end) address ranges closed by a backward branch."""
    return [(o.target, o.addr) for o in ops if o.target is not None and o.target < o.addr]


def hot_loop(ops: list[Op]) -> list[Op]:
    """The body of the loop with the most matrix instructions (ties: the innermost, i.e. smallest)."""
    best: list[Op] = []
    best_key = (-1, 0)
    for start, end in loops(ops):
        body = [o for o in ops if start <= o.addr <= end]
        key = (sum(o.cls in ("mma", "mfma") for o in body), -len(body))
        if key > best_key:
            best, best_key = body, key
    return best


def census(body: list[Op], token_heads: float = 1.0) -> dict[str, Any]:
    """Instructions of ``body`` by class, and per token-head (``token_heads`` = what one iteration does)."""
    by_cls = Counter(o.cls for o in body)
    return {"instructions": len(body), "per_token_head": round(len(body) / token_heads, 2),
            "classes": dict(sorted(by_cls.items(), key=lambda kv: -kv[1])),
            "classes_per_token_head": {k: round(v / token_heads, 2) for k, v in by_cls.items()}}


# --------------------------------------------------------------------------------------------------
# Simulation of one scheduler


@dataclass
class _Warp:
    pc: int = 0
    ready: int = 0
    done_iters: int = 0
    board: dict[Any, list[int]] = field(default_factory=dict)
    at_barrier: bool = False


def simulate(body: list[Op], warps: int, iterations: int = 4, issue_per_cycle: int = 1,
             multi_issue: bool = False, barrier_cycles: int = 20) -> dict[str, float]:
    """Cycles of ``iterations`` passes of ``body`` by ``warps`` warps on one scheduler.

    In-order per warp: an op issues when its warp's previous stall has elapsed, the scoreboards or
    counters it waits for are released and its pipe is free; the scheduler issues at most
    ``issue_per_cycle`` ops per cycle (sm_90: 1), or with ``multi_issue`` one per pipe per cycle from
    different waves (CDNA's arbiter). The oldest ready warp goes first. A barrier op holds a warp
    until every warp reached it (the other schedulers run the same code: they arrive alike).
    Returns the cycles per iteration in steady state (the last iterations) and the issue rate."""
    ws = [_Warp() for _ in range(warps)]
    pipe_free: dict[str, int] = {}
    n = len(body)
    t = 0
    issued = 0
    finish_times: list[list[int]] = [[] for _ in range(warps)]
    limit = (n * iterations * warps) * 64 + 10**6
    while any(w.done_iters < iterations for w in ws) and t < limit:
        slots = issue_per_cycle
        used_pipes: set[str] = set()
        order = sorted(range(warps), key=lambda i: ws[i].ready)
        for i in order:
            w = ws[i]
            if w.done_iters >= iterations or w.ready > t or w.at_barrier:
                continue
            op = body[w.pc]
            if any(max(w.board.get(b, [0]), default=0) > t for b in op.waits):
                continue
            if op.waitcnt:
                blocked = False
                for cnt, keep in op.waitcnt.items():
                    pending = sorted(x for x in w.board.get(cnt, []) if x > t)
                    if len(pending) > keep:
                        blocked = True
                if blocked:
                    continue
            if pipe_free.get(op.pipe, 0) > t or (multi_issue and op.pipe in used_pipes):
                continue
            if not multi_issue and slots <= 0:
                break
            # issue
            slots -= 1
            used_pipes.add(op.pipe)
            issued += 1
            pipe_free[op.pipe] = t + op.occupancy
            if op.sets is not None and op.latency:
                lst = w.board.setdefault(op.sets, [])
                lst.append(t + op.latency)
                if len(lst) > 64:
                    del lst[: len(lst) - 64]
            w.ready = t + op.stall
            if op.sync:
                w.at_barrier = True
            w.pc += 1
            if w.pc == n:
                w.pc = 0
                w.done_iters += 1
                finish_times[i].append(t)
        if all(w.at_barrier or w.done_iters >= iterations for w in ws) and any(w.at_barrier for w in ws):
            for w in ws:
                if w.at_barrier:
                    w.at_barrier = False
                    w.ready = max(w.ready, t + barrier_cycles)
        t += 1
    steady = [f[-1] - f[-2] for f in finish_times if len(f) >= 2]
    per_iter = sum(steady) / len(steady) if steady else float(t)
    return {"cycles_per_iteration": per_iter, "total_cycles": t,
            "issue_per_cycle": issued / t if t else 0.0,
            "instructions_per_iteration": n}


def occupancy_nvidia(registers: int, shared_bytes: int, threads: int, machine: Machine = H200) -> int:
    """Resident programs per SM by registers (per thread, rounded up to 8, 256-register warps
    granules) and shared memory (H100 white paper: 64K registers, 228 KB shared, 64 warps per SM)."""
    regs = ((max(registers, 1) + 7) // 8) * 8
    by_regs = 65536 // (regs * threads) if regs * threads else 32
    by_smem = (machine.lds_bytes - 1024 * 0) // shared_bytes if shared_bytes else 32
    by_warps = 64 // max(1, threads // 32)
    return max(0, min(by_regs, by_smem, by_warps, 32))


# --------------------------------------------------------------------------------------------------
# Launch composition: the whole-page decode on sm_90


def _schedule(programs: list[float], slots: int) -> float:
    """Makespan of programs (durations, launch order) on ``slots`` identical slots, each program
    taking the first free slot (the CTA scheduler's greedy order)."""
    heap = [0.0] * slots
    heapq.heapify(heap)
    end = 0.0
    for d in programs:
        start = heapq.heappop(heap)
        heapq.heappush(heap, start + d)
        end = max(end, start + d)
    return end


@dataclass(frozen=True)
class KernelProfile:
    """What the model needs from one blob: the loop, the code around it, resources."""

    loop: list[Op]
    prologue: list[Op]
    epilogue: list[Op]
    registers: int
    shared: int
    threads: int


def profile_sass(ops: list[Op], registers: int, shared: int, threads: int) -> KernelProfile:
    """Split a kernel's ops into its hot loop and the code before / after it."""
    body = hot_loop(ops)
    if not body:
        return KernelProfile([], ops, [], registers, shared, threads)
    start, end = body[0].addr, body[-1].addr
    body = [dataclasses.replace(o, latency=SM90_LATENCY["l1"]) if o.cls == "global" and o.sets is not None else o
            for o in body]
    return KernelProfile(body, [o for o in ops if o.addr < start], [o for o in ops if o.addr > end],
                         registers, shared, threads)


def straight_cycles(ops: list[Op], warps: int) -> float:
    """Cycles of one pass over straight-line code (branches not taken) by ``warps`` warps of one
    scheduler: the prologue/epilogue cost of a program."""
    if not ops:
        return 0.0
    plain = [Op(o.addr, o.opcode, o.text, o.cls, o.pipe, o.occupancy, o.stall, o.sets, o.latency, o.waits,
                o.waitcnt, None, o.sync, o.async_mem) for o in ops]
    return simulate(plain, warps, iterations=1)["total_cycles"]


LAUNCH_US = 2.0
"""ASSUMED fixed cost of one kernel in a CUDA-graph replay (launch, drain, tail): ~2 us."""


def wholepage_time_us(prof: KernelProfile, constexprs: dict[str, Any], seq_lens: list[int], splits: int,
                      machine: Machine = H200, slot_bytes: int = 136) -> dict[str, Any]:
    """Estimated time of the whole-page decode (``uq_decode_wholepage``) for one batch: grid ``(B, 1, splits)``, 8 warps
    per program = (kv head, WT token groups), each loop iteration handles NSUB x TW tokens of one
    kv head per warp; a split gets ``ceil(ceil(len / splits) / 16) * 16`` tokens (the kernel's split
    rule, per request)."""
    c = constexprs
    warps = prof.threads // 32
    warps_per_sched = max(1, warps // machine.schedulers_per_unit)
    sim = simulate(prof.loop, warps_per_sched, iterations=4)
    per_iter = sim["cycles_per_iteration"]
    tokens_per_iter = c["NSUB"] * c["TW"]  # per warp
    wt = c["WT"]
    pro = straight_cycles(prof.prologue, warps_per_sched)
    epi = straight_cycles(prof.epilogue, warps_per_sched)
    progs_per_sm = max(1, occupancy_nvidia(prof.registers, prof.shared, prof.threads, machine))
    durations = []
    hk = c["HK"]
    total_bytes = 0
    for n in seq_lens:
        per = math.ceil(math.ceil(n / splits) / 16) * 16
        for s in range(splits):
            toks = max(0, min(per, n - s * per))
            iters = math.ceil(toks / (tokens_per_iter * wt)) if toks else 0
            cycles = pro + iters * per_iter + (epi if toks else epi * 0.25)
            durations.append(cycles / (machine.clock_ghz * 1e3))
            total_bytes += toks * hk * slot_bytes
    issue_us = _schedule(durations, machine.units * progs_per_sm)
    # memory: the ring holds STAGES stages, one being consumed; bytes in flight per SM vs latency
    stage_bytes = warps * tokens_per_iter * slot_bytes * progs_per_sm
    inflight = stage_bytes * max(1, c["STAGES"] - 1)
    little_tbs = inflight * machine.units / (machine.dram_latency_ns * 1e-9) / 1e12
    mem_tbs = min(machine.hbm_tbs, little_tbs)
    mem_us = total_bytes / (mem_tbs * 1e12) * 1e6
    est = max(issue_us, mem_us) + LAUNCH_US
    return {"estimate_us": est, "issue_us": issue_us, "memory_us": mem_us,
            "bound": "issue" if issue_us >= mem_us else "memory",
            "cycles_per_iteration": per_iter, "loop_instructions": len(prof.loop),
            "issue_per_cycle_per_scheduler": sim["issue_per_cycle"],
            "warps_per_scheduler": warps_per_sched, "programs_per_sm": progs_per_sm,
            "prologue_cycles": pro, "epilogue_cycles": epi, "tokens_per_iteration_per_warp": tokens_per_iter,
            "bytes": total_bytes, "little_tbs": little_tbs, "programs": len(durations)}


# --------------------------------------------------------------------------------------------------
# Launch composition: the FlyDSL decode on CDNA


def cdna_waves_per_simd(vgpr: int, agpr: int = 0, lds_bytes: int = 0, waves_per_block: int = 1,
                        machine: Machine = MI300X) -> int:
    """Resident waves per SIMD: registers (unified VGPR+AGPR file of 512 per lane, granules of 8, at most
    8 waves: AMD CDNA3 ISA guide) and LDS (blocks per CU by LDS x waves per block / 4 SIMDs)."""
    total = -(-max(8, vgpr, agpr) // 8) * 8
    by_regs = min(machine.max_waves_per_scheduler, machine.regs_per_scheduler // total)
    if lds_bytes:
        blocks = machine.lds_bytes // lds_bytes
        by_lds = max(1, blocks * waves_per_block // machine.schedulers_per_unit)
        return max(1, min(by_regs, by_lds))
    return max(1, by_regs)


def flydsl_estimate(ops: list[Op], machine: Machine, head_size: int, vgpr: int, agpr: int, lds_bytes: int,
                    waves_per_block: int, latency_ns: float | None = None, tile_tokens: int = 16) -> dict[str, Any]:
    """Bandwidth estimate of the FlyDSL decode (one wave = one split of one (request, kv head), one loop
    iteration = ``tile_tokens`` tokens): the hot loop simulated on one SIMD with its resident waves
    (vector memory results after ``latency_ns``), the grid assumed large enough to fill every SIMD.
    TB/s counts the cache bytes read (``tile_tokens`` slots of K and V per iteration per wave)."""
    from ultraquant.format import slot_size

    lat_ns = machine.dram_latency_ns if latency_ns is None else latency_ns
    lat = int(lat_ns * machine.clock_ghz)
    body = [dataclasses.replace(o, latency=lat) if o.sets == "vm" else o for o in hot_loop(ops)]
    for i, o in enumerate(body):  # index loads (see CDNA_LATENCY["table"])
        if o.sets != "vm":
            continue
        for nxt in body[i + 1:]:
            if nxt.sets == "vm":
                break
            if nxt.waitcnt.get("vm") == 0:
                body[i] = dataclasses.replace(o, latency=CDNA_LATENCY["table"])
                break
    waves = cdna_waves_per_simd(vgpr, agpr, lds_bytes, waves_per_block, machine)
    sim = simulate(body, waves, iterations=6, multi_issue=True)
    single = simulate(body, 1, iterations=4, multi_issue=True)
    cyc = sim["cycles_per_iteration"]  # one iteration of every resident wave
    tile_bytes = tile_tokens * slot_size(head_size)
    per_simd_gbs = waves * tile_bytes / (cyc / machine.clock_ghz)  # bytes per ns = GB/s
    kernel_tbs = per_simd_gbs * machine.schedulers_per_unit * machine.units / 1000.0
    busy = Counter()
    for o in body:
        busy[o.pipe] += o.occupancy
    vm_bytes = sum(_cdna_load_bytes(o.opcode) for o in body if o.sets == "vm") * machine.wave
    inflight_cu = vm_bytes * waves * machine.schedulers_per_unit
    little_tbs = inflight_cu * machine.units / (lat_ns * 1e-9) / 1e12
    est = min(kernel_tbs, machine.hbm_tbs)
    issue_only = max(busy.values(), default=0) * waves
    bound = "memory" if est == machine.hbm_tbs else ("issue" if cyc <= 1.15 * issue_only else "latency")
    return {"census": census(body, tile_tokens), "waves_per_simd": waves, "cycles_per_tile": cyc / 1.0,
            "cycles_per_tile_one_wave": single["cycles_per_iteration"], "pipe_cycles_per_tile": dict(busy),
            "issue_bound_cycles_all_waves": issue_only, "tile_bytes": tile_bytes, "latency_ns": lat_ns,
            "bytes_in_flight_per_cu_max": inflight_cu, "little_tbs": little_tbs,
            "kernel_tbs": kernel_tbs, "estimate_tbs": est, "fraction_of_spec": est / machine.hbm_tbs,
            "bound": bound}


def _cdna_load_bytes(mnem: str) -> int:
    """Bytes per lane of one CDNA vector load (``global_load_dwordx4`` -> 16)."""
    width = {"ubyte": 1, "sbyte": 1, "ushort": 2, "short": 2, "dword": 4, "dwordx2": 8, "dwordx3": 12,
             "dwordx4": 16, "b32": 4, "b64": 8, "b96": 12, "b128": 16, "u8": 1, "u16": 2}
    if "_load_" not in mnem:
        return 0
    return width.get(mnem.split("_load_")[1].split("_")[0], 4)


def drop_valu(ops: list[Op], keep: int) -> list[Op]:
    """What-if: the hot loop of ``ops`` with its VALU instructions thinned evenly to ``keep`` (every other
    instruction, the waits and the memory operations unchanged); the rest of the kernel is dropped.
    Used to ask how many VALU per tile a target bandwidth allows, not to predict a kernel."""
    body = hot_loop(ops)
    valu = [i for i, o in enumerate(body) if o.cls == "valu"]
    if keep >= len(valu):
        return body
    chosen = {valu[int(k * len(valu) / keep)] for k in range(keep)} if keep > 0 else set()
    out = [o for i, o in enumerate(body) if o.cls != "valu" or i in chosen]
    # keep the loop closed: hot_loop() looks for the backward branch again
    return out


def valu_budget(ops: list[Op], machine: Machine, head_size: int, vgpr: int, agpr: int, lds_bytes: int,
                waves_per_block: int, target_tbs: float, latency_ns: float | None = None,
                waves: int | None = None) -> int | None:
    """The largest VALU count per tile (same loop otherwise, :func:`drop_valu`) whose estimate reaches
    ``target_tbs``; None when even zero VALU does not (latency or memory bound first). ``waves``
    overrides the resident waves (what fewer registers would allow)."""
    n = sum(o.cls == "valu" for o in hot_loop(ops))
    regs = vgpr if waves is None else machine.regs_per_scheduler // max(1, waves)

    def tbs(keep: int) -> float:
        return flydsl_estimate(drop_valu(ops, keep), machine, head_size, regs, 0 if waves else agpr,
                               0 if waves else lds_bytes, waves_per_block, latency_ns)["estimate_tbs"]

    if tbs(0) < target_tbs:
        return None
    lo, hi = 0, n
    if tbs(n) >= target_tbs:
        return n
    while hi - lo > 4:
        mid = (lo + hi) // 2
        if tbs(mid) >= target_tbs:
            lo = mid
        else:
            hi = mid
    return lo
