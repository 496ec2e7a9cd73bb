"""What the MFMA operand precision of the query (and of P) costs a decode, on the CPU (issue 26).

The cheaper CDNA decodes (``ultraquant/kernels/flydsl/fp4_bits.py``) feed the MFMA K operand in fp16
or FP8, exactly (FP4 codes are exact in both); what changes numerics is the *query* operand (bf16 now;
fp16, or FP8 per 32-element group with a power-of-two scale, one term or two) and P in PV (bf16 now,
fp16 with an fp16 V). This measures the decode output against float64 attention over the same
dequantized cache (so only the operand rounding shows), for queries and keys with heavy tails and
outlier channels, and writes the relative errors:

    python benchmarks/lab/query_precision.py --out benchmarks/results/query_precision.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ultraquant import reference as ref
from ultraquant.format import hadamard
from ultraquant.kernels.flydsl.layout import fp8_quantize_group, fp8_two_term


def _fnuz_group(x: torch.Tensor) -> torch.Tensor:
    """(..., 32) -> FP8 e4m3fnuz values x their power-of-two group scale (max 240 = 1.875 * 2**7)."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    e = torch.ceil(torch.log2(amax / 240.0))
    s = torch.exp2(e)
    return (x / s).to(torch.float8_e4m3fnuz).float() * s


def _groups(x: torch.Tensor, fn) -> torch.Tensor:
    sh = x.shape
    return fn(x.reshape(*sh[:-1], sh[-1] // 32, 32)).reshape(sh)


QUERY = {
    "bf16": lambda q: q.to(torch.bfloat16).float(),
    "fp16": lambda q: q.to(torch.float16).float(),
    "fp8_e4m3_1term": lambda q: _groups(q, lambda g: fp8_quantize_group(g)[0]
                                        * torch.exp2(fp8_quantize_group(g)[1].float())[..., None]),
    "fp8_e4m3fnuz_1term": lambda q: _groups(q, _fnuz_group),
    "fp8_e4m3_2term": lambda q: _groups(q, lambda g: sum(fp8_two_term(g))),
}
PROB = {"bf16": lambda p: p.to(torch.bfloat16).float(), "fp16": lambda p: p.to(torch.float16).float()}


def problem(seed: int, d: int = 128, gqa: int = 8, tokens: int = 2048, outliers: bool = True):
    """Query heads (gqa, d) and K/V (tokens, d): Student-t entries, a few outlier channels x20."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(4.0)
    torch.manual_seed(seed)
    q = t.sample((gqa, d)) * 2.0
    k = t.sample((tokens, d))
    v = torch.randn(tokens, d, generator=gen)
    if outliers:
        ch = torch.randperm(d, generator=gen)[:4]
        q[:, ch] *= 20.0
        k[:, ch] *= 20.0
    return q, k, v


def run(seeds: int = 8) -> dict:
    rows = {}
    for d in (128, 256):
        h = hadamard(d, dtype=torch.float64)
        for qv in QUERY:
            for pv in PROB:
                errs = []
                for s in range(seeds):
                    q, k, v = problem(s, d)
                    codes_k, sc_k = ref.quantize(k, rotate=True)
                    codes_v, sc_v = ref.quantize(v, rotate=False)
                    kr = ref.dequantize(codes_k, sc_k, rotate=False, dtype=torch.float64)  # rotated space
                    vv = ref.dequantize(codes_v, sc_v, rotate=False, dtype=torch.float64)
                    qr = (q.double() @ h)  # the kernel's rotated query, float64
                    scale = d ** -0.5
                    exact = torch.softmax(qr @ kr.T * scale, -1) @ vv
                    qx = QUERY[qv](qr.float()).double()
                    p = torch.softmax(qx @ kr.T * scale, -1)
                    got = PROB[pv](p.float()).double() @ vv
                    errs.append(((got - exact).norm() / exact.norm()).item())
                mean = sum(errs) / len(errs)
                rows[f"D{d}_q_{qv}_p_{pv}"] = {"mean_rel_error": mean, "max_rel_error": max(errs)}
                print(f"D={d} query {qv:20s} P {pv}: rel. error mean {mean:.2e} max {max(errs):.2e}", flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seeds", type=int, default=8)
    a = ap.parse_args()
    res = run(a.seeds)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"what": "decode output error vs float64 over the same dequantized cache; "
                                     "Student-t(4) entries, 4 outlier channels x20, GQA 8, 2048 tokens",
                                     "rows": res}, indent=1) + "\n")
