"""The accuracy run's figure: per-layer attention error and KL by position, one line per format."""

from __future__ import annotations

from pathlib import Path


def save_plot(doc: dict, path: Path | str) -> Path:
    """Write a PNG of a report (``evaluate.report``) with two panels: 1 - attention cosine per layer
    (log scale), and the mean next-token KL vs bf16 per position bin inside a window."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on CI machines
    import matplotlib.pyplot as plt

    fig, (ax_layer, ax_pos) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in doc["variants"]:
        if r["name"] == "bf16":
            continue
        err = [max(1.0 - c, 1e-7) for c in r["attn_cosine_per_layer"]]
        ax_layer.plot(range(len(err)), err, marker=".", label=r["name"])
        step = r["kl_position_bin"]
        xs = [(i + 0.5) * step for i in range(len(r["kl_by_position"]))]
        ax_pos.plot(xs, r["kl_by_position"], marker=".", label=f"{r['name']} (mean {r['mean_kl']:.3f})")
    for ax, xlabel, ylabel, title in (
            (ax_layer, "layer", "1 - cos(attn output, attn output with bf16 K/V)",
             "Attention error each layer's cache adds"),
            (ax_pos, "position in the window", "mean KL(bf16 || format) of the next token",
             "Next-token KL vs the bf16 cache")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = doc.get("meta", {})
    fig.suptitle(f"{meta.get('model', 'model')}: {meta.get('tokens', '?')} tokens of "
                 f"{meta.get('text', 'text')}, windows of {meta.get('context', '?')}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
