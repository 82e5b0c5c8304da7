"""A handle on one submitted job (its state, its result, cancelling it), and finding jobs by id."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from kazoo.exceptions import ConnectionLoss, NoNodeError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import EventType, WatchedEvent

from zkqueue import defaults
from zkqueue.errors import CorruptRecord, JobNotFound, JobTimeout, JobWithdrawn
from zkqueue.plumbing.watches import forget_data_watch, remove_data_watch
from zkqueue.producer.direct import StreamReading, ThreadTap
from zkqueue.protocol import claims, counts
from zkqueue.protocol.jobpaths import PENDING, RUNNING, WITHDRAWN, JobPaths
from zkqueue.protocol.layout import DEFAULT_TENANT
from zkqueue.protocol.records import ClaimBody
from zkqueue.protocol.result import Result

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from kazoo.client import KazooClient

    from zkqueue.protocol.layout import Layout


class Owner(Protocol):
    """What a Job needs of the client that made it (``zkqueue.producer.client.Client`` is one)."""

    @property
    def zk(self) -> KazooClient: ...

    layout: Layout

    def mapped(self) -> AbstractContextManager[None]: ...

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None: ...

    def claim_of(self, queue: str, entry: str) -> ClaimBody | None: ...

    def position(self, queue: str, entry: str) -> int | None: ...

    def start_estimate(self, queue: str, position: int) -> float | None: ...

    def stream_http(self) -> Any: ...


#: How often a waiter re-reads even without a watch firing: watches are hints, not guarantees.
_RECHECK_SECONDS = 2.0
#: How often a waiter tries again while ZooKeeper is unreachable.
_RECONNECT_POLL = 0.25
#: What a read may raise while ZooKeeper is away; a waiter tries again within its deadline.
_AWAY = (ConnectionLoss, SessionExpiredError, KazooTimeoutError)


class Job(JobPaths):
    """A job by id. ``owned`` marks the submitter's handle: only it withdraws an attached request
    on timeout and removes an attached result once read."""

    client: Owner

    @classmethod
    def ended(cls, client: Owner, job_id: str, queue: str, priority: str, record: Result) -> Job:
        """A handle on a job whose result is already known (read from a dead letter)."""
        job = cls(client, job_id, queue, priority)
        job._result = record
        return job

    def _start(self) -> None:
        #: Submitted with a job id that was already known: this handle is the earlier job's.
        self.existing = False
        #: Keep an attached result once read (by default the caller consumes it).
        self.keep_result = False
        self._withdrawn = False
        self._result: Result | None = None
        #: Set by this handle's one watch callable (kazoo keeps watchers in sets: re-arming the
        #: same callable never stacks, and it can be taken back when the wait ends).
        self._fired = threading.Event()
        #: The read of the result, sent by the watch that reported its creation.
        self._early: Any = None
        #: The result watch set just before the entry was created (``watch_early``), and
        #: the session it was set in (a new session has lost it).
        self._armed: Any = None
        self._armed_session: Any = None
        #: While streaming: whether a watch fired, whether the stream's tap woke us.
        self._watched = False
        self._tapped = False

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
            raise self._give_up(timeout)
        return self._accept(found)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yield the output in pieces as the worker generates it (for jobs submitted with
        ``stream=True``; others yield their whole output at the end), then stop. The result
        record is then available from ``result()``. The pieces come straight from the worker
        where it serves streams (``zkqueue.producer.direct``), else from the job's claim;
        StreamInterrupted if the attempt that produced them stops part-way (the job goes on).
        On timeout raise JobTimeout, withdrawing the submitter's attached request."""
        deadline = None if timeout is None else time.monotonic() + timeout
        reading = StreamReading(self.id, self.client, ThreadTap, self._tap_wake)
        self._armed = None  # each look below sets the watch it needs
        look = True
        try:
            while self._result is None:
                self._fired.clear()
                body, record = None, None
                if look:
                    with self.client.mapped():
                        body, record = self._look_stream(self._on_watch, _bound(deadline))
                if record is not None:
                    rest = reading.ended(self._accept(record))
                    if rest:
                        yield rest
                    return
                piece = reading.advance(body)
                if piece is None:  # read ZooKeeper once more before going on
                    look = True
                    continue
                if piece:
                    yield piece
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._give_up(timeout)
                self._fired.wait(
                    _RECHECK_SECONDS if remaining is None else min(remaining, _RECHECK_SECONDS)
                )
                # Read ZooKeeper unless only the tap woke us (a watch, or a quiet interval).
                watched, self._watched = self._watched, False
                tapped, self._tapped = self._tapped, False
                look = watched or not tapped
        finally:
            reading.close()

    def _tap_wake(self) -> None:
        self._tapped = True
        self._fired.set()

    def _look_stream(
        self, watch: Any, timeout: float | None
    ) -> tuple[ClaimBody | None, Result | None]:
        """The claim (watched) while the job runs, or the result if the job ended."""
        try:
            record = self._look(watch, timeout)
        except _AWAY:
            return None, None
        if record is not None or self.entry is None:
            return None, record
        claim = self.claim_path
        zk = self.client.zk
        try:
            if zk.exists_async(claim, watch=watch).get(timeout=timeout) is None:
                return None, None
            data, _ = zk.get_async(claim).get(timeout=timeout)
        except (NoNodeError, *_AWAY):
            return None, None
        try:
            return ClaimBody.from_bytes(data), None
        except CorruptRecord:
            return None, None

    def _give_up(self, timeout: float | None) -> JobTimeout:
        """Stop waiting: take the watches back, withdraw the submitter's attached request."""
        self._drop_watches(self._on_watch)
        if self.owned and not self.detach:
            self.withdraw()
        return self.timed_out(timeout)

    def _accept(self, found: Result) -> Result:
        if self.owned and not self.detach and not self.keep_result:
            self._forget_result(found)
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
        self._withdrawn = True
        zk = self.client.zk
        if not zk.connected:
            return
        with contextlib.suppress(NoNodeError, *_AWAY):
            zk.delete_async(path).get(timeout=_RECHECK_SECONDS)

    # -- internals -------------------------------------------------------------------------

    def watch_early(self) -> None:
        """Watch for the result before the entry is created, pipelined with the create: the
        first wait then sends nothing (a fresh entry needs no look). The submitter calls it."""
        zk = self.client.zk
        self._armed_session = zk.client_id
        self._armed = zk.exists_async(self.result_path, watch=self._on_watch)

    def unwatch(self) -> None:
        """Take back the early result watch (the create it was set for failed); without a
        connection, from kazoo's table only, so a reconnect does not set it again."""
        if self._armed is not None:
            self._armed = None
            zk = self.client.zk
            if zk.connected:
                self._drop_watches(self._on_watch)
            else:
                forget_data_watch(zk, self.result_path, self._on_watch)

    def _wait_result(self, deadline: float | None) -> Result | None:
        """Wait for the result; a connection lost meanwhile is waited out (kazoo reconnects)."""
        while True:
            self._fired.clear()
            try:
                found = self._fetch(_bound(deadline))
                if found is None and not self._armed_empty(deadline):
                    found = self._look(self._on_watch, _bound(deadline))
                recheck = _RECHECK_SECONDS
            except _AWAY:
                found, recheck = None, _RECONNECT_POLL  # ZooKeeper is away: wait, within deadline
            if found is not None:
                return found
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self._fired.wait(recheck if remaining is None else min(remaining, recheck))

    def _armed_empty(self, deadline: float | None) -> bool:
        """Whether the early watch found no result, so it is set and nothing is there yet (in
        the same session, with time left to wait): answers once, then looks take over."""
        call, self._armed = self._armed, None
        if call is None or self.client.zk.client_id != self._armed_session:
            return False
        if deadline is not None and deadline <= time.monotonic():
            return False
        return call.get(timeout=_bound(deadline)) is None

    def _on_watch(self, event: WatchedEvent) -> None:
        self._watched = True
        if event.type == EventType.CREATED and event.path == self.result_path:
            # Read it at once, from kazoo's callback thread: the waiting thread then finds
            # the answer on its way, not a request still to send.
            self._early = self.client.zk.get_async(event.path)
        self._fired.set()

    def _fetch(self, timeout: float | None) -> Result | None:
        """The result, when the watch just reported its creation: one read, already sent (the
        watch fired, so there is none to take back, and the entry's state no longer matters)."""
        call, self._early = self._early, None
        if call is None:
            return None
        try:
            data, _ = call.get(timeout=timeout)
        except NoNodeError:
            return None  # consumed or expired meanwhile: the full look says which
        return self._parse(data)

    def _look(self, watch: Any, timeout: float | None = None) -> Result | None:
        """The result if there is one. ``timeout`` bounds each read: a request made while
        kazoo reconnects waits for the connection, and the caller's deadline comes first."""
        zk = self.client.zk
        entry_path = self.entry_path
        # Read the entry before the result: complete() deletes the one and creates the other
        # in a single transaction, so "no entry, then no result" means nothing will come. The
        # three reads are pipelined (one round trip): a session's requests run in order. Only
        # the result is watched (a job costs its caller one notification); the entry's end
        # without a result (a withdrawal) is seen at the next periodic look.
        entry_call = zk.exists_async(entry_path) if entry_path else None
        result_watch = zk.exists_async(self.result_path, watch=watch)
        result_call = zk.get_async(self.result_path)
        entry_alive = entry_call is None or _exists(entry_call, timeout)
        watched = result_watch.get(timeout=timeout)
        try:
            data, _ = result_call.get(timeout=timeout)
            if watched is not None:  # the watch went onto the existing result: take it back
                remove_data_watch(zk, self.result_path, watch)
            return self._parse(data)
        except NoNodeError:
            pass
        if not entry_alive:
            self._withdrawn = True
            raise JobWithdrawn(self._withdrawn_message())
        return None

    def _withdrawn_message(self) -> str:
        with contextlib.suppress(*_AWAY):
            # pending/<priority> goes first in a delete (the queue's node last)
            if self.client.zk.exists(self.client.layout.pending(self.queue, self.priority)) is None:
                return (
                    f"job {self.id} was withdrawn before it produced a result: its queue "
                    f"{self.queue!r} was deleted (zkq queue delete --force); resubmitting is safe"
                )
        why = (
            "this client withdrew it"
            if self.owned and not self.detach
            else "its entry was deleted without a result"
        )
        return (
            f"job {self.id} was withdrawn before it produced a result ({why}, or the "
            f"submitting client's ZooKeeper session expired and its attached request went with "
            f"it); nothing ran to completion, so resubmitting is safe"
        )

    def _forget_result(self, record: Result) -> None:
        """Remove an attached result once read, with its expiry index node; nobody waits for
        the answer (a failure only leaves it for the janitor's retention)."""
        claims.consume(self.client.zk, self.client.layout, self.queue, record, self._result_size)

    def _locate(self) -> None:
        """Find the entry name by scanning the priority's children (only for bare ids)."""
        if self.entry is not None:
            return
        found = self.client.find_entry(self.queue, self.lane, self.id)
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
                if self.entry is not None:
                    return self._withdrawn_info()
                raise JobNotFound(
                    f"job {self.id} has no entry and no result in queue {self.queue!r}"
                ) from None
            return self._finished_info(Result.from_bytes(data, f"result of job {self.id}"))
        info: dict[str, Any] = {
            "id": self.id,
            "queue": self.queue,
            "priority": self.priority,
            "tenant": self.tenant or DEFAULT_TENANT,
            "attempts": stat.version,
            "submitted_at": stat.ctime / 1000,
        }
        claim = self.client.claim_of(self.queue, self.entry or "")
        if claim is not None:
            info.update(state=RUNNING, worker=claim.worker)
        else:
            position = self.client.position(self.queue, self.entry or "")
            info.update(state=PENDING, position=position)
            if position is not None:
                info["starts_in_s"] = self.client.start_estimate(self.queue, position)
        return info

    def _withdrawn_info(self) -> dict[str, Any]:
        """The entry this handle knew is gone and no result came: withdrawn."""
        self._withdrawn = True
        return {
            "id": self.id,
            "queue": self.queue,
            "priority": self.priority,
            "state": WITHDRAWN,
            "error": self._withdrawn_message(),
        }

    def _finished_info(self, record: Result) -> dict[str, Any]:
        return {
            "id": self.id,
            "queue": self.queue,
            "priority": self.priority,
            "tenant": self.tenant or DEFAULT_TENANT,
            "state": record.status,
            "attempts": record.attempts,
            "worker": record.worker,
        }


def _exists(call: Any, timeout: float | None) -> bool:
    try:
        return call.get(timeout=timeout) is not None
    except NoNodeError:
        return False


def _bound(deadline: float | None) -> float | None:
    """Seconds a read may block before the deadline (a little at least, so it can answer)."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.05)


# -- finding jobs by id: one (its result, its claim, or its entry in the buckets), or a batch of
# ids a producer chose, in a few pipelined passes whatever their number.


def find_job(client: Owner, queue: str, job_id: str) -> Job | None:
    """A job by id: its result, its claim (running), or its entry (by listing buckets). The
    result is read again last: a job that ended while we looked has one by then."""
    found = finished(client, queue, {job_id}).get(job_id)
    if found is not None:
        return found
    running = claimed_entry(client, queue, job_id)
    if running is not None:
        priority, _, entry = running.partition("/")
        return Job(client, job_id, queue, priority, entry)
    for priority in defaults.PRIORITIES:
        for path in counts.lanes(client.zk, client.layout, queue, priority):
            name = counts.find(client.zk, client.layout, queue, path, job_id)
            if name is not None:
                return Job(client, job_id, queue, priority, name)
    return finished(client, queue, {job_id}).get(job_id)


def known_jobs(client: Owner, keys: set[tuple[str, str]]) -> dict[tuple[str, str], Job]:
    """The jobs already there under chosen (queue, id) keys, marked ``existing``: per queue,
    the results read pipelined, then one pass over the buckets for the rest, then their
    results again (a job that ended while we looked has one by then)."""
    known: dict[tuple[str, str], Job] = {}
    for queue in {q for q, _ in keys}:
        ids = {jid for q, jid in keys if q == queue}
        done = finished(client, queue, ids)
        rest = ids - set(done)
        places = counts.find_many(client.zk, client.layout, queue, rest)
        pending = {jid: Job(client, jid, queue, p, entry) for jid, (p, entry) in places.items()}
        late = finished(client, queue, rest - set(pending))
        known.update({(queue, jid): job for jid, job in {**done, **pending, **late}.items()})
    for job in known.values():
        job.existing = True
    return known


def finished(client: Owner, queue: str, ids: set[str]) -> dict[str, Job]:
    """The jobs of ``ids`` that have a result, read pipelined."""
    calls = {jid: client.zk.get_async(client.layout.result(queue, jid)) for jid in ids}
    found = {}
    for jid, call in calls.items():
        with contextlib.suppress(NoNodeError):
            record = Result.from_bytes(call.get()[0], f"result of job {jid} in queue {queue!r}")
            tenant = record.get("tenant")
            found[jid] = Job(
                client,
                jid,
                queue,
                record.priority,
                tenant=tenant if isinstance(tenant, str) else None,
            )
    return found


def claimed_entry(client: Owner, queue: str, job_id: str) -> str | None:
    """``<priority>/<bucket>/<id>-<seq>`` of a running job, from its claim."""
    try:
        data, _ = client.zk.get(client.layout.claim(queue, job_id))
    except NoNodeError:
        return None
    try:
        return ClaimBody.from_bytes(data, f"claim {queue}/{job_id}").entry
    except CorruptRecord:
        return None
