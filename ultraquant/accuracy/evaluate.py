"""Score KV-cache formats on real text against the same model with a bf16 cache.

The text is split into consecutive windows of ``context`` tokens (each one sequence, as in a
standard perplexity evaluation). For each window the bf16 run is the reference; every variant is
scored on the same window: negative log-likelihood of the next token (for perplexity), the KL
divergence ``KL(p_bf16 || p_variant)`` of the next-token distributions, whether the top-1 token
agrees, and per layer the cosine between the attention output read from the variant's cache and
the one read from bf16 K/V on the same hidden states (the error each layer's cache adds by itself).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from ..errors import UltraQuantError
from .formats import Variant
from .model import LlamaWeights, forward

KL_CHUNK = 256
"""Positions per chunk when comparing (N, vocab) distributions, to bound temporary memory."""

POSITION_BIN = 128
"""Positions per bin of the reported KL-by-position curve."""


@dataclass
class VariantScore:
    """Accumulated metrics of one variant over all windows (see the module docstring)."""

    name: str
    description: str
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    top1_agree: int = 0
    tokens: int = 0
    kl_max: float = 0.0
    layer_cos_sum: list[float] = field(default_factory=list)
    layer_weight: int = 0
    kl_by_bin: list[float] = field(default_factory=list)  # KL summed per POSITION_BIN positions of a window
    count_by_bin: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / max(self.tokens, 1))

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(self.tokens, 1)

    @property
    def top1(self) -> float:
        return self.top1_agree / max(self.tokens, 1)

    @property
    def layer_cosine(self) -> list[float]:
        return [c / max(self.layer_weight, 1) for c in self.layer_cos_sum]

    def add(self, other: VariantScore) -> None:
        """Accumulate another run of the same variant (e.g. other windows scored by another process)."""
        if other.name != self.name:
            raise UltraQuantError(f"scores: cannot merge {other.name!r} into {self.name!r}")
        self.nll_sum += other.nll_sum
        self.kl_sum += other.kl_sum
        self.top1_agree += other.top1_agree
        self.tokens += other.tokens
        self.kl_max = max(self.kl_max, other.kl_max)
        self.layer_cos_sum = _add_lists(self.layer_cos_sum, other.layer_cos_sum)
        self.layer_weight += other.layer_weight
        self.kl_by_bin = _add_lists(self.kl_by_bin, other.kl_by_bin)
        self.count_by_bin = _add_lists(self.count_by_bin, other.count_by_bin)
        self.seconds += other.seconds

    def totals(self) -> dict:
        """The raw accumulators (what :func:`merge_reports` adds up)."""
        return asdict(self)

    @classmethod
    def from_totals(cls, totals: dict) -> VariantScore:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in totals.items() if k in names})

    def kl_position_curve(self) -> list[float]:
        """Mean KL per bin of POSITION_BIN positions inside a window (up to the last bin reached)."""
        return [k / c for k, c in zip(self.kl_by_bin, self.count_by_bin, strict=True) if c]

    def summary(self, baseline_ppl: float) -> dict:
        """The JSON record of this variant (PPL, its change vs bf16, KL, top-1, per-layer cosine)."""
        cos = self.layer_cosine
        return {
            "name": self.name,
            "description": self.description,
            "tokens": self.tokens,
            "ppl": self.ppl,
            "ppl_delta": self.ppl - baseline_ppl,
            "mean_kl": self.mean_kl,
            "max_kl": self.kl_max,
            "top1_agreement": self.top1,
            "attn_cosine_mean": sum(cos) / len(cos) if cos else 1.0,
            "attn_cosine_min": min(cos) if cos else 1.0,
            "attn_cosine_per_layer": cos,
            "kl_position_bin": POSITION_BIN,
            "kl_by_position": self.kl_position_curve(),
            "seconds": self.seconds,
            "totals": self.totals(),
        }


def _add_lists(a: list, b: list) -> list:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def windows(tokens: Sequence[int], context: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Consecutive non-overlapping windows of at most ``context`` tokens (the last may be shorter,
    but not shorter than 2 tokens: a window must predict at least one token)."""
    if context < 2:
        raise UltraQuantError(f"context: expected >= 2 tokens, got {context}")
    ids = list(tokens)[: max_tokens] if max_tokens else list(tokens)
    out = [torch.tensor(ids[i:i + context], dtype=torch.int64) for i in range(0, len(ids), context)]
    out = [w for w in out if w.numel() >= 2]
    if not out:
        raise UltraQuantError("tokens: the text has fewer than 2 tokens")
    return out


def _token_stats(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: NLL of the target under ``logits``, KL(ref || logits), top-1 agreement."""
    nll, kl, agree = [], [], []
    for a in range(0, targets.numel(), KL_CHUNK):
        r = torch.log_softmax(ref_logits[a:a + KL_CHUNK].double(), dim=-1)
        q = torch.log_softmax(logits[a:a + KL_CHUNK].double(), dim=-1)
        nll.append(-q.gather(1, targets[a:a + KL_CHUNK, None]).squeeze(1))
        kl.append((r.exp() * (r - q)).sum(-1).clamp_min(0.0))
        agree.append(r.argmax(-1) == q.argmax(-1))
    return torch.cat(nll), torch.cat(kl), torch.cat(agree)


def evaluate(weights: LlamaWeights, tokens: Sequence[int], variants: Sequence[Variant], *,
             context: int = 2048, max_tokens: int | None = None, only_windows: Sequence[int] | None = None,
             log: Callable[[str], None] | None = None) -> list[VariantScore]:
    """Score ``variants`` (the first must be the bf16 baseline) on ``tokens``; see the module doc.

    ``only_windows`` scores only those window indices (to split a long run over processes and add
    the results with :func:`merge_reports`).
    """
    if not variants or variants[0].name != "bf16":
        raise UltraQuantError("variants: the first variant must be the bf16 baseline")
    scores = [VariantScore(v.name, v.description) for v in variants]
    n_layers = weights.config.n_layers
    for s in scores:
        s.layer_cos_sum = [0.0] * n_layers
        s.kl_by_bin = [0.0] * -(-context // POSITION_BIN)
        s.count_by_bin = [0] * -(-context // POSITION_BIN)
    wins = windows(tokens, context, max_tokens)
    if only_windows is not None:
        bad = [i for i in only_windows if not 0 <= i < len(wins)]
        if bad:
            raise UltraQuantError(f"only_windows: {bad} out of range 0..{len(wins) - 1}")
    for wi, win in enumerate(wins):
        if only_windows is not None and wi not in only_windows:
            continue
        targets = win[1:]
        ref_logits = None
        for variant, score in zip(variants, scores, strict=True):
            t0 = time.perf_counter()
            with torch.no_grad():
                res = forward(weights, win, variant.transform, measure_layers=variant.name != "bf16")
            logits = res.logits[:-1]
            if ref_logits is None:
                ref_logits = logits
            nll, kl, agree = _token_stats(ref_logits, logits, targets)
            score.nll_sum += float(nll.sum())
            score.kl_sum += float(kl.sum())
            score.kl_max = max(score.kl_max, float(kl.max()))
            score.top1_agree += int(agree.sum())
            score.tokens += int(targets.numel())
            for p, value in enumerate(kl.tolist()):
                score.kl_by_bin[p // POSITION_BIN] += value
                score.count_by_bin[p // POSITION_BIN] += 1
            cos = res.attn_cosine or [1.0] * n_layers
            w = int(win.numel())
            score.layer_cos_sum = [a + c * w for a, c in zip(score.layer_cos_sum, cos, strict=True)]
            score.layer_weight += w
            score.seconds += time.perf_counter() - t0
            if log is not None:
                log(f"window {wi + 1}/{len(wins)} ({w} tokens) {variant.name}: "
                    f"nll {float(nll.mean()):.4f} kl {float(kl.mean()):.5f} "
                    f"({time.perf_counter() - t0:.1f} s)")
    return scores


def report(scores: Sequence[VariantScore], meta: dict) -> dict:
    """The JSON document: run metadata plus one summary per variant and relative KL changes."""
    base = scores[0].ppl
    rows = [s.summary(base) for s in scores]
    by_name = {r["name"]: r for r in rows}
    up = by_name.get("uq-upstream")
    if up and up["mean_kl"] > 0:
        for r in rows:
            if r["name"].startswith("uq-"):
                r["kl_change_vs_upstream"] = r["mean_kl"] / up["mean_kl"] - 1.0
    return {"meta": meta, "variants": rows}


def merge_reports(docs: Sequence[dict]) -> list[VariantScore]:
    """Add up the raw totals of several reports of the same variants (e.g. disjoint windows)."""
    if not docs:
        raise UltraQuantError("docs: nothing to merge")
    merged = [VariantScore.from_totals(r["totals"]) for r in docs[0]["variants"]]
    for doc in docs[1:]:
        rows = doc["variants"]
        if [r["name"] for r in rows] != [s.name for s in merged]:
            raise UltraQuantError("docs: the reports compare different variants")
        for s, r in zip(merged, rows, strict=True):
            s.add(VariantScore.from_totals(r["totals"]))
    return merged


def table(doc: dict) -> str:
    """A Markdown table of the JSON document (the one docs/accuracy.md and the README carry)."""
    lines = [
        "| KV cache | PPL | dPPL | mean KL | KL vs upstream | top-1 agree | attn cos (mean / min layer) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["variants"]:
        rel = r.get("kl_change_vs_upstream")
        rel_s = f"{rel * 100:+.1f}%" if rel is not None else ""
        lines.append(
            f"| {r['description']} | {r['ppl']:.3f} | {r['ppl_delta']:+.3f} | {r['mean_kl']:.4f} | {rel_s} | "
            f"{r['top1_agreement'] * 100:.2f}% | {r['attn_cosine_mean']:.5f} / {r['attn_cosine_min']:.5f} |")
    return "\n".join(lines)

