"""The janitor: housekeeping no single worker owns, run by one elected process per cluster.

Each pass, for every queue:
- reclaims running jobs whose lease ran out (a hung worker: its session alive, its runner stuck),
  by deleting the claim when the entry still carries the claim's token: the job is pending again,
  and the stale worker is fenced out (its renewal and its completion both fail);
- expires pending jobs past their ``queue_timeout`` even when no worker frees up;
- removes results older than the retention time.

Times are ZooKeeper's own: the janitor writes <root>/clock and reads its mtime, so lease and age
checks compare server timestamps with server timestamps, whatever the hosts' clocks say.
Candidates stand in a line under <root>/janitor; its head is the active janitor.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import (
    NodeExistsError,
    NoNodeError,
)

from zkqueue import defaults
from zkqueue import result as results
from zkqueue.claims import Claims, own_untracked, reclaim
from zkqueue.connection import TRANSIENT
from zkqueue.errors import CorruptRecord, InvalidJob
from zkqueue.layout import EntryName, Layout, child
from zkqueue.line import Line
from zkqueue.records import ClaimBody
from zkqueue.spec import JobSpec

log = logging.getLogger("zkq.janitor")


@dataclass
class PassReport:
    reclaimed: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    results_removed: int = 0


@dataclass
class _Pending:
    priority: str
    entry: EntryName


@dataclass
class _Deadline:
    """What the janitor remembers of a waiting entry (its spec never changes)."""

    queue_timeout: float | None
    ctime: float
    version: int


class Janitor:
    """One housekeeping pass over every queue under a root (call ``run_pass``)."""

    def __init__(
        self,
        zk: KazooClient,
        layout: Layout,
        *,
        result_ttl: float = defaults.RESULT_TTL,
        worker_id: str = "janitor",
    ) -> None:
        self.zk = zk
        self.layout = layout
        self.result_ttl = result_ttl
        self.worker_id = worker_id
        #: Per entry name, read once: its queue_timeout, creation time and version.
        self._deadlines: dict[str, _Deadline] = {}

    def server_now(self) -> float:
        """ZooKeeper's clock, in unix seconds: the mtime of a node we just wrote."""
        path = self.layout.clock()
        try:
            stat = self.zk.set(path, b"")
        except NoNodeError:
            with contextlib.suppress(NodeExistsError):
                self.zk.create(path, b"", makepath=True)
            stat = self.zk.set(path, b"")
        return float(stat.mtime) / 1000

    def run_pass(self) -> PassReport:
        report = PassReport()
        now = self.server_now()
        try:
            queues = self.zk.get_children(self.layout.queues())
        except NoNodeError:
            return report
        for queue in sorted(queues):
            self._queue_pass(queue, now, report)
        if report.reclaimed or report.expired or report.results_removed:
            log.info("janitor pass: %s", report)
        return report

    def _queue_pass(self, queue: str, now: float, report: PassReport) -> None:
        pending = self._pending(queue)
        claimed = self._reclaim_expired(queue, pending, now, report)
        self._expire_waiting(
            queue, [p for n, p in pending.items() if n not in claimed], now, report
        )
        report.results_removed += self._remove_old_results(queue, now)

    def _pending(self, queue: str) -> dict[str, _Pending]:
        out: dict[str, _Pending] = {}
        for priority in defaults.PRIORITIES:
            path = self.layout.pending(queue, priority)
            try:
                names = self.zk.get_children(path)
            except NoNodeError:
                continue
            for name in names:
                try:
                    out[name] = _Pending(priority, EntryName.parse(name))
                except InvalidJob:
                    continue  # the head dead-letters malformed names
        return out

    def _reclaim_expired(
        self, queue: str, pending: dict[str, _Pending], now: float, report: PassReport
    ) -> set[str]:
        """Delete claims whose lease ran out; returns the names still validly claimed."""
        try:
            names = self.zk.get_children(self.layout.claims(queue))
        except NoNodeError:
            return set()
        calls = [(n, self.zk.get_async(self.layout.claim(queue, n))) for n in names]
        live: set[str] = set()
        for name, call in calls:
            try:
                data, stat = call.get()
            except NoNodeError:
                continue
            body = _claim_body(data, queue, name)
            lease = body.lease if body else defaults.LEASE
            entry = pending.get(name)
            if entry is None or now <= stat.mtime / 1000 + lease:
                live.add(name)
                continue
            # A claim nobody can read is reclaimed whatever version its entry has (token -1).
            if self._reclaim(queue, entry, body.token if body else -1, stat.version):
                report.reclaimed.append(entry.entry.job_id)
                log.warning(
                    "reclaimed job %s from %s: no lease renewal for %.0fs",
                    entry.entry.job_id,
                    body.worker if body else "an unreadable claim",
                    now - stat.mtime / 1000,
                )
            else:
                live.add(name)
        return live

    def _reclaim(self, queue: str, entry: _Pending, token: int, claim_version: int) -> bool:
        name = entry.entry.name
        return reclaim(self.zk, self.layout, queue, entry.priority, name, token, claim_version)

    def _expire_waiting(
        self, queue: str, waiting: list[_Pending], now: float, report: PassReport
    ) -> None:
        unknown = [p for p in waiting if p.entry.name not in self._deadlines]
        calls = [
            (p, self.zk.get_async(self.layout.entry(queue, p.priority, p.entry.name)))
            for p in unknown
        ]
        for p, call in calls:
            try:
                data, stat = call.get()
            except NoNodeError:
                continue
            try:
                limit = JobSpec.from_bytes(data).queue_timeout
            except InvalidJob:
                limit = None
            self._deadlines[p.entry.name] = _Deadline(limit, stat.ctime / 1000, stat.version)
        for p in waiting:
            deadline = self._deadlines.get(p.entry.name)
            if deadline is None or deadline.queue_timeout is None:
                continue
            if now - deadline.ctime > deadline.queue_timeout:
                if self._expire(queue, p, deadline, now):
                    report.expired.append(p.entry.job_id)
                else:
                    del self._deadlines[p.entry.name]  # claimed or changed since: read it again
        alive = {p.entry.name for p in waiting}
        self._deadlines = {k: v for k, v in self._deadlines.items() if k in alive}

    def _expire(self, queue: str, p: _Pending, deadline: _Deadline, now: float) -> bool:
        return Claims(self.zk, self.layout, queue, self.worker_id).end_unclaimed(
            p.priority,
            p.entry,
            version=deadline.version,
            submitted_at=deadline.ctime,
            status=results.EXPIRED,
            error=f"not started within queue_timeout of {deadline.queue_timeout:g}s",
            finished_at=now,
        )

    def _remove_old_results(self, queue: str, now: float) -> int:
        path = self.layout.results(queue)
        try:
            names = self.zk.get_children(path)
        except NoNodeError:
            return 0
        calls = [(n, self.zk.exists_async(self.layout.result(queue, n))) for n in names]
        old = [
            (n, stat)
            for n, call in calls
            if (stat := call.get()) is not None and now - stat.mtime / 1000 > self.result_ttl
        ]
        deletes = [
            self.zk.delete_async(self.layout.result(queue, n), stat.version) for n, stat in old
        ]
        removed = 0
        for call in deletes:
            with contextlib.suppress(NoNodeError):
                call.get()
                removed += 1
        return removed


class JanitorService:
    """Runs janitor passes on a thread while this process is the elected janitor."""

    def __init__(
        self,
        zk: KazooClient,
        layout: Layout,
        member_id: str,
        *,
        interval: float = defaults.JANITOR_INTERVAL,
        result_ttl: float = defaults.RESULT_TTL,
    ) -> None:
        self.janitor = Janitor(zk, layout, result_ttl=result_ttl, worker_id=member_id)
        self.zk = zk
        self.layout = layout
        self.interval = interval
        self.passes = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._line = Line(zk, layout.janitor(), member_id, self._wake.set)
        self._thread = threading.Thread(target=self._run, name="zkq-janitor", daemon=True)
        #: A call failed with the connection: a join may have committed unseen (see _sweep).
        self._unsure = False

    @property
    def leading(self) -> bool:
        return self._line.joined and self._line.is_head()

    def start(self) -> JanitorService:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        with contextlib.suppress(NodeExistsError):
            self.zk.ensure_path(self.layout.janitor())
        while not self._stop.is_set():
            self._turn()
            self._wake.wait(self.interval)
            if self._wake.is_set():
                self._wake.clear()
                self._line.invalidate()
        with contextlib.suppress(*TRANSIENT, NoNodeError):
            self._line.leave()

    def _turn(self) -> None:
        try:
            if self._unsure:
                self._sweep()
            if not self._line.joined:
                self._line.join()
            if self._line.is_head():
                self.janitor.run_pass()
                self.passes += 1
        except TRANSIENT as exc:
            # Our line node (if the session survived) is still ours: is_head() finds out. A join
            # whose reply was lost may have left a second node: the next turn sweeps it.
            log.warning("janitor pass skipped: %s", type(exc).__name__)
            self._unsure = True
        except Exception:  # housekeeping must never take the worker down
            log.exception("janitor pass failed")

    def _sweep(self) -> None:
        """Delete this session's places in the election other than the one we hold; one left
        by a lost reply would head the line forever and no janitor would ever run."""
        known = {self._line.node} if self._line.node else set()
        for name in own_untracked(self.zk, self.layout.janitor(), known):
            with contextlib.suppress(NoNodeError):
                self.zk.delete(child(self.layout.janitor(), name))
            self._line.invalidate()
        self._unsure = False


def _claim_body(data: bytes, queue: str, name: str) -> ClaimBody | None:
    try:
        return ClaimBody.from_bytes(data, f"claim {queue}/{name}")
    except CorruptRecord as exc:
        log.warning("%s", exc)
        return None
