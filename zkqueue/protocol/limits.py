"""A queue's limits, stored on the queue's node so every producer and worker obeys the same ones.

``max_pending`` is backpressure: beyond it, submit fails fast with QueueFull (like an HTTP 429).
``max_running`` caps the jobs of the queue running at once across all workers: the head of the
line (the only claimer) claims no more than the cap leaves room for (``RunningCap``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError

from zkqueue.errors import InvalidJob, QueueFull
from zkqueue.protocol import counts
from zkqueue.protocol.layout import Layout

#: Seconds a producer trusts its copy of a queue's settings.
_CACHE_SECONDS = 5.0


#: The limits a queue may have, by field name.
LIMITS = ("max_pending", "max_running")
#: The largest limit: a signed 32-bit int, which any producer's JSON reader holds.
MAX_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class QueueSettings:
    """JSON data of <root>/queues/<queue>: {"max_pending": N, "max_running": M} (absent or
    null: no limit)."""

    max_pending: int | None = None
    max_running: int | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"max_pending": self.max_pending, "max_running": self.max_running}
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> QueueSettings:
        try:
            raw = json.loads(data) if data else {}
        except (ValueError, UnicodeDecodeError):
            return cls()
        if not isinstance(raw, dict):
            return cls()
        return cls(**{name: _limit(raw.get(name)) for name in LIMITS})


def _limit(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


class Limits:
    """Reads (with a short cache) and writes queue settings, and checks room before a submit."""

    def __init__(self, zk: KazooClient, layout: Layout) -> None:
        self.zk = zk
        self.layout = layout
        self._cache: dict[str, tuple[float, QueueSettings]] = {}

    def settings(self, queue: str) -> QueueSettings:
        cached = self._cache.get(queue)
        if cached and time.monotonic() - cached[0] < _CACHE_SECONDS:
            return cached[1]
        try:
            data, _ = self.zk.get(self.layout.queue(queue))
            settings = QueueSettings.from_bytes(data)
        except NoNodeError:
            settings = QueueSettings()
        self._cache[queue] = (time.monotonic(), settings)
        return settings

    def set(self, queue: str, **limits: int | None) -> QueueSettings:
        """Change some limits (None removes one), keeping the others; returns the new settings.
        A concurrent change is retried against the new version, never overwritten blindly."""
        for name, value in limits.items():
            if name not in LIMITS:
                raise InvalidJob(f"unknown queue limit {name!r}")
            if value is not None and (isinstance(value, bool) or not 1 <= value <= MAX_LIMIT):
                raise InvalidJob(
                    f"{name.replace('_', ' ')} must be 1 to {MAX_LIMIT} (or none): producers in "
                    "other languages read it as a 32-bit int"
                )
        path = self.layout.queue(queue)
        while True:
            data, stat = self.zk.get(path)
            settings = replace(QueueSettings.from_bytes(data), **limits)
            try:
                self.zk.set(path, settings.to_bytes(), version=stat.version)
            except BadVersionError:
                continue
            self._cache.pop(queue, None)
            return settings

    def set_max_pending(self, queue: str, max_pending: int | None) -> None:
        self.set(queue, max_pending=max_pending)

    def waiting(self, queue: str) -> int:
        """Jobs not yet started (``counts.waiting``)."""
        return counts.waiting(self.zk, self.layout, queue)

    def check_room(self, queue: str, adding: int = 1) -> None:
        limit = self.settings(queue).max_pending
        if limit is None:
            return
        check_counts(queue, limit, self.waiting(queue), adding)


def check_counts(queue: str, limit: int, waiting: int, adding: int = 1) -> None:
    """Raise QueueFull when ``adding`` more jobs would put ``waiting`` over ``limit`` (shared by
    the blocking and the asyncio producers)."""
    if waiting + adding > limit:
        raise QueueFull(
            f"queue {queue!r} is full: {waiting} jobs waiting, the limit is {limit}"
            f"{f' (this batch adds {adding})' if adding > 1 else ''}; try again later"
        )


class RunningCap:
    """A queue's ``max_running`` as the head of the line needs it: read once, then kept current
    by a data watch on the queue's node, so a turn costs no read. ``invalidate`` after a
    reconnect (watches may have been lost with the session)."""

    def __init__(self, zk: KazooClient, layout: Layout, queue: str) -> None:
        self.zk = zk
        self.path = layout.queue(queue)
        self._value: int | None = None
        self._stale = True
        zk.add_listener(self.invalidate)  # any connection change: re-read, re-arm the watch

    def invalidate(self, _event: object = None) -> None:
        self._stale = True

    @property
    def value(self) -> int | None:
        if self._stale:
            self._stale = False  # before the read: a change during it fires the watch again
            try:
                data, _ = self.zk.get(self.path, watch=self.invalidate)
            except NoNodeError:
                data = b""
                self.zk.exists(self.path, watch=self.invalidate)
            except BaseException:
                self._stale = True
                raise
            self._value = QueueSettings.from_bytes(data).max_running
        return self._value
