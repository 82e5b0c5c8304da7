"""A handle on one submitted job: its state, its result, and cancelling it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from kazoo.exceptions import ConnectionLoss, NoNodeError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError

from zkqueue import claims
from zkqueue.errors import CorruptRecord, JobNotFound, JobTimeout, JobWithdrawn
from zkqueue.records import ClaimBody
from zkqueue.result import Result

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from kazoo.client import KazooClient

    from zkqueue.layout import Layout


class Owner(Protocol):
    """What a Job needs of the client that made it (``zkqueue.client.Client`` is one)."""

    @property
    def zk(self) -> KazooClient: ...

    layout: Layout

    def mapped(self) -> AbstractContextManager[None]: ...

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None: ...

    def claim_of(self, queue: str, entry: str) -> ClaimBody | None: ...

    def position(self, queue: str, entry: str) -> int | None: ...


PENDING = "pending"
RUNNING = "running"
#: How often a waiter re-reads even without a watch firing: watches are hints, not guarantees.
_RECHECK_SECONDS = 2.0
#: How often a waiter tries again while ZooKeeper is unreachable.
_RECONNECT_POLL = 0.25
#: What a read may raise while ZooKeeper is away; a waiter tries again within its deadline.
_AWAY = (ConnectionLoss, SessionExpiredError, KazooTimeoutError)


class JobPaths:
    """Where a job's nodes are, for both producer faces (``Job`` and ``aiojob.AsyncJob``)."""

    client: Any
    id: str
    queue: str
    priority: str
    entry: str | None

    def __repr__(self) -> str:
        name, fields = type(self).__name__, (self.id, self.queue, self.priority)
        return "{}(id={!r}, queue={!r}, priority={!r})".format(name, *fields)

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


class Job(JobPaths):
    """A job by id. ``owned`` marks the submitter's handle: only it withdraws an attached request
    on timeout and removes an attached result once read."""

    def __init__(
        self,
        client: Owner,
        job_id: str,
        queue: str,
        priority: str,
        entry: str | None = None,
        *,
        detach: bool = True,
        owned: bool = False,
        result: Result | None = None,
    ) -> None:
        self.client = client
        self.id = job_id
        self.queue = queue
        self.priority = priority
        self.entry = entry
        self.detach = detach
        self.owned = owned
        self._result = result

    def status(self) -> str:
        """``pending``, ``running`` or the result's status; raises JobNotFound if none applies."""
        return str(self.info()["state"])

    def info(self) -> dict[str, Any]:
        """State plus details: queue position (1 = next) when pending, worker when running."""
        if self._result is not None:
            return self._finished_info(self._result)
        with self.client.mapped():
            return self._read_info()

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the result record. On timeout raise JobTimeout; the submitter's attached
        request is withdrawn then (no GPU time is spent on an answer nobody reads)."""
        if self._result is not None:
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.client.mapped():
            found = self._wait_result(deadline)
        if found is None:
            if self.owned and not self.detach:
                self.withdraw()
            raise JobTimeout(f"job {self.id} has no result after {timeout:g}s")
        return self._accept(found)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yield the output in pieces as the worker generates it (for jobs submitted with
        ``stream=True``; others yield their whole output at the end), then stop. The result
        record is then available from ``result()``. On timeout raise JobTimeout, withdrawing
        the submitter's attached request."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sent = ""
        while self._result is None:
            fired = threading.Event()
            with self.client.mapped():
                found = self._look_stream(_setter(fired), _bound(deadline))
            text, record = found
            if record is not None:
                self._accept(record)
                text = record.output
            if text.startswith(sent) and len(text) > len(sent):
                yield text[len(sent) :]
                sent = text
            if record is not None:
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                if self.owned and not self.detach:
                    self.withdraw()
                raise JobTimeout(f"job {self.id} has no result after {timeout:g}s")
            fired.wait(_RECHECK_SECONDS if remaining is None else min(remaining, _RECHECK_SECONDS))

    def _look_stream(self, watch: Any, timeout: float | None) -> tuple[str, Result | None]:
        """The partial output in the claim (watched), or the result if the job ended."""
        try:
            record = self._look(watch, timeout)
        except _AWAY:
            return "", None
        if record is not None or self.entry is None:
            return "", record
        claim = self.claim_path
        zk = self.client.zk
        try:
            if zk.exists_async(claim, watch=watch).get(timeout=timeout) is None:
                return "", None
            data, _ = zk.get_async(claim).get(timeout=timeout)
        except (NoNodeError, *_AWAY):
            return "", None
        try:
            partial = ClaimBody.from_bytes(data).partial
        except CorruptRecord:
            partial = None
        return partial or "", None

    def _accept(self, found: Result) -> Result:
        if self.owned and not self.detach:
            self._forget_result()
        self._result = found
        return found

    def cancel(self) -> bool:
        """Cancel a pending or running job and record status cancelled. False if it had ended."""
        with self.client.mapped():
            self._locate()
            if self.entry is None:
                return False
            return claims.cancel(
                self.client.zk, self.client.layout, self.queue, self.priority, self.entry
            )

    def withdraw(self) -> None:
        """Delete the entry without a result: the caller no longer wants the answer. Without a
        connection this does not wait: an attached entry is ephemeral and goes with the
        session, which the caller is about to close."""
        path = self.entry_path
        if path is None:
            return
        zk = self.client.zk
        if not zk.connected:
            return
        with contextlib.suppress(NoNodeError, *_AWAY):
            zk.delete_async(path).get(timeout=_RECHECK_SECONDS)

    # -- internals -------------------------------------------------------------------------

    def _wait_result(self, deadline: float | None) -> Result | None:
        """Wait for the result; a connection lost meanwhile is waited out (kazoo reconnects)."""
        while True:
            fired = threading.Event()
            try:
                found = self._look(_setter(fired), _bound(deadline))
                recheck = _RECHECK_SECONDS
            except _AWAY:
                found, recheck = None, _RECONNECT_POLL  # ZooKeeper is away: wait, within deadline
            if found is not None:
                return found
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            fired.wait(recheck if remaining is None else min(remaining, recheck))

    def _look(self, watch: Any, timeout: float | None = None) -> Result | None:
        """The result if there is one. ``timeout`` bounds each read: a request made while
        kazoo reconnects waits for the connection, and the caller's deadline comes first."""
        zk = self.client.zk
        entry_path = self.entry_path
        # Read the entry before the result: complete() deletes the one and creates the other
        # in a single transaction, so "no entry, then no result" means nothing will come. The
        # three reads are pipelined (one round trip): a session's requests run in order. The
        # entry is watched with a get, which sets no watch when the entry is already gone (an
        # exists watch on a missing node would outlive the job: a long-lived client leaks one
        # per job).
        entry_call = zk.get_async(entry_path, watch=watch) if entry_path else None
        result_watch = zk.exists_async(self.result_path, watch=watch)
        result_call = zk.get_async(self.result_path)
        entry_alive = entry_call is None or _exists(entry_call, timeout)
        result_watch.get(timeout=timeout)
        try:
            data, _ = result_call.get(timeout=timeout)
            return Result.from_bytes(data)
        except NoNodeError:
            pass
        if not entry_alive:
            raise JobWithdrawn(f"job {self.id} was withdrawn before it produced a result")
        return None

    def _forget_result(self) -> None:
        """Remove an attached result once read; nobody waits for the answer (a failure only
        leaves it for the janitor's retention)."""
        self.client.zk.delete_async(self.result_path)

    def _locate(self) -> None:
        """Find the entry name by scanning the priority's children (only for bare ids)."""
        if self.entry is not None:
            return
        found = self.client.find_entry(self.queue, self.priority, self.id)
        if found is not None:
            self.entry = found

    def _read_info(self) -> dict[str, Any]:
        zk = self.client.zk
        self._locate()
        entry_path = self.entry_path
        stat = zk.exists(entry_path) if entry_path else None
        if stat is None:
            try:
                data, _ = zk.get(self.result_path)
            except NoNodeError:
                raise JobNotFound(
                    f"job {self.id} has no entry and no result in queue {self.queue!r}"
                ) from None
            return self._finished_info(Result.from_bytes(data, f"result of job {self.id}"))
        info: dict[str, Any] = {
            "id": self.id,
            "queue": self.queue,
            "priority": self.priority,
            "attempts": stat.version,
            "submitted_at": stat.ctime / 1000,
        }
        claim = self.client.claim_of(self.queue, self.entry or "")
        if claim is not None:
            info.update(state=RUNNING, worker=claim.worker)
        else:
            info.update(state=PENDING, position=self.client.position(self.queue, self.entry or ""))
        return info

    def _finished_info(self, record: Result) -> dict[str, Any]:
        return {
            "id": self.id,
            "queue": self.queue,
            "priority": self.priority,
            "state": record.status,
            "attempts": record.attempts,
            "worker": record.worker,
        }


def _exists(call: Any, timeout: float | None) -> bool:
    try:
        call.get(timeout=timeout)
    except NoNodeError:
        return False
    return True


def _bound(deadline: float | None) -> float | None:
    """Seconds a read may block before the deadline (a little at least, so it can answer)."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.05)


def _setter(event: threading.Event) -> Any:
    def watch(_event: object) -> None:
        event.set()

    return watch
