"""The ``zkq`` command: it only maps options onto library calls. Exit codes: errors.ExitCode.

The library's commands are added here; packages built on the library (the worker daemon, the
HTTP gateway) add theirs through the ``zkq.commands`` entry-point group, so nothing in the library
imports them. A plugin that cannot be imported (its extra is not installed) still shows up, and
says what to install. Every command takes the connection options on either side of its name
(``zkqueue.cli.common``).
"""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import click

from zkqueue.cli import jobs, ops, queues
from zkqueue.cli.common import CONTEXT, EPILOG, ConnectionGroup, group_options
from zkqueue.errors import ExitCode
from zkqueue.plumbing.logs import configure as configure_logging


@click.group(cls=ConnectionGroup, context_settings=CONTEXT, epilog=EPILOG)
@group_options
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    envvar="ZKQ_LOG_FORMAT",
    help="json: one JSON object per line, for log aggregation.",
)
@click.option(
    "--log-level",
    default="WARNING",
    envvar="ZKQ_LOG_LEVEL",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.pass_context
def cli(
    ctx: click.Context,
    zk: str,
    root: str,
    session_timeout: float,
    connect_timeout: float,
    log_level: str,
    log_format: str,
    **security: str | None,
) -> None:
    """zkq: a priority job queue for GPU inference on ZooKeeper.

    \b
    Examples:
      zkq worker --queue default --runner echo &
      zkq submit --priority high "Hello"
      zkq submit --detach --json "Summarize this" | jq -r .id
      zkq status ID; zkq result ID --wait --timeout 60
    """
    configure_logging(log_level, log_format)
    ctx.obj = {
        "zk": zk,
        "root": root,
        "session_timeout": session_timeout,
        "connect_timeout": connect_timeout,
        **security,
    }


for _command in (
    jobs.submit,
    jobs.result,
    jobs.status,
    jobs.cancel,
    jobs.ls,
    ops.stats,
    ops.workers,
    ops.dead,
    ops.requeue,
    queues.queues,
    queues.queue,
    queues.queue_limit,
    ops.migrate,
    ops.top,
    ops.metrics,
    ops.completion,
):
    cli.add_command(_command)


def _add_plugins(group: click.Group) -> None:
    for point in entry_points(group="zkq.commands"):
        try:
            command = point.load()
        except ImportError as exc:
            command = _missing(point, exc)
        group.add_command(command, point.name)


def _missing(point: EntryPoint, exc: ImportError) -> click.Command:
    """A stand-in for a plugin whose imports fail: it says what is missing (exit 7)."""
    extra = point.value.split(".", 1)[0]

    def explain(**_: Any) -> None:
        click.echo(
            f"zkq: '{point.name}' needs packages that are not installed ({exc}); "
            f"install them with: pip install 'zkq[{extra}]'",
            err=True,
        )
        sys.exit(ExitCode.CONFIG)

    return click.Command(
        point.name,
        callback=explain,
        help=f"(not installed: pip install 'zkq[{extra}]')",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


_add_plugins(cli)


def main() -> None:
    """Run ``zkq``: a usage error is one line on stderr naming the command (exit 2), Ctrl-C
    outside a command is exit 130."""
    try:
        code = cli.main(prog_name="zkq", standalone_mode=False)
    except click.ClickException as exc:
        where = exc.ctx.command_path if getattr(exc, "ctx", None) else "zkq"  # type: ignore[attr-defined]
        click.echo(f"{where}: {exc.format_message()} (see {where} --help)", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("zkq: interrupted", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    sys.exit(code if isinstance(code, int) else ExitCode.OK)
