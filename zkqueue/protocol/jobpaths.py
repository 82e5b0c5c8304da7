"""Where a job's nodes are, and the states a job handle reports: shared by the blocking
``Job`` and the asyncio ``AsyncJob``."""

from __future__ import annotations

from typing import Any

from zkqueue.errors import JobTimeout
from zkqueue.plumbing.watches import remove_data_watch
from zkqueue.protocol.layout import EntryName, lane
from zkqueue.protocol.result import Result

PENDING = "pending"
RUNNING = "running"
#: An attached request whose entry went without a result (its caller gave up, or the caller's
#: session expired): nothing was run to completion, resubmitting is safe.
WITHDRAWN = "withdrawn"


class JobPaths:
    """Where a job's nodes are, for both producer faces (``Job`` and ``aiojob.AsyncJob``)."""

    def __init__(
        self,
        client: Any,
        job_id: str,
        queue: str,
        priority: str,
        entry: str | None = None,
        *,
        detach: bool = True,
        owned: bool = False,
        tenant: str | None = None,
    ) -> None:
        """The job's identity, the same for both faces: its client, id, queue, priority and
        entry (None until found); ``detach``: submitted detached; ``owned``: the submitter's
        handle (only it withdraws an attached request, and consumes an attached result)."""
        self.client = client
        self.id = job_id
        self.queue = queue
        self.priority = priority
        self.entry = entry
        #: The tenant the job belongs to (``zkq submit --tenant``); from its entry name when
        #: known, else as given (None: the default tenant).
        self.tenant = (EntryName.parse(entry).tenant or None) if entry else tenant
        self.detach = detach
        self.owned = owned
        #: Bytes of the result record as read (for the consumer's accounting).
        self._result_size = 0
        self._start()

    def _start(self) -> None:
        """Each face's own waiting state: how it waits is all the faces differ in."""

    def __repr__(self) -> str:
        name, fields = type(self).__name__, (self.id, self.queue, self.priority)
        return "{}(id={!r}, queue={!r}, priority={!r})".format(name, *fields)

    @property
    def lane(self) -> str:
        """The directory below ``pending/`` that holds the job's entry (its tenant's lane)."""
        return lane(self.priority, self.tenant)

    @property
    def entry_path(self) -> str | None:
        if self.entry is None:
            return None
        return str(self.client.layout.entry(self.queue, self.priority, self.entry))

    @property
    def claim_path(self) -> str | None:
        if self.entry is None:
            return None
        return str(self.client.layout.claim(self.queue, self.entry))

    @property
    def result_path(self) -> str:
        return str(self.client.layout.result(self.queue, self.id))

    def timed_out(self, timeout: float | None) -> JobTimeout:
        """The error of a wait that gave up (the submitter's attached request is withdrawn)."""
        withdrawn = "; its attached request was withdrawn" if self.owned and not self.detach else ""
        return JobTimeout(f"job {self.id} has no result after {timeout:g}s{withdrawn}")

    def _parse(self, data: bytes) -> Result:
        """The result record read from the job's result node (its size kept for the consumer's
        accounting)."""
        self._result_size = len(data)
        return Result.from_bytes(data, f"result of job {self.id} ({self.result_path})")

    def _drop_watches(self, watch: Any) -> None:
        """Take back the watches a wait that gave up left on the result and the claim (they
        would otherwise stay until those nodes change, one per abandoned job)."""
        zk = self.client.zk
        if zk.connected:
            for path in (self.result_path, self.claim_path):
                if path is not None:
                    remove_data_watch(zk, path, watch)
