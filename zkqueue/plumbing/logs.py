"""Logging set-up for the zkq command: human-readable lines by default, JSON lines for log
aggregation (``--log-format json``). Job lines carry ``job``, ``queue``, ``priority`` and
``worker`` fields (passed as ``extra=``), shown in both formats."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

#: Context fields a log record may carry, in display order.
JOB_FIELDS = ("job", "queue", "priority", "worker")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """The usual line, then ``[job=... queue=... priority=... worker=...]`` when known."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(f"{f}={getattr(record, f)}" for f in JOB_FIELDS if hasattr(record, f))
        return f"{line} [{context}]" if context else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, job fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in JOB_FIELDS:
            if hasattr(record, name):
                entry[name] = getattr(record, name)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "WARNING", fmt: str = "text") -> None:
    """Send zkq's logs to stderr in ``fmt`` ("text" or "json") at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level.upper() != "DEBUG":  # kazoo logs every refused connection attempt
        logging.getLogger("kazoo.client").setLevel(logging.ERROR)
    # httpx logs every request at info (each stream read from a worker, each upstream call).
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


def job_context(job: str, queue: str, priority: str, worker: str) -> dict[str, str]:
    """The ``extra=`` mapping of a job's log line."""
    return {"job": job, "queue": queue, "priority": priority, "worker": worker}
