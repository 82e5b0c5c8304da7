"""Backpressure: a queue's maximum pending depth, stored on the queue's node so every producer
obeys the same limit. Beyond it, submit fails fast with QueueFull (like an HTTP 429)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zkqueue import counts
from zkqueue.errors import InvalidJob, QueueFull
from zkqueue.layout import Layout

#: Seconds a producer trusts its copy of a queue's settings.
_CACHE_SECONDS = 5.0


@dataclass(frozen=True)
class QueueSettings:
    """JSON data of <root>/queues/<queue>: {"max_pending": N} (absent or null: no limit)."""

    max_pending: int | None = None

    def to_bytes(self) -> bytes:
        return json.dumps({"max_pending": self.max_pending}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> QueueSettings:
        try:
            raw = json.loads(data) if data else {}
        except ValueError:
            return cls()
        value = raw.get("max_pending") if isinstance(raw, dict) else None
        return cls(max_pending=value if isinstance(value, int) and value > 0 else None)


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

    def set_max_pending(self, queue: str, max_pending: int | None) -> None:
        if max_pending is not None and max_pending < 1:
            raise InvalidJob("max pending must be at least 1 (or none for no limit)")
        self.zk.set(self.layout.queue(queue), QueueSettings(max_pending).to_bytes())
        self._cache.pop(queue, None)

    def waiting(self, queue: str) -> int:
        """Jobs not yet started: entries (the child counts of the pending buckets) minus
        claims."""
        running = self.zk.exists_async(self.layout.claims(queue))
        depth = sum(counts.depth(self.zk, self.layout, queue).values())
        claims = running.get()
        return depth - (claims.numChildren if claims else 0)

    def check_room(self, queue: str, adding: int = 1) -> None:
        limit = self.settings(queue).max_pending
        if limit is None:
            return
        waiting = self.waiting(queue)
        if waiting + adding > limit:
            raise QueueFull(
                f"queue {queue!r} is full: {waiting} jobs waiting, the limit is {limit}"
                f"{f' (this batch adds {adding})' if adding > 1 else ''}; try again later"
            )
