"""The ``zkq`` command line (``zkqueue.cli.main``)."""

from __future__ import annotations

from zkqueue.cli.main import cli, main

__all__ = ["cli", "main"]
