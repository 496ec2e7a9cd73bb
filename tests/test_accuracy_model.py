"""CI canary: SmolLM2-135M on the first 512 tokens of the GPL-3 text, every KV format vs a bf16 cache.

One short window moves by several percent in KL with any change of how attention is computed, so
this asserts only what held on every 512-token window measured, with margin (docs/accuracy.md,
"CI canary"): the orderings the format is about, plus wide bands that a broken model load, tokenizer
or cache path (garbage or a no-op) falls out of. Needs the model (`make accuracy-env`); skipped
without it.
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
"""One window of this many tokens: about a minute on an idle 2-core machine."""

BF16_PPL = (10.0, 60.0)
FOUR_BIT = ("uq-upstream", "uq-rne", "uq-mse", "uq-rne-norot")
KL_BAND = {"fp8-e4m3": (0.003, 0.08), "uq-upstream": (0.05, 0.8), "uq-rne": (0.05, 0.8), "uq-mse": (0.03, 0.8),
           "uq-rne-norot": (0.1, 1.2)}
TOP1_MIN = {"fp8-e4m3": 0.85, "uq-upstream": 0.6, "uq-rne": 0.6, "uq-mse": 0.6, "uq-rne-norot": 0.5}
COS_MIN = {"fp8-e4m3": 0.99, "uq-upstream": 0.9, "uq-rne": 0.9, "uq-mse": 0.9, "uq-rne-norot": 0.75}


@pytest.fixture(scope="module")
def doc() -> dict:
    try:
        path = find_gguf()
    except UltraQuantError as exc:
        pytest.skip(str(exc))
    weights, tok = load_gguf(path)
    tokens = tok.encode(TEXT.read_text(encoding="utf-8"))
    assert len(tokens) == 7639  # SmolLM2's tokenizer on the whole text (HF tokenizers and llama.cpp agree)
    scores = evaluate(weights, tokens, default_variants(), context=TOKENS, max_tokens=TOKENS)
    return {r["name"]: r for r in report(scores, {})["variants"]}


def test_model_perplexity_is_sane(doc):
    # a wrong RoPE layout, weight transpose or tokenizer gives a PPL in the hundreds or more
    assert BF16_PPL[0] < doc["bf16"]["ppl"] < BF16_PPL[1]


@pytest.mark.parametrize("name", list(KL_BAND))
def test_each_format_changes_the_output_within_bounds(doc, name):
    lo, hi = KL_BAND[name]
    assert lo < doc[name]["mean_kl"] < hi, doc[name]["mean_kl"]
    assert doc[name]["top1_agreement"] > TOP1_MIN[name]
    assert doc[name]["attn_cosine_min"] > COS_MIN[name]


def test_improved_encoder_and_rotation_still_pay(doc):
    kl = {n: doc[n]["mean_kl"] for n in KL_BAND}
    cos = {n: doc[n]["attn_cosine_min"] for n in KL_BAND}
    assert kl["uq-mse"] < kl["uq-upstream"]  # the mse encoder's scale choice
    assert cos["uq-mse"] > cos["uq-upstream"]  # the same, per layer (less noisy than KL)
    assert kl["uq-rne-norot"] > kl["uq-rne"]  # the Hadamard rotation's benefit
    assert cos["uq-rne"] > cos["uq-rne-norot"] + 0.03
    assert kl["fp8-e4m3"] < 0.25 * min(kl[n] for n in FOUR_BIT)  # twice the bits
