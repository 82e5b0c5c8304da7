"""The janitor: housekeeping no single worker owns, run by one elected process per cluster, on
its own ZooKeeper session and thread (so it cannot slow the dispatch of a worker hosting it).

Each pass, for every queue, with work bounded per pass whatever the volume stored:
- reclaims running jobs whose lease ran out (a hung worker: its session alive, its runner stuck),
  by deleting the claim when the entry still carries the claim's token: the job is pending again,
  and the stale worker is fenced out (its renewal and its completion both fail);
- expires pending jobs past their ``queue_timeout`` even when no worker frees up, scanning a few
  pending buckets per pass in turn (each entry's spec is read once);
- expires results through the expiry index: whole time buckets older than the retention, and the
  oldest beyond the queue's bound on stored results (count, bytes), at most ``page`` deletes a
  pass with ``in_flight`` outstanding (``zkqueue.operations.expiry``);
- keeps dead letters under their bound (the oldest go first);
- removes tenants' lanes that stayed empty and unchanged for ``lane_idle`` seconds, and the
  fair-share counters of a tenant left with no lane (``_prune_lanes``).

Times are ZooKeeper's own: the janitor writes <root>/clock and reads its mtime, so lease and age
checks compare server timestamps with server timestamps, whatever the hosts' clocks say.
Candidates stand in a line under <root>/janitor; its head is the active janitor.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from zkqueue import defaults
from zkqueue.dispatch.line import Line
from zkqueue.errors import CorruptRecord, InvalidJob
from zkqueue.operations.expiry import Expiry, ExpiryLimits
from zkqueue.plumbing.connection import TRANSIENT, ConnectionSettings, close, connect
from zkqueue.protocol import counts
from zkqueue.protocol import result as results
from zkqueue.protocol.claims import Claims, reclaim, remove_lane
from zkqueue.protocol.counters import (
    CORRECTIONS,
    encode_corrections,
    encode_counters,
    parse_corrections,
    parse_counters,
)
from zkqueue.protocol.layout import (
    DEFAULT_TENANT,
    EntryName,
    Layout,
    child,
    lane_parts,
    parse_bucket,
)
from zkqueue.protocol.nodes import own_untracked
from zkqueue.protocol.records import ClaimBody
from zkqueue.protocol.spec import JobSpec

log = logging.getLogger("zkq.janitor")
#: Pending buckets per priority whose new entries one pass reads (their specs, once).
_BUCKETS_PER_PASS = 1


@dataclass
class PassReport:
    reclaimed: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    results_removed: int = 0
    dead_removed: int = 0
    #: Stored results per queue after the pass, and the estimated bytes of their records.
    results_stored: dict[str, int] = field(default_factory=dict)
    results_bytes: dict[str, int] = field(default_factory=dict)
    #: Tenants' lanes removed (empty for ``lane_idle``), as ``<queue>/<priority>/@<tenant>``.
    lanes_removed: list[str] = field(default_factory=list)


@dataclass
class _Deadline:
    """A waiting entry with a queue_timeout (its spec never changes)."""

    priority: str
    entry: EntryName
    queue_timeout: float
    ctime: float
    version: int


@dataclass
class _Scan:
    """Where the deadline scan of one queue stands: the next bucket per priority, the highest
    sequence read per bucket, and the entries with a deadline found so far."""

    cursor: dict[str, int] = field(default_factory=dict)
    seen: dict[tuple[str, int], int] = field(default_factory=dict)
    deadlines: dict[str, _Deadline] = field(default_factory=dict)


class Janitor:
    """One housekeeping pass over every queue under a root (call ``run_pass``)."""

    def __init__(
        self,
        zk: KazooClient,
        layout: Layout,
        *,
        result_ttl: float = defaults.RESULT_TTL,
        worker_id: str = "janitor",
        limits: ExpiryLimits | None = None,
        lane_idle: float = defaults.LANE_IDLE,
    ) -> None:
        self.zk = zk
        self.layout = layout
        self.result_ttl = result_ttl
        self.lane_idle = lane_idle
        #: Each empty lane's tail bucket as last seen: (its pzxid and data version, the server
        #: time since when they were so), by (queue, lane).
        self._quiet: dict[tuple[str, str], tuple[int, int, float]] = {}
        self.worker_id = worker_id
        self.limits = limits or ExpiryLimits()
        self._scans: dict[str, _Scan] = {}
        self._expiry: dict[str, Expiry] = {}

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
        if (
            report.reclaimed
            or report.expired
            or report.results_removed
            or report.dead_removed
            or report.lanes_removed
        ):
            log.info("janitor pass: %s", report)
        return report

    def _queue_pass(self, queue: str, now: float, report: PassReport) -> None:
        claimed = self._reclaim_expired(queue, now, report)
        self._expire_waiting(queue, claimed, now, report)
        expiry = self._expiry.setdefault(queue, Expiry(self.zk, self.layout, queue, self.limits))
        removed, stored, size = expiry.run(now, self.result_ttl)
        report.results_removed += removed
        report.results_stored[queue], report.results_bytes[queue] = stored, size
        report.dead_removed += expiry.trim_dead()

    def _reclaim_expired(self, queue: str, now: float, report: PassReport) -> set[str]:
        """Delete claims whose lease ran out; returns the ids still claimed."""
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
            if now <= stat.mtime / 1000 + lease or not self._reclaim(queue, name, body, stat):
                live.add(name)
                continue
            report.reclaimed.append(name)
            log.warning(
                "reclaimed job %s from %s: no lease renewal for %.0fs",
                name,
                body.worker if body else "an unreadable claim",
                now - stat.mtime / 1000,
            )
        return live

    def _reclaim(self, queue: str, name: str, body: ClaimBody | None, stat: object) -> bool:
        claim = self.layout.claim(queue, name)
        version = stat.version  # type: ignore[attr-defined]
        if body is None or body.entry is None:
            # A claim nobody can read (or that names no entry): it only goes, fenced by its
            # own version; the entry, if any, is pending again.
            return reclaim(self.zk, self.layout, queue, claim, version)
        priority, _, entry = body.entry.partition("/")
        path = self.layout.entry(queue, priority, entry)
        return reclaim(self.zk, self.layout, queue, claim, version, (path, body.token))

    def _expire_waiting(
        self, queue: str, claimed: set[str], now: float, report: PassReport
    ) -> None:
        scan = self._scans.setdefault(queue, _Scan())
        #: The priorities each tenant has a lane in (the default tenant's: all of them).
        lanes = {DEFAULT_TENANT: set(defaults.PRIORITIES)}
        for priority in defaults.PRIORITIES:
            for path in counts.lanes(self.zk, self.layout, queue, priority):
                self._scan(queue, path, scan)
                if "/" not in path:
                    continue  # the default tenant's lane is the priority itself: never removed
                if self._prune_lane(queue, path, now):
                    report.lanes_removed.append(f"{queue}/{path}")
                else:
                    lanes.setdefault(lane_parts(path)[1], set()).add(priority)
        self._prune_counters(queue, lanes)
        for name, d in list(scan.deadlines.items()):
            if d.entry.job_id in claimed or now - d.ctime <= d.queue_timeout:
                continue
            if self._expire(queue, d, now):
                report.expired.append(d.entry.job_id)
            del scan.deadlines[name]  # expired, or claimed/changed since: a later scan re-reads

    def _prune_lane(self, queue: str, path: str, now: float) -> bool:
        """Remove a tenant's lane whose only bucket held no entry and did not change (no entry
        created or removed, no arrival signal) for ``lane_idle`` seconds: one multi deleting
        the bucket and the lane at the versions read, so an enqueue meanwhile fails it. A
        producer that still knew the lane makes it again (its enqueue finds it gone)."""
        key = (queue, path)
        node = self.layout.pending(queue, path)
        try:
            buckets, lane_stat = self.zk.get_children(node, include_data=True)
        except NoNodeError:
            self._quiet.pop(key, None)
            return False
        stat = self.zk.exists(f"{node}/{buckets[0]}") if len(buckets) == 1 else None
        if stat is None or stat.numChildren:
            self._quiet.pop(key, None)
            return False
        seen = (stat.pzxid, stat.version)
        pzxid, version, since = self._quiet.get(key, (*seen, now))
        if (pzxid, version) != seen:
            pzxid, version, since = (*seen, now)
        self._quiet[key] = (pzxid, version, since)
        if now - since < self.lane_idle:
            return False
        bucket = parse_bucket(buckets[0])
        versions = (stat.version, lane_stat.version)
        if bucket is None or not remove_lane(self.zk, self.layout, queue, path, bucket, versions):
            return False
        self._quiet.pop(key, None)
        priority, tenant = lane_parts(path)
        log.info("removed tenant %s's lane in %s/%s: empty", tenant, queue, priority)
        return True

    def _prune_counters(self, queue: str, lanes: dict[str, set[str]]) -> None:
        """Drop the fair-share counters and corrections of tenants with no lane left in any
        priority (``lanes``: the priorities each tenant has a lane in), and the claim frontier
        of each lane that is gone (one made again starts its sequence over). Versioned writes,
        every pass: a head's write meanwhile may put an entry back, and the next pass drops it
        again."""
        base = self.layout.service(queue)
        try:
            data, stat = self.zk.get(base)
        except NoNodeError:
            pass
        else:
            found = parse_counters(data)
            kept = {
                t: replace(c, next={p: o for p, o in c.next.items() if p in lanes[t]})
                for t, c in found.items()
                if t in lanes
            }
            if kept != found:
                with contextlib.suppress(BadVersionError, NoNodeError):
                    self.zk.set(base, encode_counters(kept), version=stat.version)
        path = f"{base}/{CORRECTIONS}"
        try:
            data, stat = self.zk.get(path)
        except NoNodeError:
            return
        fixes = parse_corrections(data)
        if set(fixes) - set(lanes):
            with contextlib.suppress(BadVersionError, NoNodeError):
                fixed = {t: v for t, v in fixes.items() if t in lanes}
                self.zk.set(path, encode_corrections(fixed), version=stat.version)

    def _scan(self, queue: str, priority: str, scan: _Scan) -> None:
        """Read the new entries of the next few buckets of a lane (``priority``: a priority
        or a tenant's lane of it; in turn, wrapping)."""
        numbers = counts.buckets(self.zk, self.layout, queue, priority)
        alive = set(numbers)
        scan.seen = {k: v for k, v in scan.seen.items() if k[0] != priority or k[1] in alive}
        if not numbers:
            return
        start = scan.cursor.get(priority, numbers[0])
        upcoming = [b for b in numbers if b >= start] or numbers
        for bucket in upcoming[:_BUCKETS_PER_PASS]:
            self._scan_bucket(queue, priority, bucket, scan)
        following = [b for b in numbers if b > upcoming[:_BUCKETS_PER_PASS][-1]]
        scan.cursor[priority] = following[0] if following else numbers[0]

    def _scan_bucket(self, queue: str, priority: str, bucket: int, scan: _Scan) -> None:
        seen = scan.seen.get((priority, bucket), -1)
        fresh = [
            e
            for e in counts.bucket_entries(self.zk, self.layout, queue, priority, bucket)
            if e.seq > seen
        ]
        band = lane_parts(priority)[0]
        calls = [(e, self.zk.get_async(self.layout.entry(queue, band, e.name))) for e in fresh]
        for entry, call in calls:
            scan.seen[(priority, bucket)] = max(scan.seen.get((priority, bucket), -1), entry.seq)
            try:
                data, stat = call.get()
                limit = JobSpec.from_bytes(data).queue_timeout
            except (NoNodeError, InvalidJob):
                continue
            if limit is not None:
                scan.deadlines[f"{band}/{entry.name}"] = _Deadline(
                    band, entry, limit, stat.ctime / 1000, stat.version
                )

    def _expire(self, queue: str, d: _Deadline, now: float) -> bool:
        return Claims(self.zk, self.layout, queue, self.worker_id).end_unclaimed(
            d.priority,
            d.entry,
            version=d.version,
            submitted_at=d.ctime,
            status=results.EXPIRED,
            error=f"not started within queue_timeout of {d.queue_timeout:g}s",
            finished_at=now,
        )


class JanitorService:
    """Runs janitor passes on a thread while this process is the elected janitor. Given
    ``settings``, it opens a ZooKeeper session of its own (and closes it on stop)."""

    def __init__(
        self,
        zk: KazooClient | None,
        layout: Layout,
        member_id: str,
        *,
        interval: float = defaults.JANITOR_INTERVAL,
        result_ttl: float = defaults.RESULT_TTL,
        settings: ConnectionSettings | None = None,
        limits: ExpiryLimits | None = None,
        on_pass: Callable[[PassReport], None] | None = None,
        on_resign: Callable[[], None] | None = None,
    ) -> None:
        self._owns = zk is None
        if zk is None:
            if settings is None:
                raise ValueError("JanitorService needs a client or connection settings")
            zk = connect(settings)
        self.janitor = Janitor(
            zk, layout, result_ttl=result_ttl, worker_id=member_id, limits=limits
        )
        self.zk = zk
        self.layout = layout
        self.interval = interval
        #: Called with each pass's report (the worker's stored-results gauges), and when this
        #: process finds it is no longer the janitor (they stop being its to report).
        self.on_pass = on_pass
        self.on_resign = on_resign
        self.passes = 0
        self._led = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        election = layout.janitor()
        self._line = Line(zk, election, member_id, self._wake.set, lambda: zk.ensure_path(election))
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
        if self._owns:
            close(self.zk)

    def _run(self) -> None:
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
            if not self._line.joined:  # in a turn: a failure is tried again at the next one
                with contextlib.suppress(NodeExistsError):
                    self.zk.ensure_path(self.layout.janitor())
                self._line.join()
            self._line.recheck()  # elected: is our place still there? (look again each pass)
            if self._line.is_head():
                self._led = True
                report = self.janitor.run_pass()
                self.passes += 1
                if self.on_pass is not None:
                    self.on_pass(report)
            elif self._led:
                self._led = False
                log.info("no longer the janitor: another process is")
                if self.on_resign is not None:
                    self.on_resign()
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
