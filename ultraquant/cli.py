"""The ``ultraquant`` command line: a click group whose subcommands live in ultraquant/commands/."""

from __future__ import annotations

import importlib

import click

# Subcommand modules, each exposing a click command named ``command``; imported lazily so that
# `ultraquant info` works without the build toolchain or a GPU.
COMMANDS: tuple[str, ...] = (
    "info",
    "build",
    "verify",
    "bench",
    "accuracy",
    "vllm",
)


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return importlib.import_module(f"ultraquant.commands.{name}").command


@click.group(cls=_LazyGroup)
@click.version_option(package_name="ultraquant")
def main() -> None:
    """UltraQuant: 4-bit KV-cache attention kernels, compiled ahead of time."""


if __name__ == "__main__":
    main()
