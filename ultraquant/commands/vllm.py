"""``ultraquant vllm``: is the vLLM plugin in place, and what will the cache look like?

Prints the vLLM version the adapter targets, the installed one, whether the
``vllm.general_plugins`` entry point is in the installed metadata, whether registering the backend
works here, the cache geometry for a model's head configuration, and the serve command line. With
``--model <config.json>`` the head configuration comes from the model (at ``--tp``), and it also
prints the exact ``make kernels`` line that builds the blobs this deployment asks for.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import click

from ultraquant.errors import UltraQuantError
from ultraquant.vllm import (
    BACKEND_CLASS,
    BACKEND_NAME,
    KV_CACHE_DTYPE,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    VLLM_VERSION,
    kv_cache_shape,
)

ENTRY_POINT = "ultraquant.vllm:register"


def _entry_point_found() -> bool:
    """Whether an installed distribution declares our register() as a vLLM general plugin."""
    return any(ep.value == ENTRY_POINT for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))


def _installed_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def status(head_size: int, num_kv_heads: int, block_size: int, register: bool) -> dict:
    """The facts the command prints (also its ``--json`` output)."""
    shape = kv_cache_shape(1, block_size, num_kv_heads, head_size)
    installed = _installed_vllm()
    registered: bool | None = None
    if register and installed is not None:
        from ultraquant.vllm import register as do_register

        registered = do_register()
    return {
        "targets": f"vllm=={VLLM_VERSION}",
        "installed": installed,
        "entry_point": _entry_point_found(),
        "registered": registered,
        "backend": f"{BACKEND_NAME} -> {BACKEND_CLASS}",
        "kv_cache_dtype": KV_CACHE_DTYPE,
        "block_sizes": list(SUPPORTED_BLOCK_SIZES),
        "head_sizes": list(SUPPORTED_HEAD_SIZES),
        "block_supported": block_size in SUPPORTED_BLOCK_SIZES,
        "cache_block_shape": list(shape),
        "bytes_per_token": num_kv_heads * shape[-1],
        "serve": (f"vllm serve MODEL --kv-cache-dtype {KV_CACHE_DTYPE} --attention-backend {BACKEND_NAME} "
                  f"--block-size {block_size}"),
    }


def make_line(model: str, tp: int, block_size: int, arch: str) -> str:
    """The ``make kernels`` command that builds what serving ``model`` at ``tp`` and ``block_size`` needs."""
    blocks = "" if block_size == 16 else f" BLOCK_SIZES={block_size}"
    return f"make kernels ARCH={arch} MODELS={model} TP={tp}{blocks}"


def _local_arch() -> str | None:
    """This machine's GPU arch name as the build spells it, if there is a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = getattr(props, "gcnArchName", "") or f"sm_{props.major}{props.minor}"
    return name.split(":")[0]


@click.command()
@click.option("--model", "model_path", default=None, type=click.Path(path_type=Path),
              help="A Hugging Face config.json (or a model folder holding one): head size and kv heads from it.")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="Tensor-parallel degree the model is served at (with --model).")
@click.option("--arch", default=None, help="Arch for the make line [default: this GPU's, else all three].")
@click.option("--head-size", default=128, show_default=True, help="The model's head size D.")
@click.option("--num-kv-heads", default=8, show_default=True, help="KV heads per GPU (after tensor parallel).")
@click.option("--block-size", default=16, show_default=True, help="vLLM --block-size (tokens per block).")
@click.option("--no-register", is_flag=True, help="Do not call register() (it imports vLLM).")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def command(model_path: Path | None, tp: int, arch: str | None, head_size: int, num_kv_heads: int,
            block_size: int, no_register: bool, as_json: bool) -> None:
    """Check the vLLM plugin and show the cache geometry, serve command and (with --model) the build line."""
    model_facts = None
    try:
        if model_path is not None:
            from ultraquant.codegen.models import load_config

            model_facts = load_config(model_path)
            gqa = model_facts.gqa(tp)
            head_size, num_kv_heads = model_facts.head_size, model_facts.num_heads // tp // gqa
        st = status(head_size, num_kv_heads, block_size, register=not no_register)
    except UltraQuantError as exc:
        raise click.BadParameter(str(exc)) from exc
    if model_facts is not None:
        folder = model_path if model_path.is_dir() else model_path.parent
        st["model"] = {"name": model_facts.name, "head_size": model_facts.head_size,
                       "heads": model_facts.num_heads, "kv_heads": model_facts.num_kv_heads, "tp": tp,
                       "gqa": gqa, "notes": list(model_facts.notes)}
        st["make"] = make_line(str(model_path), tp, block_size, arch or _local_arch() or "gfx942,gfx950,sm_90")
        st["serve"] = st["serve"].replace("vllm serve MODEL", f"vllm serve {folder}") + \
            (f" --tensor-parallel-size {tp}" if tp > 1 else "")
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    yes_no = {True: "yes", False: "NO", None: "not tried"}
    click.echo(f"targets        {st['targets']}")
    click.echo(f"installed      {st['installed'] or 'vllm not installed'}")
    click.echo(f"entry point    {yes_no[st['entry_point']]}"
               + ("" if st["entry_point"] else " (reinstall ultraquant: pip install -e .)"))
    click.echo(f"registered     {yes_no[st['registered']]}  ({st['backend']})")
    click.echo(f"cache dtype    {st['kv_cache_dtype']} (uint8)")
    click.echo(f"block sizes    {', '.join(map(str, st['block_sizes']))}"
               + ("" if st["block_supported"] else f"  (--block-size {block_size} is NOT one of them)"))
    click.echo(f"head sizes     {', '.join(map(str, st['head_sizes']))}")
    if "model" in st:
        m = st["model"]
        click.echo(f"model          {m['name']}: D={m['head_size']}, {m['heads']} query / {m['kv_heads']} kv heads; "
                   f"at TP={m['tp']}: {num_kv_heads} kv heads per GPU, GQA {m['gqa']}")
        for note in m["notes"]:
            click.echo(f"  note         {note}")
    click.echo(f"one block      {tuple(st['cache_block_shape'])} uint8, {st['bytes_per_token']} B per token "
               "per layer")
    if "make" in st:
        click.echo(f"build          {st['make']}")
    click.echo(f"serve          {st['serve']}")
