"""Bulk submission from a JSONL file: one job per line (fields as in docs/PROTOCOL.md, plus
``priority``, ``queue``, ``tenant`` and ``job_id``), pipelined, results written back as the
jobs end (each record names its input line). A bad line is reported with its number and the
rest still goes through."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zkqueue.errors import InvalidJob, JobTimeout, JobWithdrawn
from zkqueue.plumbing.connection import TRANSIENT
from zkqueue.producer.client import Client
from zkqueue.producer.job import Job
from zkqueue.protocol.spec import parse_submission

#: Seconds between reads while no result watch fires (watches are hints).
_RECHECK = 2.0


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
            raw = json.loads(text.strip())
            parse_submission(raw, limit=limit)
        except json.JSONDecodeError as exc:  # its own "line 1 column N" would be misread
            out.append(Line(number, error=f"not valid JSON: {exc.msg} at column {exc.colno}"))
            continue
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
    tenant: str | None = None,
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
            tenant=tenant,
        )
        for line, job in zip(part, jobs, strict=True):
            line.job = job
        if progress is not None:
            progress(len(part))


def _not_utf8(data: bytes, exc: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {exc.start + 1})"


def results(lines: list[Line], timeout: float | None) -> Iterator[dict[str, Any]]:
    """One JSON record per line, as the jobs end (refused lines first): the result, or the
    line's error. ``timeout`` bounds the whole wait, not each job's. One watch per result node
    says when it appears; every round reads what is new in one pipelined round trip. Lines
    that name one job (a job_id given twice) share its record."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting: dict[tuple[str, str], list[Line]] = {}
    for line in lines:
        if line.job is None:
            yield {"line": line.number, "status": "invalid", "error": line.error}
        else:
            waiting.setdefault((line.job.queue, line.job.id), []).append(line)
    fired = threading.Event()

    def notify(_event: object) -> None:
        fired.set()

    while waiting:
        fired.clear()
        ended = _ended(waiting, notify)
        for key in ended:
            for line in waiting.pop(key):
                yield {"line": line.number, **_record(line, 0.0)}
        left = None if deadline is None else deadline - time.monotonic()
        if waiting and left is not None and left <= 0:
            for group in waiting.values():
                for line in group:
                    yield {"line": line.number, **_record(line, 0.0)}
            return
        if waiting and not ended:
            fired.wait(_RECHECK if left is None else min(left, _RECHECK))


def _ended(
    waiting: dict[tuple[str, str], list[Line]], notify: Callable[[object], None]
) -> list[tuple[str, str]]:
    """The waiting jobs that ended: their result exists, or their entry went without one (a
    withdrawn request, say of an earlier run whose job this line's id named). The entry is
    read before the result: a completion removes the one and writes the other at once. While
    ZooKeeper is away nothing is known to have ended (the next round looks again)."""
    calls = []
    for key, group in waiting.items():
        job = group[0].job
        assert job is not None
        zk, entry = job.client.zk, job.entry_path
        gone = zk.exists_async(entry) if entry else None
        calls.append((key, gone, zk.exists_async(job.result_path, watch=notify)))
    ended = []
    for key, gone, result in calls:
        try:
            if result.get() is not None or (gone is not None and gone.get() is None):
                ended.append(key)
        except TRANSIENT:
            pass
    return ended


def _record(line: Line, timeout: float) -> dict[str, Any]:
    assert line.job is not None
    try:
        return line.job.result(timeout=timeout).to_dict()
    except (JobTimeout, JobWithdrawn) as exc:
        return {"id": line.job.id, "status": "unfinished", "error": str(exc)}
