"""Producer commands: submit (one job, a stream, or a JSONL file), result, status, cancel, ls."""

from __future__ import annotations

import sys
import time
from typing import Any, BinaryIO, TextIO

import click

from zkqueue import defaults
from zkqueue.cli import batch
from zkqueue.cli.common import (
    COUNT,
    SECONDS,
    checked,
    emit,
    exit_for,
    handles_errors,
    named,
    open_client,
    read_stdin,
    require_queue,
)
from zkqueue.errors import ExitCode, Interrupted, JobTimeout, StreamInterrupted
from zkqueue.producer.job import Job
from zkqueue.protocol.layout import (
    DEFAULT_TENANT,
    check_job_id,
    check_new_job_id,
    check_queue,
    check_tenant,
)
from zkqueue.protocol.result import Result


@click.command()
@click.argument("prompt", required=False, default=None)
@click.option(
    "--priority",
    type=click.Choice(defaults.PRIORITIES),
    default=defaults.PRIORITY,
    show_default=True,
)
@click.option("--queue", default=defaults.QUEUE, show_default=True, callback=checked(check_queue))
@click.option(
    "--tenant",
    default=None,
    callback=checked(check_tenant),
    help="Who the job is for: fair share inside its priority (default: the default tenant).",
)
@click.option(
    "--max-new-tokens",
    type=int,
    default=None,
    help=f"Tokens to generate (default {defaults.MAX_NEW_TOKENS}).",
)
@click.option("--detach", is_flag=True, help="Enqueue a persistent job and print its id.")
@click.option(
    "--timeout",
    type=SECONDS,
    default=None,
    help="Return within SECONDS whatever happens (connecting included); the request is withdrawn.",
)
@click.option("--temperature", type=float, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--min-new-tokens", type=int, default=None, help="Tokens to generate at least.")
@click.option("--stop", multiple=True, help="Stop at this text (repeat for several).")
@click.option("--ignore-eos", is_flag=True, help="Generate past end-of-sequence.")
@click.option(
    "--job-id",
    default=None,
    callback=checked(check_new_job_id),
    help="Your id for the job: submitting it again returns the same job (idempotent).",
)
@click.option("--max-runtime", type=SECONDS, default=None, help="Seconds the job may run.")
@click.option(
    "--queue-timeout",
    type=SECONDS,
    default=None,
    help="Seconds the job may wait to start before it expires.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--stream", is_flag=True, help="Print the output while it is generated.")
@click.option(
    "--require-worker",
    is_flag=True,
    help="Refuse (exit 5) when no registered worker serves the queue, instead of warning.",
)
@click.option(
    "--file",
    "file_",
    type=click.File("rb"),
    default=None,
    help="Submit every line of a JSONL file (one job spec per line).",
)
@click.option(
    "--out",
    type=click.File("w"),
    default=None,
    help="With --file: write the results (JSONL, one per line as jobs end) here, not stdout.",
)
@click.pass_context
@handles_errors
def submit(
    ctx: click.Context,
    prompt: str | None,
    priority: str,
    queue: str,
    tenant: str | None,
    max_new_tokens: int | None,
    detach: bool,
    timeout: float | None,
    as_json: bool,
    file_: BinaryIO | None,
    out: TextIO | None,
    stream: bool,
    require_worker: bool,
    **params: Any,
) -> None:
    """Submit PROMPT (or stdin with '-' or no PROMPT) and print the output.

    \b
    Examples:
      zkq submit --priority high "Translate: bonjour"
      zkq submit --tenant team-a --detach "nightly backfill item"
      echo "long prompt" | zkq submit --max-new-tokens 128 --json
      zkq submit --detach "batch job"        # prints the job id
      zkq submit --detach --job-id nightly.2026-12-03 "report"   # once, however often run
      zkq submit --file prompts.jsonl --out results.jsonl
    """
    # Options not given: None, an empty --stop, an unset flag (identity: 0.0 is a value).
    extra = {k: v for k, v in params.items() if v is not None and v != () and v is not False}
    _check_flags(prompt, file_, out, detach, timeout, stream, as_json, extra)
    if file_ is not None:
        options = {
            "priority": priority,
            "queue": queue,
            "max_new_tokens": max_new_tokens,
            "tenant": tenant,
        }
        code = batch.submit_file(
            ctx,
            file_,
            out or sys.stdout,
            options,
            detach=detach,
            timeout=timeout,
            require_worker=require_worker,
        )
        sys.exit(code)
    if prompt is None and sys.stdin.isatty():
        raise click.UsageError("give a PROMPT, '-' to read it from stdin, or --file")
    text = read_stdin() if prompt in (None, "-") else prompt
    deadline = None if timeout is None else time.monotonic() + timeout
    job: Job | None = None
    with open_client(ctx, timeout) as client:
        try:
            if require_worker:
                batch.check_served(client, [queue], require=True)
            job = client.submit(
                text,
                priority=priority,
                queue=queue,
                max_new_tokens=max_new_tokens,
                detach=detach,
                tenant=tenant,
                **({"stream": True} if stream else {}),
                **extra,
            )
            batch.check_served(client, [queue], require=False)
            if detach:
                emit({"id": job.id}) if as_json else click.echo(job.id)
                return
            if stream and not as_json:
                sys.exit(_print_stream(job, batch.left(deadline)))
            record = job.result(timeout=batch.left(deadline))
        except JobTimeout:
            if job is None or timeout is None:
                raise
            raise job.timed_out(timeout) from None  # the whole wait, not what was left of it
        except KeyboardInterrupt:
            raise Interrupted(_interrupted(job)) from None
    _print_result(record, as_json)
    sys.exit(exit_for(record))


def _check_flags(
    prompt: str | None,
    file_: BinaryIO | None,
    out: TextIO | None,
    detach: bool,
    timeout: float | None,
    stream: bool,
    as_json: bool,
    extra: dict[str, Any],
) -> None:
    """Flags that conflict, or that do not apply to what was asked, are usage errors."""
    if file_ is not None:
        if prompt is not None:
            raise click.UsageError("give a PROMPT or --file, not both")
        if stream or as_json:
            raise click.UsageError("--stream and --json do not apply to --file (it writes JSONL)")
        if extra:
            names = ", ".join("--" + k.replace("_", "-") for k in sorted(extra))
            raise click.UsageError(f"{names}: put per-job parameters in each line of --file")
    elif out is not None:
        raise click.UsageError("--out applies only to --file")
    if detach and timeout is not None:
        raise click.UsageError("--timeout does not apply to --detach (nothing waits)")
    if detach and stream:
        raise click.UsageError("--stream and --detach conflict (a detached job is not watched)")


def _interrupted(job: Job | None) -> str:
    if job is None:
        return "interrupted: nothing was submitted"
    if job.detach:
        return f"interrupted: job {job.id} was submitted and stays queued (zkq status {job.id})"
    job.withdraw()
    return f"interrupted: job {job.id} was submitted, then withdrawn; nothing else was submitted"


def _print_stream(job: Job, timeout: float | None) -> int:
    try:
        for piece in job.stream(timeout=timeout):
            click.echo(piece, nl=False)
    except StreamInterrupted as exc:
        click.echo()  # end the line the stream stopped in
        # The request is attached (--stream takes no --detach): it is withdrawn as we exit.
        click.echo(
            f"zkq: {exc.stopped}; the request is withdrawn as zkq exits: submit it again", err=True
        )
        return int(exc.exit_code)
    click.echo()
    record = job.result()
    if not record.ok:
        click.echo(f"zkq: job {record.id} {record.status}: {record.error}", err=True)
    return exit_for(record)


def _print_result(record: Result, as_json: bool) -> None:
    if as_json:
        emit(record.to_dict())
    elif record.ok:
        click.echo(record.output)
    else:
        click.echo(f"zkq: job {record.id} {record.status}: {record.error}", err=True)


@click.command()
@click.argument("job_id", callback=checked(check_job_id))
@click.option(
    "--queue", default=None, help="Only look in this queue.", callback=checked(check_queue)
)
@click.option("--wait", is_flag=True, help="Wait for the result.")
@click.option("--timeout", type=SECONDS, default=None, help="With --wait: give up after SECONDS.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def result(
    ctx: click.Context,
    job_id: str,
    queue: str | None,
    wait: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Print a job's result (exit 4 when it has none yet).

    \b
    Examples:
      zkq result _8f3a2c1d9e4b7a60
      zkq result _8f3a2c1d9e4b7a60 --wait --timeout 60 --json
    """
    if timeout is not None and not wait:
        raise click.UsageError("--timeout applies only with --wait")
    with open_client(ctx, timeout) as client:
        job = client.job(job_id, queue)
        try:
            record = job.result(timeout=timeout if wait else 0.0)
        except JobTimeout:
            raise JobTimeout(f"job {job_id} has no result yet ({job.status()})") from None
    _print_result(record, as_json)
    sys.exit(exit_for(record))


@click.command()
@click.argument("job_id", callback=checked(check_job_id))
@click.option(
    "--queue", default=None, help="Only look in this queue.", callback=checked(check_queue)
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def status(ctx: click.Context, job_id: str, queue: str | None, as_json: bool) -> None:
    """Print a job's state: pending (with its position), running, or how it ended (dead
    letters included).

    \b
    Example:
      zkq status _8f3a2c1d9e4b7a60 --json
    """
    with open_client(ctx) as client:
        info = client.job(job_id, queue).info()
    if as_json:
        emit(info)
        return
    line = f"{info['state']}"
    if info.get("position") is not None:
        line += f" (position {info['position']}"
        if info.get("starts_in_s") is not None:
            line += f", starts in about {info['starts_in_s']:g} s at the recent rate"
        line += ")"
    if info.get("worker"):
        line += f" on {info['worker']}"
    click.echo(line)


@click.command()
@click.argument("job_id", callback=checked(check_job_id))
@click.option(
    "--queue", default=None, help="Only look in this queue.", callback=checked(check_queue)
)
@click.pass_context
@handles_errors
def cancel(ctx: click.Context, job_id: str, queue: str | None) -> None:
    """Cancel a pending or running job (exit 1 if it had already ended).

    \b
    Example:
      zkq cancel _8f3a2c1d9e4b7a60
    """
    with open_client(ctx) as client:
        if not client.job(job_id, queue).cancel():
            click.echo(f"zkq: job {job_id} had already ended", err=True)
            sys.exit(ExitCode.JOB_FAILED)
    click.echo(f"cancelled {job_id}")


@click.command("ls")
@click.option("--queue", default=defaults.QUEUE, show_default=True, callback=checked(check_queue))
@click.option("--limit", type=COUNT, default=100, show_default=True, help="Show at most N jobs.")
@click.option("--all", "all_", is_flag=True, help="Show every job (read bucket by bucket).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def ls(ctx: click.Context, queue: str, limit: int, all_: bool, as_json: bool) -> None:
    """List pending and running jobs (the first --limit of them): by priority, and in each
    the default tenant's jobs, then each tenant's by name, each in the order workers take
    them. Between tenants workers take by fair share, so a pending job's #N is its place as
    `zkq status` gives it: the jobs of higher priorities, and those ahead of it in its
    tenant's lane.

    \b
    Example:
      zkq ls --queue llama --limit 20
      zkq ls --all --json
    """
    with open_client(ctx) as client:
        if named(ctx, "queue"):
            require_queue(client, queue)
        rows = client.list(queue=queue, limit=None if all_ else limit)
    if as_json:
        emit(rows)
        return
    for row in rows:
        where = row.get("worker") or f"#{row.get('position')}"
        tenant = row.get("tenant")
        whose = f"  tenant={tenant}" if tenant and tenant != DEFAULT_TENANT else ""
        click.echo(
            f"{row['id']}  {row['priority']:<6}  {row['state']:<7}  {where}  "
            f"attempts={row['attempts']}{whose}"
        )
