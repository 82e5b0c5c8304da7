"""What every ``zkq`` command shares: its connection options, JSON output, exit codes and the one
place zkq errors become a message and an exit code (errors.ExitCode).

The connection options (``--zk``, ``--root``, ``--auth``, the TLS files, the session and connect
timeouts) are defined once and accepted on either side of a command's name: ``zkq --zk H stats``
and ``zkq stats --zk H`` mean the same, for every command, plugin commands and group subcommands
(``zkq queue create Q --zk H``) included. The ``zkq`` group takes them with ``group_options``
and stores what they resolve to (command line, else ``ZKQ_*`` environment, else the default) in
``ctx.obj``, the dict every command reads. ``ConnectionGroup`` gives each command added to it
the same options again (``connection_options``); one given there on the command line replaces
the group's value, so a value after the command's name wins over one before it. A command run
without the group (``python -m gateway``) takes them with ``connection_options`` too, and then
resolves them itself."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from zkqueue import defaults
from zkqueue.errors import ConfigurationError, ExitCode, InvalidJob, JobNotFound, ZkqError
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.plumbing.sizes import parse_size
from zkqueue.producer.client import Client
from zkqueue.protocol.layout import check_root
from zkqueue.protocol.result import Result


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


def open_client(ctx: click.Context, timeout: float | None = None) -> Client:
    """A client for the connection options; ``timeout`` (a command's --timeout) also bounds
    connecting, so the command as a whole returns within it."""
    given = connection(ctx)
    if timeout is not None:
        given["connect_timeout"] = min(given["connect_timeout"], timeout)
    return Client(given.pop("zk"), given.pop("root"), **given)


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
    """The connection options (given before or after the command name) as settings."""
    given = connection(ctx)
    del given["root"]
    return ConnectionSettings(hosts=given.pop("zk"), **given)


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


# -- the connection options ------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


class _Timeout(click.ParamType):
    """A timeout: a finite number of seconds above 0."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds <= 0:
            self.fail(f"{value!r} is not a finite number of seconds above 0", param, ctx)
        return seconds


_TIMEOUT = _Timeout()


@dataclass(frozen=True)
class _Setting:
    """One connection option: its name, flag, environment variable, default and help."""

    name: str
    envvar: str
    default: Any
    help: str
    type: click.ParamType | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def fallback(self) -> Any:
        """The value without any option given: the environment's, else the default."""
        value = os.environ.get(self.envvar)
        if not value:
            return self.default
        return self.type.convert(value, None, None) if self.type is not None else value


SETTINGS = (
    _Setting(
        "zk",
        "ZKQ_ZK",
        defaults.HOSTS,
        "ZooKeeper connection string (host:port[,host:port...]).",
        metavar="HOSTS",
    ),
    _Setting(
        "root", "ZKQ_ROOT", defaults.ROOT, "Root znode of this zkq installation.", metavar="ZNODE"
    ),
    _Setting(
        "session_timeout",
        "ZKQ_SESSION_TIMEOUT",
        defaults.SESSION_TIMEOUT,
        "Session timeout, seconds.",
        _TIMEOUT,
        "SECONDS",
    ),
    _Setting(
        "connect_timeout",
        "ZKQ_CONNECT_TIMEOUT",
        defaults.CONNECT_TIMEOUT,
        "Give up reaching ZooKeeper after this many seconds.",
        _TIMEOUT,
        "SECONDS",
    ),
    _Setting(
        "auth",
        "ZKQ_AUTH",
        None,
        "Digest authentication; zkq's nodes are then readable and writable by this identity only.",
        metavar="USER:PASSWORD",
    ),
    _Setting("tls_ca", "ZKQ_TLS_CA", None, "CA file: connect with TLS.", metavar="FILE"),
    _Setting("tls_cert", "ZKQ_TLS_CERT", None, "Client certificate (PEM).", metavar="FILE"),
    _Setting("tls_key", "ZKQ_TLS_KEY", None, "Client key (PEM).", metavar="FILE"),
)
#: The connection settings' names, as ``ctx.obj`` keys them.
NAMES = tuple(s.name for s in SETTINGS)


def _checked_root(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A bad ``--root`` is a configuration error (one line, its exit code) wherever it is given."""
    if value is None:
        return value
    try:
        return check_root(value)
    except ConfigurationError as exc:
        click.echo(f"zkq: {exc}", err=True)
        sys.exit(exc.exit_code)


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Put a connection option's value into ``ctx.obj`` (the group's dict, shared with its
    subcommands): one given on the command line always (a later one replaces an earlier one),
    any other only where nothing is there yet (a command run without the group)."""
    value = _checked_root(ctx, param, value) if param.name == "root" else value
    settings = ctx.ensure_object(dict)
    assert param.name is not None
    if ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE or (
        param.name not in settings
    ):
        settings[param.name] = value
    return value


def _options(*, group: bool) -> list[click.Option]:
    """Fresh option objects for one command (``group``: the ``zkq`` group's, whose values the
    group's callback receives; otherwise a command's, which only update ``ctx.obj``)."""
    return [
        click.Option(
            [s.flag],
            callback=_callback(s.name, group),
            type=s.type,
            default=s.default,
            envvar=s.envvar,
            show_envvar=True,
            show_default=s.default is not None,
            metavar=s.metavar,
            help=s.help,
            expose_value=group,
            allow_from_autoenv=False,
        )
        for s in SETTINGS
    ]


def _callback(name: str, group: bool) -> Callable[..., Any] | None:
    """The group's options pass their values to its callback (``--root`` checked first); a
    command's store theirs in ``ctx.obj``."""
    if not group:
        return _store
    return _checked_root if name == "root" else None


def group_options(func: F) -> F:
    """Decorate the ``zkq`` group: its callback receives the connection options as keywords."""
    return _decorate(func, _options(group=True))


def connection_options(command: click.Command) -> click.Command:
    """Give ``command`` (and, for a group, each of its commands) the connection options; their
    values go into ``ctx.obj``. Applying it twice changes nothing."""
    if not any(p.name == "zk" for p in command.params):
        command.params.extend(_options(group=False))
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            connection_options(sub)
    return command


def _decorate(func: F, options: list[click.Option]) -> F:
    """Attach ``options`` to a function click will make into a command, in their order."""
    params: list[click.Parameter] = func.__dict__.setdefault("__click_params__", [])
    # click reverses the decorators' list, so the last appended comes first.
    params.extend(reversed(options))
    return func


def given_on_command_line(ctx: click.Context, name: str) -> bool:
    """Whether connection option ``name`` was given on the command line, before or after the
    command name (config files fill in only what was not)."""
    here: click.Context | None = ctx
    while here is not None:
        if here.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            return True
        here = here.parent
    return False


def connection(ctx: click.Context) -> dict[str, Any]:
    """The resolved connection settings, ``zk`` and ``root`` included (the group's, or a
    standalone command's own; the environment's or the defaults for any it lacks)."""
    obj = ctx.ensure_object(dict)
    return {s.name: obj[s.name] if s.name in obj else s.fallback() for s in SETTINGS}


#: The group's help says once where the connection options go.
EPILOG = (
    "Connection options (--zk, --root, the timeouts, --auth, --tls-*) may be given before or "
    "after the command name (zkq --zk H stats, zkq stats --zk H); after it wins."
)


class ConnectionGroup(click.Group):
    """A group whose commands take the connection options after their name too."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        super().add_command(connection_options(cmd), name)
