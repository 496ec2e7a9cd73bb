"""Small store/dequant/decode/prefill runs for compute-sanitizer (memcheck/racecheck) on a GPU.

Ragged lengths sit at block and split boundaries; decode runs with 1 and several splits; every
result is also checked against the reference so a silent wrong answer fails here too.
``--bounds``: garbage slot_mapping / block_table / seq_lens instead (tests/bounds_cases.py: negative,
past the end, 2**31-1, -2**31) with value checks off; guards, untouched bytes, outputs over the
surviving tokens and the error bits checked.

Usage: compute-sanitizer --tool memcheck python3 tests/gpu/sanitize.py [--bounds]
One command for both workloads under memcheck, logs to $OUT (or --out), a one-line verdict:
    python3 tests/gpu/sanitize.py --memcheck [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ultraquant as uq  # noqa: E402
from tests import bounds_cases  # noqa: E402
from tests.helpers import make_paged  # noqa: E402
from ultraquant import config as uq_config  # noqa: E402
from ultraquant import reference as R  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def workload() -> int:
    """The valid-input workload (exit status 0 when every result matches the reference)."""
    worst = 0.0
    d, hk, hq, bs = 128, 2, 8, 16
    lens = [1, 15, 16, 17, 31, 32, 33, 257]
    prob = make_paged(lens, hk, d, bs, seed=1, dtype=torch.bfloat16, device="cuda", head_major=True,
                      store=uq.store_kv)
    query = torch.randn(len(lens), hq, d, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(hq, device="cuda")
    for splits in ("1", "3", "8"):
        os.environ["ULTRAQUANT_DECODE_SPLITS"] = splits
        uq_config.reload()
        for window, softcap in ((None, None), (20, 30.0)):
            out = torch.full_like(query, float("nan"))
            uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.1, sinks=sinks,
                                sliding_window=window, softcap=softcap, out=out)
            ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 0.1,
                                     sinks=sinks, sliding_window=window, softcap=softcap)
            worst = max(worst, rel(out, ref))
    os.environ.pop("ULTRAQUANT_DECODE_SPLITS")
    uq_config.reload()
    k, v = uq.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    rk, rv = R.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    worst = max(worst, max(rel(a, b) for a, b in zip(k + v, rk + rv, strict=True) if b.numel()))
    # prefill: continuation chunks ending at block boundaries
    q_lens = [1, 5, 16, 17, 1, 32, 33, 40]
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    n = int(qsl[-1])
    qp = torch.randn(n, hq, d, device="cuda").to(torch.bfloat16)
    kp = torch.randn(n, hk, d, device="cuda").to(torch.bfloat16)
    vp = torch.randn(n, hk, d, device="cuda").to(torch.bfloat16)
    qsl = qsl.cuda()
    out = torch.full_like(qp, float("nan"))
    uq.prefill_attention(qp, kp, vp, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1, sinks=sinks,
                         out=out)
    ref = R.prefill_attention(qp.float(), kp, vp, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1,
                              sinks=sinks)
    worst = max(worst, rel(out, ref))
    # store, many-rows layout (one row per thread): 17600 rows > 128 per SM on 132 SMs; one skipped slot
    n, hk2 = 2200, 8
    key = torch.randn(n, hk2, d, device="cuda").to(torch.bfloat16)
    value = torch.randn(n, hk2, d, device="cuda").to(torch.bfloat16)
    nblk = n // bs + 2
    slots = torch.randperm(nblk * bs, device="cuda")[:n]
    slots[7] = -1
    got = torch.zeros(nblk, bs, hk2, uq.slot_size(d), dtype=torch.uint8, device="cuda")
    want = got.clone()
    uq.store_kv(key, value, got, slots)
    R.store_kv(key, value, want, slots)
    bad = int((got != want).sum())
    worst = max(worst, bad / got.numel())  # K near-ties differ in a few codes per million at most
    torch.cuda.synchronize()
    print(f"sanitize workload done: worst rel err {worst:.2e} (store bytes differing: {bad})")
    return 0 if worst < 1e-2 else 1


def bounds(seeds: int = 3) -> int:
    """The garbage-index workload: every case of tests/bounds_cases.py for ``seeds`` seeds."""
    os.environ.pop("ULTRAQUANT_CHECK_VALUES", None)
    uq_config.reload()
    failures = [f"seed {s}: {f}" for s in range(seeds) for f in bounds_cases.run_all("cuda", s)]
    for f in failures:
        print("FAILED", f)
    print(f"bounds workload done: {seeds} seeds, {len(failures)} failed checks")
    return 1 if failures else 0


def memcheck(out: str, limit_s: int = 270) -> int:
    """Both workloads under ``compute-sanitizer --tool memcheck`` (``limit_s`` each); logs in ``out``;
    one verdict line."""
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    os.makedirs(out, exist_ok=True)
    parts, ok = [], True
    for name, extra in (("valid", []), ("bounds", ["--bounds"])):
        log = os.path.join(out, f"memcheck_{name}.log")
        cmd = [tool, "--tool", "memcheck", "--print-limit", "20", sys.executable, os.path.abspath(__file__), *extra]
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s).returncode
            except subprocess.TimeoutExpired:
                rc = f"timeout {limit_s} s"
        text = open(log).read()
        m = re.search(r"ERROR SUMMARY: (\d+) error", text)
        errors = int(m.group(1)) if m else -1
        done = [line for line in text.splitlines() if line.endswith("failed checks") or "worst rel err" in line]
        ok &= rc == 0 and errors == 0
        parts.append(f"{name}: rc {rc}, {errors if errors >= 0 else 'no'} memcheck errors"
                     f"{' (' + done[-1] + ')' if done else ', workload did not finish'}")
    print(f"{'PASS' if ok else 'FAIL'} compute-sanitizer memcheck -- " + "; ".join(parts) + f" -- logs in {out}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounds", action="store_true", help="the garbage-index workload")
    ap.add_argument("--memcheck", action="store_true", help="run both workloads under memcheck (one verdict)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/uq_out"), help="log folder of --memcheck")
    ap.add_argument("--limit-s", type=int, default=270, help="seconds per workload under --memcheck")
    args = ap.parse_args()
    if args.memcheck:
        return memcheck(args.out, args.limit_s)
    return bounds() if args.bounds else workload()


if __name__ == "__main__":
    sys.exit(main())
