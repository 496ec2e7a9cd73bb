"""Accuracy harness without the real model: GGUF loading, RoPE layout, tokenizer, the cache path
against reference.decode_attention, metrics, report/plot and the CLI on a tiny random Llama GGUF."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ultraquant import reference
from ultraquant.errors import UltraQuantError

gguf = pytest.importorskip("gguf", reason="the `accuracy` extra (gguf) is not installed")

from ultraquant.accuracy import evaluate as ev  # noqa: E402
from ultraquant.accuracy import formats  # noqa: E402
from ultraquant.accuracy.model import (  # noqa: E402
    LlamaConfig,
    LlamaWeights,
    _attend,
    _attend_at,
    _rope,
    cosine_positions,
    forward,
    load_gguf,
    unpermute_rope,
)
from ultraquant.accuracy.tokenizer import BPETokenizer  # noqa: E402

CFG = LlamaConfig(n_layers=2, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32, rope_theta=10000.0,
                  norm_eps=2.0**-17, vocab=256 + 5)  # eps exact in float32 (GGUF stores f32)
MERGES = ["h e", "l l", "he ll", "Ġ w", "Ġ Ġ"]


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What GGUF conversion does to Q/K rows (written from its description: half-split -> pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (written from its definition, for the tiny vocab)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def _vocab() -> list[str]:
    table = _byte_to_unicode()
    return [table[b] for b in range(256)] + ["he", "ll", "hell", "Ġw", "ĠĠ"]


def _random_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    h, ff, hd = CFG.hidden, 96, CFG.head_dim
    out = {"token_embd.weight": g.standard_normal((CFG.vocab, h)).astype(np.float32),
           "output_norm.weight": (1 + 0.1 * g.standard_normal(h)).astype(np.float32)}
    shapes = {"attn_q": (CFG.n_heads * hd, h), "attn_k": (CFG.n_kv_heads * hd, h),
              "attn_v": (CFG.n_kv_heads * hd, h), "attn_output": (h, h), "ffn_gate": (ff, h),
              "ffn_up": (ff, h), "ffn_down": (h, ff)}
    for i in range(CFG.n_layers):
        for name, shape in shapes.items():
            out[f"blk.{i}.{name}.weight"] = (g.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
        for name in ("attn_norm", "ffn_norm"):
            out[f"blk.{i}.{name}.weight"] = (1 + 0.1 * g.standard_normal(h)).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """A 2-layer Llama GGUF (float32 tensors, Q/K permuted as llama.cpp expects) and its HF weights."""
    hf = _random_hf_weights()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(CFG.n_layers)
    w.add_context_length(256)
    w.add_embedding_length(CFG.hidden)
    w.add_feed_forward_length(96)
    w.add_head_count(CFG.n_heads)
    w.add_head_count_kv(CFG.n_kv_heads)
    w.add_rope_freq_base(CFG.rope_theta)
    w.add_layer_norm_rms_eps(CFG.norm_eps)
    w.add_vocab_size(CFG.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_vocab())
    w.add_token_merges(MERGES)
    w.add_tokenizer_pre("smollm")
    for name, arr in hf.items():
        if name.endswith("attn_q.weight"):
            arr = _llama_cpp_permute(arr, CFG.n_heads)
        elif name.endswith("attn_k.weight"):
            arr = _llama_cpp_permute(arr, CFG.n_kv_heads)
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path), hf


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf) -> tuple[LlamaWeights, BPETokenizer]:
    return load_gguf(tiny_gguf[0])


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 64 * 5, dtype=np.float32).reshape(6 * 64, 5)
    assert np.array_equal(unpermute_rope(_llama_cpp_permute(w, 6), 6), w)
    assert not np.array_equal(_llama_cpp_permute(w, 6), w)


def test_half_split_rope_on_hf_rows_matches_pair_rope_on_gguf_rows():
    """Scores are the same whichever layout is used, as long as the RoPE matches the layout."""
    g = torch.Generator().manual_seed(1)
    hd, n = 32, 9
    w_hf = torch.randn(hd, 16, generator=g)
    w_gguf = torch.from_numpy(_llama_cpp_permute(w_hf.numpy(), 1))
    h = torch.randn(n, 16, generator=g)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), 1e4 ** (-torch.arange(0, hd, 2) / hd)).float()
    q_hf = _rope((h @ w_hf.T)[:, None], ang.cos()[:, None], ang.sin()[:, None])[:, 0]
    pairs = (h @ w_gguf.T).view(n, hd // 2, 2)
    x, y = pairs[..., 0], pairs[..., 1]
    q_pair = torch.stack([x * ang.cos() - y * ang.sin(), y * ang.cos() + x * ang.sin()], -1).view(n, hd)
    torch.testing.assert_close(q_hf @ q_hf.T, q_pair @ q_pair.T, rtol=1e-5, atol=1e-4)
    # the wrong pairing (GGUF rows with the half-split RoPE) does not give the same scores
    q_wrong = _rope((h @ w_gguf.T)[:, None], ang.cos()[:, None], ang.sin()[:, None])[:, 0]
    assert not torch.allclose(q_hf @ q_hf.T, q_wrong @ q_wrong.T, atol=1e-2)


def test_load_gguf_restores_hf_layout(tiny_gguf, tiny_model):
    _, hf = tiny_gguf
    weights, _ = tiny_model
    assert weights.config == CFG
    assert torch.equal(weights.embed, torch.from_numpy(hf["token_embd.weight"]))
    for i in range(CFG.n_layers):
        for name in ("attn_q", "attn_k", "attn_v", "ffn_down"):
            assert torch.equal(weights.layers[i][name], torch.from_numpy(hf[f"blk.{i}.{name}.weight"]))


def test_tokenizer_merges_digits_and_round_trip(tiny_model):
    _, tok = tiny_model
    vocab = tok.vocab
    assert tok.encode("hello") == [vocab["hell"], vocab["o"]]
    assert tok.encode(" world") == [vocab["Ġw"]] + [vocab[c] for c in "orld"]
    assert tok.encode("x123") == [vocab["x"], vocab["1"], vocab["2"], vocab["3"]]  # digits one by one
    # the whitespace run before a digit is one piece (the digit split comes first, as llama.cpp's
    # "smollm" pre-tokenizer and the model's tokenizer.json do): "ĠĠ", not "Ġ" + "Ġ"
    assert tok.encode("a  1") == [vocab["a"], vocab["ĠĠ"], vocab["1"]]
    assert tok.encode("a  b") == [vocab[p] for p in ("a", "Ġ", "Ġ", "b")]  # GPT-2's \s+(?!\S) lookahead
    text = "GNU  General\n\n  Public_License v3, §7 — naïve 2007.\t"
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_rejects_empty_vocabulary_and_unknown_pre_tokenizer():
    with pytest.raises(UltraQuantError, match="tokens/merges"):
        BPETokenizer([], [], "smollm")
    with pytest.raises(UltraQuantError, match="tokenizer.ggml.pre"):
        BPETokenizer(_vocab(), MERGES, "llama-bpe")


@pytest.mark.parametrize("encoder", ["upstream", "rne", "mse"])
def test_cache_path_matches_reference_decode(encoder):
    """Attending to what the paged cache holds (what every position of the model does) equals
    reference.decode_attention of each position over the same cache."""
    g = torch.Generator().manual_seed(2)
    n, hq, hk, d = 37, 4, 2, 64
    key = torch.randn(n, hk, d, generator=g).bfloat16()
    value = torch.randn(n, hk, d, generator=g).bfloat16()
    query = torch.randn(n, hq, d, generator=g)
    kv_cache, block_table, _ = formats.paged_store(key, value, encoder)
    keys, values = reference.dequant_kv(kv_cache, block_table, torch.tensor([n], dtype=torch.int32))
    mine = _attend(query, keys[0], values[0])
    positions = [0, 1, 15, 16, 17, 36]
    ref = reference.decode_attention(
        query[positions].contiguous(), kv_cache, block_table.expand(len(positions), -1).contiguous(),
        torch.tensor([p + 1 for p in positions], dtype=torch.int32), d ** -0.5)
    torch.testing.assert_close(mine[positions], ref.float(), rtol=1e-4, atol=1e-4)
    # and the cache is not the identity: the quantized K differs from the input
    assert not torch.allclose(keys[0], key.float())


def test_unrotated_ablation_differs_only_in_k():
    g = torch.Generator().manual_seed(3)
    key = torch.randn(20, 2, 64, generator=g).bfloat16()
    value = torch.randn(20, 2, 64, generator=g).bfloat16()
    k_rot, v_rot = formats.ultraquant_cache("rne")(0, key, value)
    k_plain, v_plain = formats.unrotated_cache("rne")(0, key, value)
    assert torch.equal(v_rot, v_plain)
    assert not torch.equal(k_rot, k_plain)
    with pytest.raises(UltraQuantError, match="encoder"):
        formats.unrotated_cache("nope")


def test_fp8_per_tensor_keeps_absmax_and_bounds_error():
    x = torch.randn(64, 3, 64) * 7
    y = formats._fp8_per_tensor(x)
    assert torch.isclose(y.abs().max(), x.abs().max(), rtol=1e-6)
    assert float(((y - x).abs() / x.abs().max()).max()) <= 2 ** -4  # e4m3: 3 mantissa bits
    assert torch.equal(formats._fp8_per_tensor(torch.zeros(4, 64)), torch.zeros(4, 64))


def test_windows_split():
    ws = ev.windows(list(range(10)), 4)
    assert [w.tolist() for w in ws] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [w.numel() for w in ev.windows(list(range(9)), 4)] == [4, 4]  # a 1-token tail is dropped
    assert sum(w.numel() for w in ev.windows(list(range(100)), 8, max_tokens=20)) == 20
    with pytest.raises(UltraQuantError, match="context"):
        ev.windows([1, 2, 3], 1)


def test_token_stats_against_hand_computation():
    g = torch.Generator().manual_seed(4)
    ref, other = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    targets = torch.tensor([0, 3, 10, 2, 2])
    nll, kl, agree = ev._token_stats(ref, ref, targets)
    assert torch.all(kl < 1e-12) and bool(agree.all())
    nll, kl, agree = ev._token_stats(ref, other, targets)
    p, q = torch.softmax(ref.double(), -1), torch.softmax(other.double(), -1)
    torch.testing.assert_close(kl, (p * (p / q).log()).sum(-1))
    torch.testing.assert_close(nll, -q.log()[torch.arange(5), targets])
    assert agree.tolist() == (ref.argmax(-1) == other.argmax(-1)).tolist()


def test_evaluate_tiny_model_orders_formats(tiny_model, tmp_path):
    weights, _ = tiny_model
    tokens = torch.randint(0, CFG.vocab, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    scores = ev.evaluate(weights, tokens, formats.default_variants(), context=32)
    by = {s.name: s for s in scores}
    assert by["bf16"].tokens == 31 + 31 + 5
    assert by["bf16"].mean_kl == 0 and by["bf16"].top1 == 1.0
    for name in ("uq-upstream", "uq-rne", "uq-mse", "uq-rne-norot"):
        assert by[name].mean_kl > 0
        assert all(0.5 < c < 1.0 for c in by[name].layer_cosine)
    assert by["fp8-e4m3"].mean_kl < by["uq-rne"].mean_kl
    doc = ev.report(scores, {"model": "tiny"})
    rows = {r["name"]: r for r in doc["variants"]}
    assert rows["uq-upstream"]["kl_change_vs_upstream"] == 0
    assert math.isclose(rows["uq-mse"]["ppl_delta"], by["uq-mse"].ppl - by["bf16"].ppl)
    assert len(rows["uq-rne"]["kl_by_position"]) == 1  # 32-token windows fit one 128-position bin
    assert by["uq-rne"].count_by_bin[0] == by["uq-rne"].tokens
    assert table_has_rows(ev.table(doc), len(scores))
    from ultraquant.accuracy.plot import save_plot
    png = save_plot(doc, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def table_has_rows(text: str, n: int) -> bool:
    return len([line for line in text.splitlines() if line.startswith("| ")]) == n + 1


def test_evaluate_requires_bf16_first(tiny_model):
    with pytest.raises(UltraQuantError, match="bf16"):
        ev.evaluate(tiny_model[0], [1, 2, 3], formats.default_variants()[1:])
    with pytest.raises(UltraQuantError, match="unknown"):
        formats.select_variants(["uq-nope"])


def test_forward_bf16_cache_is_deterministic_and_causal(tiny_model):
    weights, _ = tiny_model
    toks = torch.tensor([5, 9, 200, 7, 7, 1])
    full = forward(weights, toks, formats.bf16_cache).logits
    prefix = forward(weights, toks[:4], formats.bf16_cache).logits
    torch.testing.assert_close(full[:4], prefix, rtol=1e-4, atol=1e-4)  # later tokens never leak back


def test_cli_writes_json_png_and_table(tiny_gguf, tmp_path):
    from ultraquant.cli import main

    text = tmp_path / "t.txt"
    text.write_text("hello world, hello 2007 " * 6)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["accuracy", "--model", tiny_gguf[0], "--text", str(text),
                                    "--context", "24", "--variants", "uq-upstream,uq-mse",
                                    "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "accuracy.json").read_text())
    assert [r["name"] for r in doc["variants"]] == ["bf16", "uq-upstream", "uq-mse"]
    assert doc["meta"]["context"] == 24 and doc["meta"]["tokens"] == doc["meta"]["text_tokens"]
    assert (out / "accuracy.png").stat().st_size > 1000
    assert "UltraQuant, encoder=mse" in res.output


def test_cosine_probe_positions_and_partial_attention():
    assert cosine_positions(17).tolist() == [0, 8, 16]
    assert cosine_positions(18).tolist() == [0, 8, 16, 17]
    g = torch.Generator().manual_seed(6)
    q = torch.randn(18, 4, 32, generator=g)
    k, v = torch.randn(18, 2, 32, generator=g), torch.randn(18, 2, 32, generator=g)
    pos = cosine_positions(18)
    torch.testing.assert_close(_attend_at(q, k, v, pos), _attend(q, k, v)[pos], rtol=1e-5, atol=1e-5)


def test_windows_scored_apart_merge_to_the_whole(tiny_model):
    weights, _ = tiny_model
    tokens = torch.randint(0, CFG.vocab, (50,), generator=torch.Generator().manual_seed(7)).tolist()
    variants = formats.select_variants(["uq-upstream"])
    whole = ev.report(ev.evaluate(weights, tokens, variants, context=20), {})
    parts = [ev.report(ev.evaluate(weights, tokens, variants, context=20, only_windows=w), {})
             for w in ([0], [1, 2])]
    merged = ev.report(ev.merge_reports(parts), {})
    for a, b in zip(whole["variants"], merged["variants"], strict=True):
        assert a["tokens"] == b["tokens"] == 19 + 19 + 9
        for key in ("ppl", "mean_kl", "top1_agreement", "attn_cosine_mean"):
            assert math.isclose(a[key], b[key], rel_tol=1e-9), key
    assert parts[0]["variants"][1]["tokens"] == 19
    with pytest.raises(UltraQuantError, match="only_windows"):
        ev.evaluate(weights, tokens, variants, context=20, only_windows=[3])


def test_cli_windows_then_merge(tiny_gguf, tmp_path):
    from ultraquant.cli import main

    text = tmp_path / "t.txt"
    text.write_text("hello world, hello 2007 " * 6)
    args = ["accuracy", "--model", tiny_gguf[0], "--text", str(text), "--context", "16",
            "--variants", "uq-rne", "--quiet"]
    outs = []
    for i, w in enumerate(("0", "1,2")):
        outs.append(tmp_path / f"o{i}")
        res = CliRunner().invoke(main, [*args, "--windows", w, "--out", str(outs[-1])])
        assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["accuracy", "--merge", str(outs[0] / "accuracy.json"), "--merge",
                                    str(outs[1] / "accuracy.json"), "--out", str(tmp_path / "m"), "--quiet"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "m" / "accuracy.json").read_text())
    parts = [json.loads((o / "accuracy.json").read_text()) for o in outs]
    assert doc["meta"]["tokens"] == sum(p["meta"]["tokens"] for p in parts)
    assert doc["variants"][1]["tokens"] == sum(p["variants"][1]["tokens"] for p in parts)


@pytest.mark.parametrize("args, hint", [(["--variants", "uq-nope"], "--variants"),
                                        (["--windows", "a,1"], "--windows")])
def test_cli_rejects_bad_options(tmp_path, args, hint):
    from ultraquant.cli import main

    res = CliRunner().invoke(main, ["accuracy", *args, "--out", str(tmp_path)])
    assert res.exit_code == 2 and hint in res.output
