"""What submit adds around the library: a JSONL file submitted with progress and written back
line by line, the check that some worker serves a queue, and the time left before a deadline."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, BinaryIO, TextIO

import click

from zkqueue.cli.common import open_client
from zkqueue.errors import ExitCode, Interrupted, NoWorker, ZkqConnectionError
from zkqueue.producer import bulk
from zkqueue.producer.client import Client


def left(deadline: float | None) -> float | None:
    """Seconds to a deadline (None: no deadline), never negative."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def check_served(client: Client, queues: Iterable[str], *, require: bool) -> None:
    """Warn on stderr (or refuse, with ``require``) when no registered worker serves a queue:
    the job would wait until one registers."""
    # A warning after the submit: it never fails or holds it (the job is in, and what follows
    # tells of it), so it is skipped while ZooKeeper is away.
    if not require and not client.zk.connected:
        return
    try:
        served = client.served_queues()
    except ZkqConnectionError:
        if require:
            raise
        return
    for queue in sorted(set(queues) - served):
        message = f"no registered worker serves queue {queue!r}"
        if require:
            raise NoWorker(f"{message} (--require-worker)")
        click.echo(f"zkq: warning: {message}; jobs wait until one registers", err=True)


class _Writer:
    """Writes one JSON line per input line (it names the line) as soon as it is known."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.statuses: list[str | None] = []

    def write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, default=str) + "\n")
        self.out.flush()
        self.statuses.append(record.get("status"))


def submit_file(
    ctx: click.Context,
    source: BinaryIO,
    out: TextIO,
    options: dict[str, Any],
    *,
    detach: bool,
    timeout: float | None,
    require_worker: bool,
) -> int:
    """Bulk submit; exit 0, or 2 if a line was refused, or 1 if a job did not succeed."""
    with open_client(ctx, timeout) as client:
        lines = bulk.read_lines(source, limit=client.max_spec_bytes)
        for line in lines:
            if line.error is not None:
                click.echo(f"zkq: line {line.number}: {line.error}", err=True)
        queues = {_queue(line, options["queue"]) for line in lines if line.spec is not None}
        if require_worker:
            check_served(client, queues, require=True)
        writer = _Writer(out)
        try:
            _run(client, lines, writer, options, detach, timeout)
        except KeyboardInterrupt:
            raise Interrupted(_interrupted(lines, detach)) from None
    if "invalid" in writer.statuses:
        return ExitCode.USAGE
    if not detach and any(s != "succeeded" for s in writer.statuses):
        return ExitCode.JOB_FAILED
    return ExitCode.OK


def _run(
    client: Client,
    lines: list[bulk.Line],
    writer: _Writer,
    options: dict[str, Any],
    detach: bool,
    timeout: float | None,
) -> None:
    from rich.console import Console
    from rich.progress import Progress

    good = sum(1 for line in lines if line.spec is not None)
    written = 0

    def submitted(count: int) -> None:
        nonlocal written
        bar.advance(task, count)
        if detach:  # write every line whose job now has an id
            done = [x for x in lines if x.spec is None or x.job is not None]
            for x in done[written:]:
                writer.write(_detached(x))
            written = len(done)

    queues = {_queue(line, options["queue"]) for line in lines if line.spec is not None}
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("submitting", total=good)
        bulk.submit_lines(client, lines, detach=detach, **options, progress=submitted)
        check_served(client, queues, require=False)
        if detach:
            for x in lines[written:]:
                writer.write(_detached(x))
            return
        bar.update(task, description="waiting for results", completed=0)
        for record in bulk.results(lines, timeout):
            writer.write(record)
            bar.advance(task, 1 if "id" in record else 0)


def _queue(line: bulk.Line, default: str) -> str:
    spec = line.spec
    return str(spec.get("queue", default)) if isinstance(spec, dict) else default


def _detached(line: bulk.Line) -> dict[str, Any]:
    if line.job is not None:
        return {"line": line.number, "id": line.job.id}
    return {"line": line.number, "status": "invalid", "error": line.error}


def _interrupted(lines: list[bulk.Line], detach: bool) -> str:
    good = [x for x in lines if x.spec is not None]
    sent = [x for x in good if x.job is not None]
    fate = (
        "they stay queued (their ids are in the output)"
        if detach
        else "they were attached and are withdrawn as zkq exits"
    )
    if not sent:
        return f"interrupted: none of {len(good)} job(s) was submitted"
    return (
        f"interrupted: {len(sent)} of {len(good)} job(s) were submitted, up to line "
        f"{sent[-1].number}; {fate}; the other {len(good) - len(sent)} were not"
    )
