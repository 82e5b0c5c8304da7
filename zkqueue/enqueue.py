"""Creating pending entries exactly once, even when the reply is lost with the connection.

After a ConnectionLoss a create may or may not have committed. The entry's name starts with the
job id, so the producer waits (bounded) for the connection to come back and looks the id up
before creating again: a retry never enqueues a job twice.
"""

from __future__ import annotations

import time
from typing import Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, SessionExpiredError

from zkqueue.connection import ConnectionSettings
from zkqueue.errors import ZkqConnectionError
from zkqueue.layout import Layout

#: Creates in flight at once in create_many.
_PIPELINE_WINDOW = 512
#: Seconds between checks while waiting for kazoo to reconnect.
_RECONNECT_POLL = 0.05

#: (job id, queue, priority, spec bytes) of one entry to create.
Prepared = tuple[str, str, str, bytes]


class Producer(Protocol):
    """What the enqueuer needs of its client (``zkqueue.client.Client`` is one)."""

    @property
    def zk(self) -> KazooClient: ...

    layout: Layout
    settings: ConnectionSettings

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None: ...


class Enqueuer:
    """Creates entries for one client."""

    def __init__(self, client: Producer) -> None:
        self.client = client

    def _zk(self) -> KazooClient:
        return self.client.zk

    @property
    def layout(self) -> Layout:
        return self.client.layout

    @property
    def settings(self) -> ConnectionSettings:
        return self.client.settings

    def find(self, queue: str, priority: str, job_id: str) -> str | None:
        return self.client.find_entry(queue, priority, job_id)

    def create_many(self, prepared: list[Prepared], ephemeral: bool) -> list[str]:
        """Create every entry with pipelined creates; returns their names in order."""
        zk = self._zk()
        names: list[str] = []
        for start in range(0, len(prepared), _PIPELINE_WINDOW):
            window = prepared[start : start + _PIPELINE_WINDOW]
            calls = [
                zk.create_async(
                    self.layout.entry_prefix(q, p, jid), data, ephemeral=ephemeral, sequence=True
                )
                for jid, q, p, data in window
            ]
            for (jid, q, p, data), call in zip(window, calls, strict=True):
                try:
                    names.append(call.get().rsplit("/", 1)[1])
                except ConnectionLoss:
                    names.append(self.create(q, p, jid, data, ephemeral=ephemeral))
        return names

    def create(self, queue: str, priority: str, job_id: str, data: bytes, ephemeral: bool) -> str:
        """Create the entry exactly once: after a ConnectionLoss the create may have happened,
        so wait for the connection to come back and look for the id before creating again."""
        prefix = self.layout.entry_prefix(queue, priority, job_id)
        deadline = time.monotonic() + self.settings.connect_timeout
        while True:
            try:
                path: str = self._zk().create(prefix, data, ephemeral=ephemeral, sequence=True)
                return path.rsplit("/", 1)[1]
            except (ConnectionLoss, SessionExpiredError):
                try:
                    found = self._find_after_loss(queue, priority, job_id, deadline)
                except ZkqConnectionError as exc:
                    # The create may have committed: give the caller the id to look it up by.
                    raise ZkqConnectionError(
                        f"{exc}; job {job_id} may or may not have been enqueued "
                        f"(check with: zkq status {job_id})",
                        job_id=job_id,
                    ) from None
                if found is not None:
                    return found

    def _find_after_loss(
        self, queue: str, priority: str, job_id: str, deadline: float
    ) -> str | None:
        while True:
            self._await_connected(deadline)
            try:
                return self.find(queue, priority, job_id)
            except (ConnectionLoss, SessionExpiredError):
                if time.monotonic() > deadline:
                    raise ZkqConnectionError(
                        f"lost ZooKeeper at {self.settings.hosts} while enqueuing"
                    ) from None

    def _await_connected(self, deadline: float) -> None:
        """Bounded wait for kazoo to reconnect (to this server or another of the ensemble)."""
        while not self._zk().connected:
            if time.monotonic() > deadline:
                raise ZkqConnectionError(
                    f"lost ZooKeeper at {self.settings.hosts} while enqueuing and it did not "
                    f"come back within {self.settings.connect_timeout:g}s"
                )
            time.sleep(_RECONNECT_POLL)
