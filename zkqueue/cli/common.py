"""What every ``zkq`` command shares: connection options from the group, JSON output, exit codes
and the one place zkq errors become a message and an exit code (errors.ExitCode)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from zkqueue.client import Client
from zkqueue.connection import ConnectionSettings
from zkqueue.errors import ExitCode, ZkqError
from zkqueue.result import Result
from zkqueue.sizes import parse_size


class _Size(click.ParamType):
    """A byte size such as 512MiB or 2GB."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ZkqError as exc:
            self.fail(str(exc), param, ctx)


SIZE = _Size()
CONTEXT = {"auto_envvar_prefix": "ZKQ", "help_option_names": ["-h", "--help"]}


_CONNECTION = ("session_timeout", "connect_timeout", "auth", "tls_ca", "tls_cert", "tls_key")


def open_client(ctx: click.Context) -> Client:
    o = ctx.obj
    return Client(o["zk"], o["root"], **{k: o[k] for k in _CONNECTION})


def connection_settings(ctx: click.Context) -> ConnectionSettings:
    o = ctx.obj
    return ConnectionSettings(hosts=o["zk"], **{k: o[k] for k in _CONNECTION})


def emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=None, sort_keys=False, default=str))


def exit_for(record: Result) -> int:
    return ExitCode.OK if record.ok else ExitCode.JOB_FAILED


def handles_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn zkq errors into a one-line message on stderr and the documented exit code."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ZkqError as exc:
            click.echo(f"zkq: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper
