"""The `graphpar` command line (`main`); one module per group of subcommands."""

from graphpar.cli.main import main

__all__ = ["main"]
