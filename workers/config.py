"""Worker configuration files (TOML) and their precedence.

Precedence, highest first: command-line flags, the ``--config`` file, ``ZKQ_*`` environment
variables, built-in defaults (zkqueue/defaults.py). The file is flat: every ``zkq worker`` option
and the connection options (``zk``, ``root``, ``session_timeout``...) by name, with ``-`` or ``_``;
an optional ``[worker]`` table is read the same way. Unknown keys are an error.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from zkqueue.cli.common import given_on_command_line
from zkqueue.errors import ConfigurationError


def read_config(path: str | Path) -> dict[str, Any]:
    """The file's settings with keys normalised to option names (underscores)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigurationError(f"cannot read worker config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"worker config {path} is not valid TOML: {exc}") from None
    table = dict(raw)
    nested = table.pop("worker", {})
    if not isinstance(nested, Mapping):
        raise ConfigurationError(f"worker config {path}: [worker] must be a table")
    return {k.replace("-", "_"): v for k, v in {**table, **nested}.items()}


def apply_config(ctx: click.Context, options: dict[str, Any], path: str | Path) -> None:
    """Fill ``options`` (the worker command's) and ``ctx.obj`` (the global connection options)
    from the file, except where a flag on the command line already set them."""
    settings = read_config(path)
    globals_ctx = ctx.parent
    for key, value in settings.items():
        if key in options and key != "config":
            if ctx.get_parameter_source(key) != ParameterSource.COMMANDLINE:
                options[key] = _convert(ctx.command, ctx, key, value, path)
        elif globals_ctx is not None and key in globals_ctx.params:
            # A connection option may be given before or after the command name.
            if not given_on_command_line(ctx, key):
                ctx.obj[key] = _convert(globals_ctx.command, globals_ctx, key, value, path)
        else:
            raise ConfigurationError(f"worker config {path}: unknown setting {key!r}")


def _convert(
    command: click.Command, ctx: click.Context, key: str, value: Any, path: str | Path
) -> Any:
    param = next(p for p in command.params if p.name == key)
    try:
        return param.type_cast_value(ctx, value)
    except click.BadParameter as exc:
        raise ConfigurationError(f"worker config {path}: {key}: {exc.message}") from None
