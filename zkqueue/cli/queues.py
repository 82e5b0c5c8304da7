"""Queue commands: ``queues`` (every queue with its workers, limits and depth), ``queue create``,
``queue delete``, ``queue tenant`` (a tenant's weight and cap) and ``queue-limit`` (show, set or
remove an existing queue's limits and aging)."""

from __future__ import annotations

from typing import Any

import click

from zkqueue.cli.common import SECONDS, checked, emit, handles_errors, open_client, require_queue
from zkqueue.producer.client import Client
from zkqueue.protocol.layout import check_queue, check_tenant
from zkqueue.protocol.limits import LIMITS, MAX_LIMIT, MAX_WEIGHT, QueueSettings

_NONE = ("none", "unlimited")


class _Limit(click.ParamType):
    """A limit: a count of at least 1, or ``none`` to remove it."""

    name = "N|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or isinstance(value, int):
            return value
        if str(value).lower() in _NONE:
            return "none"
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a whole number or 'none'", param, ctx)
        if number < 1:
            self.fail(f"{number} is below 1 (use 'none' to remove the limit)", param, ctx)
        if number > MAX_LIMIT:  # producers in other languages read it as a 32-bit int
            self.fail(f"{number} is above {MAX_LIMIT} (use 'none' for no limit)", param, ctx)
        return number


LIMIT = _Limit()


def _limits_text(settings: QueueSettings | dict[str, Any]) -> str:
    get = settings.get if isinstance(settings, dict) else lambda k: getattr(settings, k)
    parts = [f"{k.replace('_', ' ')} {get(k) or 'unlimited'}" for k in LIMITS]
    if get("promote_after"):
        parts.append(f"promote after {get('promote_after'):g}s")
    tenants = get("tenants") or {}
    for name, tenant in sorted(tenants.items()):
        raw = tenant if isinstance(tenant, dict) else tenant.to_dict()
        cap = f", max pending {raw['max_pending']}" if raw.get("max_pending") else ""
        parts.append(f"tenant {name}: weight {raw.get('weight', 1):g}{cap}")
    return ", ".join(parts)


class _Seconds(click.ParamType):
    """Seconds (more than 0), or ``none`` to turn the setting off."""

    name = "SECONDS|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or isinstance(value, float):
            return value
        if str(value).lower() in _NONE:
            return "none"
        return SECONDS.convert(value, param, ctx)


_PROMOTE_AFTER = click.option(
    "--promote-after",
    type=_Seconds(),
    default=None,
    help="Aging: a job that waited SECONDS is dispatched a priority up (two after twice that); "
    "'none' turns it off.",
)


def _set_promote(client: Client, name: str, promote_after: float | str | None) -> None:
    if promote_after is not None:
        seconds = None if promote_after == "none" else float(promote_after)
        with client.mapped():
            client.limits.set_promote_after(name, seconds)


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def queues(ctx: click.Context, as_json: bool) -> None:
    """List every queue: the workers serving it, its limits, waiting and running jobs.

    \b
    Example:
      zkq queues
      zkq queues --json | jq '.[] | select(.workers == [])'
    """
    with open_client(ctx) as client:
        rows = client.queues()
    if as_json:
        emit(rows)
        return
    if not rows:
        click.echo("no queues")
        return
    click.echo(f"{'QUEUE':<16} {'WAITING':>7} {'RUNNING':>7} {'DEAD':>5}  LIMITS / WORKERS")
    for r in rows:
        workers = ", ".join(r["workers"]) or "no worker"
        click.echo(
            f"{r['queue']:<16} {r['waiting']:>7} {r['running']:>7} {r['dead']:>5}  "
            f"{_limits_text(r)}; {workers}"
        )


@click.group()
def queue() -> None:
    """Manage one queue.

    \b
    Examples:
      zkq queue create llama --max-pending 1000
      zkq queue delete scratch
    """


_MAX_PENDING = click.option(
    "--max-pending", type=LIMIT, default=None, help="Most jobs that may wait."
)
_MAX_RUNNING = click.option(
    "--max-running",
    type=LIMIT,
    default=None,
    help="Most jobs of the queue running at once, across all workers.",
)


@queue.command("create")
@click.argument("name", callback=checked(check_queue))
@_MAX_PENDING
@_MAX_RUNNING
@_PROMOTE_AFTER
@click.pass_context
@handles_errors
def create(
    ctx: click.Context,
    name: str,
    max_pending: int | str | None,
    max_running: int | str | None,
    promote_after: float | str | None,
) -> None:
    """Create queue NAME, with limits if given. A queue that exists keeps its jobs, and of its
    limits only those given change. Workers and producers also create the queues they use.

    \b
    Example:
      zkq queue create llama --max-pending 1000 --max-running 8
      zkq queue create batch --promote-after 300
    """
    changes = _changes(False, max_pending, max_running)
    with open_client(ctx) as client:
        existed = name in client.queue_names()
        with client.mapped():
            client.ensure_queue(name)
        if changes:
            client.set_limits(name, **changes)
        _set_promote(client, name, promote_after)
        with client.mapped():
            settings = client.limits.settings(name)
    done = f"queue {name} exists" if existed else f"created queue {name}"
    click.echo(f"{done}: {_limits_text(settings)}")


@queue.command("delete")
@click.argument("name", callback=checked(check_queue))
@click.option("--force", is_flag=True, help="Delete even while jobs wait or run.")
@click.pass_context
@handles_errors
def delete(ctx: click.Context, name: str, force: bool) -> None:
    """Delete queue NAME with its results and dead letters (refused while a worker serves it,
    and while jobs wait or run unless --force: exit 5; a job submitted during the delete stops
    it, and the queue stays with that job).

    \b
    Example:
      zkq queue delete scratch
      zkq queue delete scratch --force     # running jobs' results are lost
    """
    with open_client(ctx) as client:
        require_queue(client, name)
        stats = client.delete_queue(name, force=force)
    click.echo(
        f"deleted queue {name} ({stats['waiting']} waiting, {stats['running']} running, "
        f"{stats['results']} results, {stats['dead']} dead letters)"
    )


@click.command("queue-limit")
@click.argument("name", metavar="QUEUE", callback=checked(check_queue))
@click.argument("clear", metavar="[none]", required=False, type=click.Choice(_NONE))
@_MAX_PENDING
@_MAX_RUNNING
@_PROMOTE_AFTER
@click.pass_context
@handles_errors
def queue_limit(
    ctx: click.Context,
    name: str,
    clear: str | None,
    max_pending: int | str | None,
    max_running: int | str | None,
    promote_after: float | str | None,
) -> None:
    """Show QUEUE's limits, set them, or remove them all with 'none'. Beyond max pending, submit
    fails fast (exit 5); beyond max running, jobs wait for a running one to end. The queue must
    exist (exit 3; zkq queue create makes one).

    \b
    Examples:
      zkq queue-limit llama                       # show
      zkq queue-limit llama --max-pending 1000 --max-running 8
      zkq queue-limit llama --max-running none    # remove one
      zkq queue-limit llama none                  # remove both
      zkq queue-limit llama --promote-after 120   # aging on (none: off)
    """
    changes = _changes(clear is not None, max_pending, max_running)
    with open_client(ctx) as client:
        require_queue(client, name)  # a misspelt name must not make a queue nobody serves
        if changes:
            client.set_limits(name, **changes)
        _set_promote(client, name, promote_after)
        with client.mapped():
            settings = client.limits.settings(name)
    click.echo(f"{name}: {_limits_text(settings)}")


@queue.command("tenant")
@click.argument("name", metavar="QUEUE", callback=checked(check_queue))
@click.argument("tenant", callback=checked(check_tenant))
@click.option(
    "--weight",
    type=click.FloatRange(0, MAX_WEIGHT, min_open=True),
    default=None,
    help="The tenant's share of service inside a priority, against others' (default 1).",
)
@_MAX_PENDING
@click.option("--remove", is_flag=True, help="Forget the tenant's settings (weight 1, no cap).")
@click.pass_context
@handles_errors
def tenant(
    ctx: click.Context,
    name: str,
    tenant: str,
    weight: float | None,
    max_pending: int | str | None,
    remove: bool,
) -> None:
    """Set TENANT's fair-share weight and its own cap of waiting jobs in QUEUE. Inside a
    priority, the workers serve backlogged tenants in proportion to their weights (counted in
    tokens); a tenant at its cap is refused more jobs (exit 5). The queue must exist (exit 3).

    
    Examples:
      zkq queue tenant llama team-a --weight 3
      zkq queue tenant llama backfill --max-pending 2000
      zkq queue tenant llama backfill --max-pending none
    """
    if remove and (weight is not None or max_pending is not None):
        raise click.UsageError("give --remove alone, or --weight/--max-pending")
    with open_client(ctx) as client:
        require_queue(client, name)
        with client.mapped():
            limits = client.limits
            if max_pending == "none":  # remove the cap, keep the weight
                kept = limits.settings(name).tenant(tenant).weight
                limits.set_tenant(name, tenant, remove=True)
                settings = limits.set_tenant(name, tenant, weight=weight or kept)
            else:
                cap = None if max_pending is None else int(max_pending)
                settings = limits.set_tenant(name, tenant, weight, cap, remove=remove)
    click.echo(f"{name}: {_limits_text(settings)}")


def _changes(
    clear: bool, max_pending: int | str | None, max_running: int | str | None
) -> dict[str, int | None]:
    """The limits to set: those given ('none' removes one), or both removed by ``clear``."""
    given = {k: v for k, v in (("max_pending", max_pending), ("max_running", max_running)) if v}
    if clear and given:
        raise click.UsageError("give 'none' or --max-pending/--max-running, not both")
    return dict.fromkeys(LIMITS) if clear else {k: _value(v) for k, v in given.items()}


def _value(value: int | str) -> int | None:
    return None if value == "none" else int(value)
