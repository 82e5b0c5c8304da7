"""Producer commands: submit (one job, a stream, or a JSONL file), result, status, cancel, ls."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import click

from zkqueue import defaults
from zkqueue.cli.common import emit, exit_for, handles_errors, open_client
from zkqueue.errors import ExitCode, JobTimeout
from zkqueue.job import Job
from zkqueue.result import Result


@click.command()
@click.argument("prompt", required=False, default="-")
@click.option(
    "--priority",
    type=click.Choice(defaults.PRIORITIES),
    default=defaults.PRIORITY,
    show_default=True,
)
@click.option("--queue", default=defaults.QUEUE, show_default=True)
@click.option(
    "--max-new-tokens",
    type=int,
    default=None,
    help=f"Tokens to generate (default {defaults.MAX_NEW_TOKENS}).",
)
@click.option("--detach", is_flag=True, help="Enqueue a persistent job and print its id.")
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Stop waiting after SECONDS; the request is withdrawn.",
)
@click.option("--temperature", type=float, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--max-runtime", type=float, default=None, help="Seconds the job may run.")
@click.option(
    "--queue-timeout",
    type=float,
    default=None,
    help="Seconds the job may wait to start before it expires.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--stream", is_flag=True, help="Print the output while it is generated.")
@click.option(
    "--file",
    "file_",
    type=click.File("r"),
    default=None,
    help="Submit every line of a JSONL file (one job spec per line).",
)
@click.option(
    "--out",
    type=click.File("w"),
    default="-",
    help="With --file: write the results (JSONL, input order) here instead of stdout.",
)
@click.pass_context
@handles_errors
def submit(
    ctx: click.Context,
    prompt: str,
    priority: str,
    queue: str,
    max_new_tokens: int | None,
    detach: bool,
    timeout: float | None,
    as_json: bool,
    file_: TextIO | None,
    out: TextIO,
    stream: bool,
    **params: Any,
) -> None:
    """Submit PROMPT (or stdin with '-' or no PROMPT) and print the output.

    \b
    Examples:
      zkq submit --priority high "Translate: bonjour"
      echo "long prompt" | zkq submit --max-new-tokens 128 --json
      zkq submit --detach "batch job"        # prints the job id
      zkq submit --file prompts.jsonl --out results.jsonl
    """
    if file_ is not None:
        if prompt != "-":
            raise click.UsageError("give a PROMPT or --file, not both")
        options = {"priority": priority, "queue": queue, "max_new_tokens": max_new_tokens}
        sys.exit(_submit_file(ctx, file_, out, options, detach, timeout))
    text = sys.stdin.read() if prompt == "-" else prompt
    extra = {k: v for k, v in params.items() if v is not None}
    with open_client(ctx) as client:
        job = client.submit(
            text,
            priority=priority,
            queue=queue,
            max_new_tokens=max_new_tokens,
            detach=detach,
            **({"stream": True} if stream else {}),
            **extra,
        )
        if detach:
            emit({"id": job.id}) if as_json else click.echo(job.id)
            return
        if stream and not as_json:
            sys.exit(_print_stream(job, timeout))
        record = job.result(timeout=timeout)
    _print_result(record, as_json)
    sys.exit(exit_for(record))


def _submit_file(
    ctx: click.Context,
    source: TextIO,
    out: TextIO,
    options: dict[str, Any],
    detach: bool,
    timeout: float | None,
) -> int:
    """Bulk submit; exit 0, or 2 if a line was refused, or 1 if a job did not succeed."""
    from rich.console import Console
    from rich.progress import Progress

    from zkqueue import bulk

    with open_client(ctx) as client:
        lines = bulk.read_lines(source, limit=client.max_spec_bytes)
        for line in lines:
            if line.error is not None:
                click.echo(f"zkq: line {line.number}: {line.error}", err=True)
        good = sum(1 for line in lines if line.spec is not None)
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("submitting", total=good)
            bulk.submit_lines(
                client, lines, detach=detach, **options, progress=lambda n: bar.advance(task, n)
            )
            if detach:
                records = [
                    {"line": x.number, "id": x.job.id}
                    if x.job
                    else {"line": x.number, "status": "invalid", "error": x.error}
                    for x in lines
                ]
            else:
                bar.update(task, description="waiting for results", completed=0)
                records = []
                for record in bulk.results(lines, timeout):
                    records.append(record)
                    bar.advance(task, 1 if "id" in record else 0)
    for record in records:
        out.write(json.dumps(record, default=str) + "\n")
    out.flush()
    if any(r.get("status") == "invalid" for r in records):
        return ExitCode.USAGE
    if not detach and any(r.get("status") != "succeeded" for r in records):
        return ExitCode.JOB_FAILED
    return ExitCode.OK


def _print_stream(job: Job, timeout: float | None) -> int:
    for piece in job.stream(timeout=timeout):
        click.echo(piece, nl=False)
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
@click.argument("job_id")
@click.option("--queue", default=None, help="Only look in this queue.")
@click.option("--wait", is_flag=True, help="Wait for the result.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after SECONDS.")
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
    """Print a job's result (exit 4 when it has none yet)."""
    with open_client(ctx) as client:
        job = client.job(job_id, queue)
        try:
            record = job.result(timeout=timeout if wait else 0.0)
        except JobTimeout:
            raise JobTimeout(f"job {job_id} has no result yet ({job.status()})") from None
    _print_result(record, as_json)
    sys.exit(exit_for(record))


@click.command()
@click.argument("job_id")
@click.option("--queue", default=None, help="Only look in this queue.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def status(ctx: click.Context, job_id: str, queue: str | None, as_json: bool) -> None:
    """Print a job's state: pending (with its position), running, or its result status."""
    with open_client(ctx) as client:
        info = client.job(job_id, queue).info()
    if as_json:
        emit(info)
        return
    line = f"{info['state']}"
    if info.get("position") is not None:
        line += f" (position {info['position']})"
    if info.get("worker"):
        line += f" on {info['worker']}"
    click.echo(line)


@click.command()
@click.argument("job_id")
@click.option("--queue", default=None, help="Only look in this queue.")
@click.pass_context
@handles_errors
def cancel(ctx: click.Context, job_id: str, queue: str | None) -> None:
    """Cancel a pending or running job (exit 1 if it had already ended)."""
    with open_client(ctx) as client:
        if not client.job(job_id, queue).cancel():
            click.echo(f"zkq: job {job_id} had already ended", err=True)
            sys.exit(ExitCode.JOB_FAILED)
    click.echo(f"cancelled {job_id}")


@click.command("ls")
@click.option("--queue", default=defaults.QUEUE, show_default=True)
@click.option("--limit", type=int, default=100, show_default=True, help="Show at most N jobs.")
@click.option("--all", "all_", is_flag=True, help="Show every job (read bucket by bucket).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def ls(ctx: click.Context, queue: str, limit: int, all_: bool, as_json: bool) -> None:
    """List pending and running jobs in dispatch order (the first --limit of them)."""
    with open_client(ctx) as client:
        rows = client.list(queue=queue, limit=None if all_ else limit)
    if as_json:
        emit(rows)
        return
    for row in rows:
        where = row.get("worker") or f"#{row.get('position')}"
        click.echo(
            f"{row['id']}  {row['priority']:<6}  {row['state']:<7}  {where}  "
            f"attempts={row['attempts']}"
        )
