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
from zkqueue.errors import ExitCode, InvalidJob, JobNotFound, ZkqError
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
#: Seconds: more than zero (a timeout, an interval).
SECONDS = click.FloatRange(min=0, min_open=True)
#: A count: at least one.
COUNT = click.IntRange(min=1)
CONTEXT = {"auto_envvar_prefix": "ZKQ", "help_option_names": ["-h", "--help"]}


_CONNECTION = ("session_timeout", "connect_timeout", "auth", "tls_ca", "tls_cert", "tls_key")


def open_client(ctx: click.Context, timeout: float | None = None) -> Client:
    """A client for the group's settings; ``timeout`` (a command's --timeout) also bounds
    connecting, so the command as a whole returns within it."""
    o = ctx.obj
    settings = {k: o[k] for k in _CONNECTION}
    if timeout is not None:
        settings["connect_timeout"] = min(settings["connect_timeout"], timeout)
    return Client(o["zk"], o["root"], **settings)


def require_queue(client: Client, queue: str) -> None:
    """A queue a command was asked about by name must exist (exit 3), not read as empty."""
    if queue not in client.queue_names():
        raise JobNotFound(
            f"no queue {queue!r} (zkq queues lists them; zkq queue create {queue} makes it)"
        )


def named(ctx: click.Context, param: str) -> bool:
    """Whether the user gave ``param`` (on the command line or in the environment)."""
    source = ctx.get_parameter_source(param)
    return source in (
        click.core.ParameterSource.COMMANDLINE,
        click.core.ParameterSource.ENVIRONMENT,
    )


def checked(check: Callable[[str], str]) -> Callable[..., Any]:
    """A click callback running a zkq name check (queue, worker name) as the option arrives:
    a bad name is a usage error (exit 2) before anything connects."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return value
        try:
            return check(value)
        except InvalidJob as exc:
            raise click.BadParameter(str(exc), ctx, param) from None

    return callback


def read_stdin() -> str:
    """The prompt from stdin, which must be UTF-8 (a usage error otherwise), without the one
    line ending that ``echo`` or a text file adds."""
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJob(
            f"stdin is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None
    return text.removesuffix("\n").removesuffix("\r")


def connection_settings(ctx: click.Context) -> ConnectionSettings:
    o = ctx.obj
    return ConnectionSettings(hosts=o["zk"], **{k: o[k] for k in _CONNECTION})


def emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=None, sort_keys=False, default=str))


def exit_for(record: Result) -> int:
    return ExitCode.OK if record.ok else ExitCode.JOB_FAILED


def handles_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn zkq errors into a one-line message on stderr and the documented exit code; Ctrl-C
    into exit 130 (commands that wrote something say what before they get here)."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ZkqError as exc:
            click.echo(f"zkq: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("zkq: interrupted", err=True)
            sys.exit(ExitCode.INTERRUPTED)

    return wrapper
