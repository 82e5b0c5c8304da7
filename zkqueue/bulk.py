"""Bulk submission from a JSONL file: one job per line (fields as in docs/PROTOCOL.md, plus
``priority`` and ``queue``), pipelined, results written back in input order. A bad line is
reported with its number and the rest still goes through."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zkqueue.client import Client
from zkqueue.errors import InvalidJob, JobTimeout, JobWithdrawn
from zkqueue.job import Job
from zkqueue.spec import parse_submission


@dataclass
class Line:
    """One input line: its number, and either a job spec or why it was refused."""

    number: int
    spec: dict[str, Any] | None = None
    error: str | None = None
    job: Job | None = None


def read_lines(lines: Iterable[str | bytes], *, limit: int) -> list[Line]:
    """Parse and validate every non-blank line; invalid ones (not UTF-8, not JSON, not a valid
    job) carry their error."""
    out = []
    for number, text in enumerate(lines, 1):
        if isinstance(text, bytes):
            data = text
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                out.append(Line(number, error=_not_utf8(data, exc)))
                continue
        if not text.strip():
            continue
        try:
            raw = json.loads(text)
            parse_submission(raw, limit=limit)
        except (ValueError, InvalidJob) as exc:
            out.append(Line(number, error=str(exc)))
            continue
        out.append(Line(number, spec=raw))
    return out


def submit_lines(
    client: Client,
    lines: list[Line],
    *,
    priority: str,
    queue: str,
    max_new_tokens: int | None,
    detach: bool,
    chunk: int = 256,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Enqueue the valid lines in pipelined chunks, setting each line's job."""
    good = [line for line in lines if line.spec is not None]
    for start in range(0, len(good), chunk):
        part = good[start : start + chunk]
        jobs = client.submit_many(
            [line.spec or {} for line in part],
            priority=priority,
            queue=queue,
            max_new_tokens=max_new_tokens,
            detach=detach,
        )
        for line, job in zip(part, jobs, strict=True):
            line.job = job
        if progress is not None:
            progress(len(part))


def _not_utf8(data: bytes, exc: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {exc.start + 1})"


def results(lines: list[Line], timeout: float | None) -> Iterator[dict[str, Any]]:
    """One JSON record per line, in input order: the result, or the line's error. ``timeout``
    bounds the whole wait, not each job's."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for line in lines:
        if line.job is None:
            yield {"line": line.number, "status": "invalid", "error": line.error}
            continue
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            record = line.job.result(timeout=left).to_dict()
        except (JobTimeout, JobWithdrawn) as exc:
            record = {"id": line.job.id, "status": "unfinished", "error": str(exc)}
        yield {"line": line.number, **record}
