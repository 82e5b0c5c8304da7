"""Operator commands: stats, workers, dead letters, requeue, queue limits, top, metrics and shell
completion."""

from __future__ import annotations

from typing import Any

import click

from zkqueue.cli.common import (
    SECONDS,
    checked,
    emit,
    handles_errors,
    open_client,
    require_queue,
)
from zkqueue.protocol.layout import DEFAULT_TENANT, check_job_id, check_queue


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Per queue: jobs waiting, running, the limits, depth by priority (running jobs included),
    idle workers, results, dead letters; then the number of workers.

    \b
    Example:
      zkq stats
      zkq stats --json | jq '.queues.default.waiting'
    """
    with open_client(ctx) as client:
        data = client.stats()
    if as_json:
        emit(data)
        return
    for name, q in data["queues"].items():
        depth = " ".join(f"{p}={n}" for p, n in q["depth"].items())
        limits = " ".join(f"{k}={q[k] or 'none'}" for k in ("max_pending", "max_running") if k in q)
        if q.get("promote_after"):
            limits += f" promote_after={q['promote_after']:g}s"
        click.echo(
            f"{name}: waiting={q['pending']} running={q['running']} {limits}  ({depth})  "
            f"idle_workers={q['idle_workers']} results={q['results']} dead={q['dead']}"
        )
        tenants = q.get("tenants") or {}
        for tenant, t in tenants.items() if set(tenants) - {DEFAULT_TENANT} else ():
            held = " ".join(f"{p}={n}" for p, n in t["depth"].items())
            cap = f" max_pending={t['max_pending']}" if t.get("max_pending") else ""
            service = f" service={t['service']:.0f}" if t.get("service") is not None else ""
            click.echo(f"  tenant {tenant}: ({held}) weight={t['weight']:g}{cap}{service}")
    click.echo(f"workers: {data['workers']}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def workers(ctx: click.Context, as_json: bool) -> None:
    """Registered workers: queue, runner, slots, memory, running jobs.

    \b
    Example:
      zkq workers
      zkq workers --json | jq -r '.[] | select(.state == "draining") | .id'
    """
    with open_client(ctx) as client:
        records = client.workers()
    if as_json:
        emit(records)
        return
    for r in records:
        cache = r.get("memory") or {}
        mem_text = (
            f" kv pages {cache.get('pages_promised', 0)}/{cache.get('pages_total', 0)}"
            if cache
            else ""
        )
        # Jobs given back for a more urgent one (a registration without the field: none).
        preempted = f" preempted={r['preempted']}" if r.get("preempted") else ""
        click.echo(
            f"{r['id']}  queue={r['queue']} {r['runner']} {r['state']} "
            f"slots {r['slots_busy']}/{r['slots_max']}{mem_text}{preempted}"
            f"{engine_text(r.get('engine'))} running={','.join(r['running']) or '-'}"
        )


def engine_text(engine: dict[str, Any] | None) -> str:
    """A worker in front of an inference server: its gate and the server's figures."""
    if not engine:
        return ""
    parts = [f"engine={engine.get('engine', 'openai')}", f"gate={engine.get('gate')}"]
    for name in ("waiting", "running", "kv_use"):
        if name in engine:
            parts.append(f"{name}={engine[name]}")
    if "down" in engine:
        parts.append(f"({engine['down']})")
    return " " + " ".join(parts)


@click.group(invoke_without_command=True)
@click.option("--queue", default=None, help="Only this queue.", callback=checked(check_queue))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def dead(ctx: click.Context, queue: str | None, as_json: bool) -> None:
    """List dead-lettered jobs with the reason (malformed entries, poison jobs); ``zkq dead
    purge`` removes them.

    \b
    Example:
      zkq dead --queue llama
      zkq dead --json | jq -r '.[].id' | xargs -n1 zkq requeue
      zkq dead purge --older-than 86400
    """
    if ctx.invoked_subcommand is not None:
        return
    with open_client(ctx) as client:
        if queue is not None:
            require_queue(client, queue)
        letters = client.dead(queue)
    if as_json:
        emit(letters)
        return
    for x in letters:
        click.echo(f"{x.get('id') or '-'}  {x['queue']}/{x['priority']}  {x['reason']}")


@dead.command("purge")
@click.option("--queue", default=None, help="Only this queue.", callback=checked(check_queue))
@click.option("--older-than", type=SECONDS, default=None, help="Only letters older than SECONDS.")
@click.pass_context
@handles_errors
def dead_purge(ctx: click.Context, queue: str | None, older_than: float | None) -> None:
    """Delete dead letters (all, or those older than --older-than seconds).

    \b
    Example:
      zkq dead purge --queue llama --older-than 604800
    """
    with open_client(ctx) as client:
        removed = client.purge_dead(queue, older_than=older_than)
    click.echo(f"purged {removed} dead letter(s)")


@click.command()
@click.pass_context
@handles_errors
def migrate(ctx: click.Context) -> None:
    """Move a root written by an earlier protocol version (1, or 2: before tenants) to this
    one, 3 (stop the old workers first: it refuses while a queue has claims or a line).

    \b
    Example:
      zkq --root /zkq migrate
    """
    from zkqueue.protocol.migrate import migrate as run

    with open_client(ctx) as client, client.mapped():
        report = run(client.zk, client.layout)
    click.echo(
        f"migrated: {report.entries} entries, {report.results} results; "
        f"{report.left_attached} attached entries left to their callers; "
        f"{len(report.skipped)} skipped"
    )


@click.command()
@click.argument("job_id", required=False, callback=checked(check_job_id))
@click.option("--all", "all_", is_flag=True, help="Requeue every dead letter with a valid spec.")
@click.option("--queue", default=None, help="Only this queue.", callback=checked(check_queue))
@click.pass_context
@handles_errors
def requeue(ctx: click.Context, job_id: str | None, all_: bool, queue: str | None) -> None:
    """Enqueue a dead-lettered job again (same id, attempts from zero).

    \b
    Examples:
      zkq requeue _8f3a2c1d9e4b7a60
      zkq requeue --all --queue llama
    """
    if bool(job_id) == all_:
        raise click.UsageError("give a job id or --all")
    with open_client(ctx) as client:
        jobs = client.requeue(job_id, queue)
    for job in jobs:
        click.echo(f"requeued {job.id} ({job.queue}/{job.priority})")
    if all_ and not jobs:
        click.echo("nothing to requeue", err=True)


@click.command()
@click.option("--interval", type=SECONDS, default=2.0, show_default=True, help="Refresh, seconds.")
@click.option("--once", is_flag=True, help="Print one frame and exit (for pipes and scripts).")
@click.pass_context
@handles_errors
def top(ctx: click.Context, interval: float, once: bool) -> None:
    """Live view of queues, workers and recent results, fitted to the terminal (the least
    useful columns drop first); q quits. Piped, it prints one snapshot, without colours.

    \b
    Example:
      zkq --zk zk1:2181 top --interval 1
      zkq top --once > cluster.txt
    """
    import sys

    from zkqueue.operations.top import run_top

    with open_client(ctx) as client:
        run_top(client, interval=interval, once=once or not sys.stdout.isatty())


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=9464, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.pass_context
@handles_errors
def metrics(ctx: click.Context, port: int, addr: str) -> None:
    """Serve cluster-wide Prometheus gauges read from ZooKeeper (depth per queue and priority,
    oldest pending age, workers per queue) until SIGTERM.

    \b
    Example:
      zkq metrics --port 9464 &   curl -s localhost:9464/metrics | grep zkq_queue_depth
    """
    from zkqueue.operations.exporter import run_exporter

    with open_client(ctx) as client:
        run_exporter(client, port, addr)


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script.

    \b
    Example:
      zkq completion bash > /etc/bash_completion.d/zkq
      eval "$(zkq completion zsh)"
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - the choice above lists the supported shells
        raise click.UsageError(f"no completion for {shell}")
    root = click.get_current_context().find_root().command
    click.echo(cls(root, {}, "zkq", "_ZKQ_COMPLETE").source())
