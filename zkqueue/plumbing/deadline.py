"""Reads waited on under one time budget, and what such a read may raise: the exporter's scrape
and ``zkq top`` pipeline their reads and must answer in time even when ZooKeeper does not."""

from __future__ import annotations

import time
from typing import Any

from kazoo.exceptions import KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.interfaces import IAsyncResult

from zkqueue.errors import ZkqError

#: What a read may raise when ZooKeeper is unreachable, slow, or refuses us.
READ_ERRORS = (KazooException, KazooTimeoutError, ZkqError, ValueError)


class Deadline:
    """Waits on pipelined async reads, each for at most the time left of one budget."""

    def __init__(self, timeout: float) -> None:
        self.end = time.monotonic() + timeout

    def get(self, call: IAsyncResult) -> Any:
        return call.get(timeout=max(0.0, self.end - time.monotonic()))

    def children(self, call: IAsyncResult) -> list[str]:
        """A get_children result; a directory that does not exist has none."""
        try:
            names: list[str] = self.get(call)
        except NoNodeError:
            return []
        return names

    def count(self, call: IAsyncResult) -> int:
        """numChildren from an exists result (0 when the node does not exist)."""
        stat = self.get(call)
        return int(stat.numChildren) if stat is not None else 0
