"""Model -> specialization derivation (codegen/models.py): configs written here by hand from the rules
vLLM applies (head size, TP sharding, layer kinds), not produced by the code under test."""

from __future__ import annotations

import json

import pytest

from ultraquant.codegen import models as m
from ultraquant.errors import UltraQuantError


def _llama(**kw):
    return {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "torch_dtype": "bfloat16", **kw}


def test_head_size_and_gqa_per_tp() -> None:
    f = m.facts_from_config(_llama(), "llama")
    assert (f.head_size, f.num_heads, f.num_kv_heads, f.dtype) == (128, 32, 8, "bf16")
    # Hk=8: TP 1..8 keep 4 q heads per kv head; TP 16 leaves 2 q heads and one replicated kv head.
    assert [f.gqa(t) for t in (1, 2, 4, 8, 16)] == [4, 4, 4, 4, 2]
    with pytest.raises(UltraQuantError, match="TP=3 does not divide its 32 query heads"):
        f.gqa(3)
    # explicit head_dim wins over hidden_size / heads (Gemma 2 2B: 2304 / 8 = 288, head_dim 256)
    assert m.facts_from_config(_llama(hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
                                      head_dim=256)).head_size == 256
    # a kv-head count that TP neither divides nor multiplies (Phi-4: 40 q, 10 kv heads at TP 4)
    phi4 = m.facts_from_config(_llama(hidden_size=5120, num_attention_heads=40, num_key_value_heads=10))
    assert phi4.gqa(2) == 4
    with pytest.raises(UltraQuantError, match="neither divides nor is a multiple of its 10 kv heads"):
        phi4.gqa(4)
    # no num_key_value_heads: multi-head attention (GQA 1)
    mha = dict(_llama())
    del mha["num_key_value_heads"]
    assert m.facts_from_config(mha).gqa(1) == 1


def test_layer_kinds() -> None:
    gpt_oss = m.facts_from_config({"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64,
                                   "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                                   "layer_types": ["sliding_attention", "full_attention"] * 12})
    assert gpt_oss.features() == [{"has_sinks": True, "has_softcap": False, "has_window": False},
                                  {"has_sinks": True, "has_softcap": False, "has_window": True}]
    gemma2 = m.facts_from_config({"model_type": "gemma2", "hidden_size": 3584, "num_attention_heads": 16,
                                  "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096,
                                  "attn_logit_softcapping": 50.0})
    assert [f["has_window"] for f in gemma2.features()] == [False, True]
    assert all(f["has_softcap"] and not f["has_sinks"] for f in gemma2.features())
    gemma3 = m.facts_from_config({"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6, "attn_logit_softcapping": None}})
    assert (gemma3.head_size, gemma3.gqa(1), gemma3.window_layers, gemma3.full_layers, gemma3.has_softcap) == \
        (256, 2, True, True, False)
    qwen = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
            "sliding_window": 131072, "num_hidden_layers": 28, "max_window_layers": 28}
    assert not m.facts_from_config({**qwen, "use_sliding_window": False}).window_layers
    assert not m.facts_from_config({**qwen, "use_sliding_window": True}).window_layers  # all layers full
    mixed = m.facts_from_config({**qwen, "use_sliding_window": True, "max_window_layers": 4})
    assert (mixed.window_layers, mixed.full_layers) == (True, True)
    # Llama-family: vLLM ignores sliding_window there (no layer_types); a note says so
    mistral = m.facts_from_config(_llama(model_type="mistral", sliding_window=4096))
    assert (mistral.window_layers, mistral.full_layers) == (False, True) and "ignored" in mistral.notes[0]
    # a window as long as the context is no window
    long = m.facts_from_config({**qwen, "use_sliding_window": True, "max_window_layers": 0,
                                "max_position_embeddings": 32768})
    assert not long.window_layers and "no window" in long.notes[0]
    assert m.facts_from_config(_llama(torch_dtype="float16")).dtype == "fp16"
    assert m.facts_from_config(_llama(torch_dtype="float32")).dtype == "bf16"


@pytest.mark.parametrize("cfg, match", [
    (_llama(hidden_size=3072, num_attention_heads=32, num_key_value_heads=32), "head size 96 is not served"),
    (_llama(kv_lora_rank=512, model_type="deepseek_v3"), "multi-head latent attention"),
    (_llama(num_key_value_heads=5), "not a multiple of 5 kv heads"),
    (_llama(num_attention_heads=0), "num_attention_heads"),
    (_llama(hidden_size=4097), "not a multiple of 32 heads"),
    (_llama(torch_dtype="int8"), "dtype 'int8'"),
    ([1, 2], "expected a JSON object"),
])
def test_unservable_configs_raise(cfg, match) -> None:
    with pytest.raises(UltraQuantError, match=match):
        m.facts_from_config(cfg, "x")


def test_derive_exact_set(tmp_path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text(json.dumps(_llama()))
    b = tmp_path / "gemma.json"
    b.write_text(json.dumps({"model_type": "gemma2", "hidden_size": 2304, "num_attention_heads": 8,
                             "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                             "attn_logit_softcapping": 50.0}))
    facts = m.resolve(f"{a},{b}")
    assert [f.name for f in facts] == ["a", "gemma.json"]
    needs = m.derive(facts, tp=(1, 8), block_sizes=(16, 64))
    got = {(c["head_size"], c["gqa"], c["block_size"], c["has_softcap"], c["has_window"]) for c in needs.attention}
    want = {(128, 4, bs, False, False) for bs in (16, 64)}
    want |= {(256, g, bs, True, w) for g in (2, 1) for bs in (16, 64) for w in (False, True)}
    assert got == want and len(needs.attention) == len(want)
    assert needs.head_sizes == (128, 256) and needs.gqa == (1, 2, 4) and needs.block_sizes == (16, 64)
    # TP 3 fits neither model: an error, not an empty build
    with pytest.raises(UltraQuantError, match="none of TP=3 can shard it"):
        m.derive(facts, tp=(3,))
    # TP 16 fits the Llama config (2 q heads, one kv head) but not Gemma's 8 heads: recorded, not fatal
    needs = m.derive(facts, tp=(1, 16))
    assert any("gemma.json: TP=16" in s for s in needs.skipped_tp)
    with pytest.raises(UltraQuantError, match="cannot read"):
        m.resolve(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UltraQuantError, match="is not JSON"):
        m.resolve(str(tmp_path / "bad.json"))
    with pytest.raises(UltraQuantError, match="MODELS"):
        m.resolve(" , ")


def test_popular_preset_is_data_and_loads() -> None:
    table = json.loads(m.POPULAR_FILE.read_text())["models"]
    facts = m.popular()
    assert len(facts) == len(table) >= 30
    families = {f.model_type for f in facts}
    assert {"llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma2", "gpt_oss", "phi3"} <= families
    needs = m.derive(facts)
    feats = {(c["has_sinks"], c["has_softcap"], c["has_window"]) for c in needs.attention}
    assert {(True, False, True), (True, False, False), (False, True, True), (False, False, True)} <= feats
    assert set(needs.head_sizes) <= set(m.SERVED_HEAD_SIZES)
    assert m.resolve("popular") == facts
    # a TP degree some preset models cannot use leaves them out (recorded), it does not fail the preset
    wide = m.derive(facts, tp=(16,))
    assert any("Qwen2.5-0.5B-Instruct: none of TP=16" in s and "left out" in s for s in wide.skipped_tp)
    assert wide.attention and all(c["gqa"] >= 1 for c in wide.attention)
