"""Creating pending entries exactly once, even when the reply is lost with the connection.

After a ConnectionLoss a create may or may not have committed. The entry's name starts with the
job id, so the producer waits (bounded) for the connection to come back and looks the id up
before creating again: a retry never enqueues a job twice.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, RolledBackError, SessionExpiredError

from zkqueue import claims
from zkqueue.connection import ConnectionSettings
from zkqueue.errors import ZkqConnectionError
from zkqueue.layout import Layout

#: Creates per multi in create_many, and multis in flight at once.
_MULTI_CREATES = 100
_MULTIS_IN_FLIGHT = 8
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

    def create_many(self, prepared: list[Prepared], ephemeral: bool) -> list[str | None]:
        """Create every entry, ``_MULTI_CREATES`` to a multi, several multis in flight; returns
        the names in order (None for a job that finished before a lost reply was recovered).
        A multi whose reply is lost may have committed: its ids are looked up before anything
        is created again."""
        zk = self._zk()
        names: list[str | None] = []
        chunks = [prepared[i : i + _MULTI_CREATES] for i in range(0, len(prepared), _MULTI_CREATES)]
        for start in range(0, len(chunks), _MULTIS_IN_FLIGHT):
            window = chunks[start : start + _MULTIS_IN_FLIGHT]
            calls = [
                claims.enqueue_async(
                    zk,
                    [(self.layout.entry_prefix(q, p, jid), data) for jid, q, p, data in chunk],
                    ephemeral,
                )
                for chunk in window
            ]
            for chunk, call in zip(window, calls, strict=True):
                names.extend(self._created(chunk, call, ephemeral))
        return names

    def _created(self, chunk: list[Prepared], call: Any, ephemeral: bool) -> list[str | None]:
        try:
            outcome = call.get()
        except (ConnectionLoss, SessionExpiredError):
            return self._recover(chunk, ephemeral)
        errors = [r for r in outcome if isinstance(r, Exception)]
        if errors:  # nothing was created; the first error that is not a rollback says why
            raise next((e for e in errors if not isinstance(e, RolledBackError)), errors[0])
        return [str(path).rsplit("/", 1)[1] for path in outcome]

    def _recover(self, chunk: list[Prepared], ephemeral: bool) -> list[str | None]:
        """A multi whose reply was lost committed as a whole or not at all: look its ids up
        once the connection is back (an entry, or a result if a worker already finished it)
        and create them again only if none is there. None: finished before it was found."""
        deadline = time.monotonic() + self.settings.connect_timeout
        jid, queue, priority, _ = chunk[0]
        first = self._find_after_loss(queue, priority, jid, deadline)
        names = [first, *(self.find(q, p, j) for j, q, p, _ in chunk[1:])]
        zk = self._zk()
        if any(names) or any(zk.exists(self.layout.result(q, j)) for j, q, _, _ in chunk):
            return names
        return [self.create(q, p, j, data, ephemeral) for j, q, p, data in chunk]

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
