"""Subcommands of the `ggx` command, one module each (see ggx.cli for how they are wired)."""
