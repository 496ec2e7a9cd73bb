"""From a model to the kernels it needs: read Hugging Face ``config.json`` files offline and derive the
exact attention specializations vLLM asks for (``make kernels MODELS=...``, ``ultraquant build --model``).

What decides a blob, per attention layer of the model, as vLLM shards and serves it:

- head size ``D``: ``head_dim`` when the config has it, else ``hidden_size // num_attention_heads``;
- GQA at tensor-parallel degree ``tp``: vLLM gives each GPU ``Hq / tp`` query heads and
  ``max(1, Hk / tp)`` kv heads (kv heads are replicated when ``tp > Hk``), and refuses a ``tp`` that
  does not divide ``Hq`` or that neither divides nor is divided by ``Hk``; GQA = the ratio of the two;
- block size: vLLM's ``--block-size`` (16 unless the deployment sets another);
- query dtype: the config's ``torch_dtype``/``dtype`` (float32 checkpoints are served in bf16);
- features, per layer type: sinks (gpt-oss: a learned sink logit per query head on every layer),
  logits soft cap (``attn_logit_softcapping``, Gemma 2), sliding window on the layers vLLM gives one.
  vLLM applies a window only to ``"sliding_attention"`` entries of ``layer_types``; configs without
  that list get it as transformers derives it (Gemma 2: alternating; Gemma 3: ``sliding_window_pattern``;
  Qwen 2/3: ``use_sliding_window`` from layer ``max_window_layers`` on). Llama-family configs (Llama,
  Mistral, Mixtral, Phi-3) have no ``layer_types``: vLLM ignores their ``sliding_window`` (and caps the
  context instead), so they need no window blob. A window at least ``max_position_embeddings`` long
  is no window.

The window length, soft cap value and scale are run-time arguments: they never split a blob.
``popular`` names the table of common models in ``popular_models.json`` (data, derived the same way).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.format import SUPPORTED_HEAD_SIZES

from . import matrix

POPULAR = "popular"
"""Preset name: every model of :data:`POPULAR_FILE`."""

POPULAR_FILE = Path(__file__).with_name("popular_models.json")

DEFAULT_TP: tuple[int, ...] = (1, 2, 4, 8)
"""Tensor-parallel degrees derived when none are given: those of one 8-GPU node."""

VLLM_BLOCK_SIZE = 16
"""vLLM's default ``--block-size`` (tokens per cache block): the block size built unless told otherwise."""

SERVED_HEAD_SIZES: tuple[int, ...] = SUPPORTED_HEAD_SIZES
"""Head sizes a model may have (:data:`ultraquant.format.SUPPORTED_HEAD_SIZES`)."""

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16", "half": "fp16", "float": "bf16"}

_LAYERED_TYPES = ("gemma2", "gemma3", "gemma3_text", "gpt_oss", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                  "cohere2", "gemma3n_text")
"""Model types whose vLLM attention reads per-layer windows (``layer_types`` or the pattern it derives from)."""


@dataclass(frozen=True)
class ModelFacts:
    """The attention facts of one model that decide which blobs it needs."""

    name: str
    model_type: str
    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: str
    has_sinks: bool
    has_softcap: bool
    window_layers: bool
    """Some layers use a sliding window."""
    full_layers: bool
    """Some layers attend to the whole context."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    from_preset: bool = field(default=False, compare=False)
    """From the ``popular`` table: a TP degree it cannot use leaves it out instead of failing the build."""

    def features(self) -> list[dict[str, bool]]:
        """The feature sets (matrix flags) of the model's layer kinds."""
        base = {"has_sinks": self.has_sinks, "has_softcap": self.has_softcap}
        kinds = ([False] if self.full_layers else []) + ([True] if self.window_layers else [])
        return [{**base, "has_window": w} for w in kinds]

    def gqa(self, tp: int) -> int:
        """Query heads per kv head on one GPU at tensor-parallel degree ``tp`` (vLLM's sharding)."""
        hq, hk = self.num_heads, self.num_kv_heads
        if tp < 1 or hq % tp:
            raise UltraQuantError(f"{self.name}: TP={tp} does not divide its {hq} query heads")
        if hk % tp and tp % hk:
            raise UltraQuantError(f"{self.name}: TP={tp} neither divides nor is a multiple of its {hk} kv heads")
        return (hq // tp) // max(1, hk // tp)


def _int(cfg: dict[str, Any], key: str, name: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UltraQuantError(f"{name}: config field {key!r} must be a positive integer, got {v!r}")
    return v


def _layer_types(cfg: dict[str, Any], model_type: str, window: int | None) -> list[str] | None:
    """``layer_types`` as given, or as transformers derives it for the model types that have one."""
    given = cfg.get("layer_types")
    if isinstance(given, list) and given:
        return [str(t) for t in given]
    n = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else None
    if model_type == "gemma2":
        return ["sliding_attention", "full_attention"] if window else ["full_attention"]
    if model_type in ("gemma3", "gemma3_text"):
        pattern = cfg.get("sliding_window_pattern", 6)
        if not window or not isinstance(pattern, int) or pattern < 1:
            return ["full_attention"]
        return ["sliding_attention"] * (pattern - 1) + ["full_attention"] if pattern > 1 else ["full_attention"]
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if not cfg.get("use_sliding_window") or not window:
            return ["full_attention"]
        first = cfg.get("max_window_layers", 0)
        if n is not None and isinstance(first, int) and first >= n:
            return ["full_attention"]
        return (["full_attention"] if isinstance(first, int) and first > 0 else []) + ["sliding_attention"]
    return None


def facts_from_config(cfg: dict[str, Any], name: str = "config.json") -> ModelFacts:
    """The attention facts of a Hugging Face ``config.json`` (already parsed); raises
    :class:`UltraQuantError` naming the model for configs UltraQuant cannot serve."""
    if not isinstance(cfg, dict):
        raise UltraQuantError(f"{name}: expected a JSON object")
    text = cfg.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers (Gemma 3, Mistral 3, Llama 4...): the language model
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text}
    model_type = str(cfg.get("model_type", ""))
    notes: list[str] = []
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        raise UltraQuantError(f"{name}: multi-head latent attention ({model_type or 'MLA'}) is not served "
                              "by UltraQuant (its cache holds a latent vector, not per-head K/V)")
    hq = _int(cfg, "num_attention_heads", name)
    hk = cfg.get("num_key_value_heads", hq) or hq
    hk = _int({"num_key_value_heads": hk}, "num_key_value_heads", name)
    if hq % hk:
        raise UltraQuantError(f"{name}: {hq} query heads are not a multiple of {hk} kv heads")
    if cfg.get("head_dim"):
        d = _int(cfg, "head_dim", name)
    else:
        hidden = _int(cfg, "hidden_size", name)
        if hidden % hq:
            raise UltraQuantError(f"{name}: hidden_size {hidden} is not a multiple of {hq} heads and no head_dim")
        d = hidden // hq
    if d not in SERVED_HEAD_SIZES:
        raise UltraQuantError(f"{name}: head size {d} is not served (UltraQuant serves "
                              f"{', '.join(map(str, SERVED_HEAD_SIZES))}: a power of two, the format's "
                              "32-element groups)")
    raw_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if raw_dtype not in _DTYPES:
        raise UltraQuantError(f"{name}: dtype {raw_dtype!r} is not one UltraQuant serves (bf16, fp16)")
    window = cfg.get("sliding_window")
    window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
    max_pos = cfg.get("max_position_embeddings")
    if window and isinstance(max_pos, int) and window >= max_pos:
        notes.append(f"sliding_window {window} >= max_position_embeddings {max_pos}: no window")
        window = None
    types = _layer_types(cfg, model_type, window)
    if types is None:
        if window:
            notes.append(f"sliding_window {window} ignored: vLLM's {model_type or 'llama'}-family attention "
                         "applies windows only through layer_types (it caps the context instead)")
        types = ["full_attention"]
    sliding = window is not None and "sliding_attention" in types
    full = any(t != "sliding_attention" for t in types) or not sliding
    softcap = cfg.get("attn_logit_softcapping")
    return ModelFacts(
        name=name, model_type=model_type, head_size=d, num_heads=hq, num_kv_heads=hk,
        dtype=_DTYPES[raw_dtype], has_sinks=model_type == "gpt_oss",
        has_softcap=isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap > 0,
        window_layers=sliding, full_layers=full, notes=tuple(notes))


def load_config(path: str | Path) -> ModelFacts:
    """Facts of one ``config.json`` file (or a model folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except OSError as exc:
        raise UltraQuantError(f"MODELS: cannot read {p}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UltraQuantError(f"MODELS: {p} is not JSON: {exc}") from None
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.name
    return facts_from_config(cfg, name)


def popular() -> list[ModelFacts]:
    """Facts of every model of the ``popular`` preset."""
    table = json.loads(POPULAR_FILE.read_text())["models"]
    return [replace(facts_from_config(cfg, name), from_preset=True) for name, cfg in table.items()]


def resolve(models: str | Sequence[str]) -> list[ModelFacts]:
    """``"popular"`` and/or comma-separated config.json paths -> facts of each model."""
    items = [s.strip() for s in models.split(",")] if isinstance(models, str) else list(models)
    items = [s for s in items if s]
    if not items:
        raise UltraQuantError("MODELS: give config.json paths (comma-separated) or 'popular'")
    out: list[ModelFacts] = []
    for item in items:
        out.extend(popular() if item == POPULAR else [load_config(item)])
    return out


@dataclass(frozen=True)
class ModelNeeds:
    """What a set of models needs: the attention configs (matrix flags + axes) and what was left out."""

    attention: tuple[dict[str, Any], ...]
    """One dict per (head_size, gqa, block_size, dtype, has_sinks, has_window, has_softcap)."""
    skipped_tp: tuple[str, ...] = ()
    """``"<model>: TP=<n> ..."`` for degrees vLLM would refuse for that model."""

    def values(self, key: str) -> tuple[Any, ...]:
        """The sorted distinct values of one config key (``head_size``, ``gqa``, ``block_size``, ``dtype``)."""
        return tuple(sorted({c[key] for c in self.attention}))

    head_sizes = property(lambda self: self.values("head_size"))
    gqa = property(lambda self: self.values("gqa"))
    block_sizes = property(lambda self: self.values("block_size"))
    dtypes = property(lambda self: self.values("dtype"))


def derive(models: Iterable[ModelFacts], tp: Sequence[int] = DEFAULT_TP,
           block_sizes: Sequence[int] = (VLLM_BLOCK_SIZE,)) -> ModelNeeds:
    """Every attention config ``models`` need at tensor-parallel degrees ``tp`` and ``block_sizes``.

    A degree a model cannot be sharded to is recorded in ``skipped_tp``; a model with no usable degree
    at all is an error (nothing could serve it), except a ``popular`` model, which is left out.
    """
    if not tp or any(t < 1 for t in tp):
        raise UltraQuantError(f"TP: expected positive tensor-parallel degrees, got {list(tp)}")
    if not block_sizes or any(b < 1 for b in block_sizes):
        raise UltraQuantError(f"BLOCK_SIZES: expected positive block sizes, got {list(block_sizes)}")
    seen: dict[tuple, dict[str, Any]] = {}
    skipped: list[str] = []
    for m in models:
        usable = 0
        for t in tp:
            try:
                g = m.gqa(t)
            except UltraQuantError as exc:
                skipped.append(str(exc))
                continue
            usable += 1
            for bs in block_sizes:
                for feats in m.features():
                    c = {"head_size": m.head_size, "gqa": g, "block_size": int(bs), "dtype": m.dtype, **feats}
                    seen.setdefault(tuple(sorted(c.items())), c)
        if not usable:
            why = (f"{m.name}: none of TP={','.join(map(str, tp))} can shard it "
                   f"({m.num_heads} query heads, {m.num_kv_heads} kv heads)")
            if not m.from_preset:
                raise UltraQuantError(why)
            skipped.append(why + "; left out of the preset")
    if not seen:
        raise UltraQuantError("no model of the selection can be sharded to TP=" + ",".join(map(str, tp)))
    return ModelNeeds(tuple(seen[k] for k in sorted(seen)), tuple(skipped))


def describe(facts: ModelFacts, tp: Sequence[int] = DEFAULT_TP) -> str:
    """One line per model: head size, heads, GQA per TP degree, features (for CLI output)."""
    per_tp = []
    for t in tp:
        try:
            per_tp.append(f"TP{t}:{facts.gqa(t)}")
        except UltraQuantError:
            per_tp.append(f"TP{t}:-")
    feats = [n for n, on in (("sinks", facts.has_sinks), ("softcap", facts.has_softcap),
                             ("window", facts.window_layers), ("full", facts.full_layers)) if on]
    return (f"{facts.name}: D={facts.head_size} Hq={facts.num_heads} Hk={facts.num_kv_heads} {facts.dtype} "
            f"GQA {' '.join(per_tp)} layers {'+'.join(feats)}")


FULL = "full"
"""``MATRIX=full``: every combination of the matrix axes (``codegen/matrix.py`` defaults)."""


def make_selection(*, models: str = "", tp: str = "", matrix_name: str = "", head_sizes: str = "", gqa: str = "",
                   block_sizes: str = "", dtypes: str = "", ops: str = "", kv_heads: str = "") -> matrix.Selection:
    """The build selection from the command line's strings (``make kernels`` variables).

    - ``MODELS=<config.json>[,...]|popular [TP=...] [BLOCK_SIZES=...] [DTYPES=...]``: exactly what those
      models need (HEAD_SIZES/GQA are derived, so giving them too is an error);
    - ``MATRIX=full`` (optionally narrowed by ``HEAD_SIZES= GQA= BLOCK_SIZES= DTYPES=``): the product of axes;
    - ``HEAD_SIZES=``/``GQA=`` alone: that hand-picked product (preset ``custom``);
    - nothing: ``MODELS=popular``.
    ``OPS=`` and ``KV_HEADS=`` (the whole-page decode's kv-head counts) narrow every mode. Nothing is widened
    silently: conflicting knobs raise.
    """
    hks = matrix.parse_int_list(kv_heads, "KV_HEADS", matrix.WHOLEPAGE_KV_HEADS)
    axes_given = bool(head_sizes.strip() or gqa.strip())
    op_list = matrix.parse_str_list(ops, "OPS", None)
    if matrix_name.strip() and matrix_name.strip() != FULL:
        raise UltraQuantError(f"MATRIX: only 'full' is known, got {matrix_name!r}")
    if matrix_name.strip() or (axes_given and not models.strip()):
        if models.strip() or tp.strip():
            raise UltraQuantError("MATRIX=full builds the axes' product: MODELS/TP do not apply to it")
        narrowed = axes_given or block_sizes.strip() or dtypes.strip()
        return matrix.Selection(
            head_sizes=matrix.parse_int_list(head_sizes, "HEAD_SIZES", matrix.DEFAULT_HEAD_SIZES),
            gqa=matrix.parse_int_list(gqa, "GQA", matrix.DEFAULT_GQA),
            block_sizes=matrix.parse_int_list(block_sizes, "BLOCK_SIZES", matrix.DEFAULT_BLOCK_SIZES),
            dtypes=matrix.parse_str_list(dtypes, "DTYPES", matrix.DEFAULT_DTYPES),
            ops=op_list, kv_heads=hks, preset="custom" if narrowed else FULL)
    if axes_given:
        raise UltraQuantError("HEAD_SIZES/GQA are derived from MODELS; for a hand-picked matrix use "
                              "MATRIX=full HEAD_SIZES=... GQA=...")
    facts = resolve(models.strip() or POPULAR)
    degrees = matrix.parse_int_list(tp, "TP", DEFAULT_TP)
    blocks = matrix.parse_int_list(block_sizes, "BLOCK_SIZES", (VLLM_BLOCK_SIZE,))
    needs = derive(facts, degrees, blocks)
    forced = matrix.parse_str_list(dtypes, "DTYPES", None)
    attention = needs.attention
    if forced is not None:  # DTYPES= serves the models in other dtypes (vLLM --dtype)
        retyped = (tuple(sorted({**c, "dtype": d}.items())) for c in needs.attention for d in forced)
        attention = tuple(dict(t) for t in dict.fromkeys(retyped))
    return matrix.Selection(
        head_sizes=needs.head_sizes, gqa=needs.gqa, block_sizes=needs.block_sizes,
        dtypes=forced or needs.dtypes, ops=op_list, kv_heads=hks, attention=attention,
        preset=POPULAR if (models.strip() or POPULAR) == POPULAR else "models",
        models=tuple(f.name for f in facts), tp=degrees, notes=needs.skipped_tp)


def selection_label(selection: dict[str, Any]) -> str:
    """Short name of a manifest's ``selection`` for wheel versions and ``ultraquant info``:
    ``popular`` / ``full`` when it is exactly that preset, else the preset with 8 hex digits of the
    selection's hash appended (``models3fa9c1d2``)."""
    preset = str(selection.get("preset") or "custom")
    canonical = json.dumps(selection, sort_keys=True, separators=(",", ":"))
    if preset in (POPULAR, FULL) and canonical == _preset_canonical().get(preset):
        return preset
    # one alphanumeric word: a wheel's local version would strip leading zeros from an all-digit segment
    return f"{preset}{hashlib.sha256(canonical.encode()).hexdigest()[:8]}"


@functools.cache
def _preset_canonical() -> dict[str, str]:
    out = {}
    for name, kw in ((POPULAR, {}), (FULL, {"matrix_name": FULL})):
        try:
            out[name] = json.dumps(make_selection(**kw).as_dict(), sort_keys=True, separators=(",", ":"))
        except (UltraQuantError, OSError):  # a broken popular table must not break the label of others
            continue
    return out

