"""``ultraquant bench``: the command line of :mod:`ultraquant.bench.decode` (needs a CUDA GPU)."""

from __future__ import annotations

import importlib.util
import json

import click
import torch

from ultraquant.bench.decode import SHAPES, run_bench, run_prefill_bench, run_serving_bench


@click.command()
@click.option("--shapes", default="A,B,C,D", show_default=True, help="Comma-separated shape names.")
@click.option("--layouts", default="head,token", show_default=True,
              help="Cache layouts to time: head (head-major inside a block), token (upstream's).")
@click.option("--plot", default=None, help="Write a PNG of latency vs context length here.")
@click.option("--json", "json_path", default=None, help="Write all numbers to this JSON file.")
@click.option("--no-stream", is_flag=True, help="Skip the no-math page stream rows.")
@click.option("--sweep", "sweep_shapes", default="", help="Shapes (e.g. A,D) to time decode variants on.")
@click.option("--store-variants", is_flag=True,
              help="Also time the store kernel's launch shapes (rows per program, warps); with --shapes '' "
                   "only the ceiling and the store rows run.")
@click.option("--prefill", is_flag=True,
              help="Only time the prefill continuation routes (kernel vs dequant + SDPA) and suggest the threshold.")
@click.option("--serving", is_flag=True,
              help="Only time the serving batches (ragged lengths, block 16, GQA 16, one kv head, token-major "
                   "pages, A-D at block 16) against this run's ceiling and bf16 SDPA.")
@click.option("--serving-rows", default="", help="With --serving: only rows whose name contains one of these "
              "comma-separated strings.")
@click.option("--no-aot", is_flag=True, help="With --serving: skip the JIT/AOT pair of rows (the policy's row only).")
@click.option("--spec-decode", "spec_decode", is_flag=True,
              help="Only time speculative-decoding steps (2, 4, 8 new tokens) against one decode step (A geometry "
                   "at block 16, and a ragged batch).")
@click.option("--host", is_flag=True,
              help="Only time the host cost per eager decode/store call, AOT blobs vs Triton JIT (needs blobs).")
def command(shapes: str, layouts: str, plot: str | None, json_path: str | None, no_stream: bool,
            sweep_shapes: str, store_variants: bool, prefill: bool, serving: bool, serving_rows: str,
            no_aot: bool, spec_decode: bool, host: bool) -> None:
    """Time decode and store on this GPU against the read ceiling and bf16 SDPA (needs CUDA)."""
    if not torch.cuda.is_available():
        raise click.ClickException("ultraquant bench needs a CUDA GPU")
    if importlib.util.find_spec("triton") is None:
        raise click.ClickException("ultraquant bench also times Triton kernels (the read ceiling, the JIT "
                                   "decode): pip install triton")
    if host:
        from ultraquant.bench.host import format_rows, run_host_bench

        rows = run_host_bench()
        click.echo(format_rows(rows))
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"host_us": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)
        return
    if serving or spec_decode:
        if serving:
            picked = [x.strip() for x in serving_rows.split(",") if x.strip()] or None
            result = run_serving_bench(aot_vs_jit=not no_aot, names=picked)
        else:
            from ultraquant.bench.specdecode import run_spec_decode_bench

            result = run_spec_decode_bench()
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
        return
    if prefill:
        result = run_prefill_bench()
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
        return
    names = [s.strip() for s in shapes.split(",") if s.strip()]
    bad = [n for n in names if n not in SHAPES]
    if bad:
        raise click.BadParameter(f"unknown shapes {bad}; known: {sorted(SHAPES)}", param_hint="--shapes")
    result = run_bench(names, plot, [x.strip() for x in layouts.split(",")], not no_stream,
                       [x.strip() for x in sweep_shapes.split(",") if x.strip()], store_variants=store_variants)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
