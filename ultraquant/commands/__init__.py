"""Subcommands of the ``ultraquant`` CLI, one module each (registered in ultraquant.cli.COMMANDS)."""
