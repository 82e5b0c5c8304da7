"""Listing a queue's jobs, page by page, and a job's place in the order workers take them."""

from __future__ import annotations

from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zkqueue import defaults
from zkqueue.errors import CorruptRecord, InvalidJob
from zkqueue.protocol import counts
from zkqueue.protocol.jobpaths import PENDING, RUNNING
from zkqueue.protocol.layout import EntryName, Layout, lane, lane_parts
from zkqueue.protocol.records import ClaimBody

#: Entries whose stats are read in one pipelined page.
_PAGE = 500


def claimed(zk: KazooClient, layout: Layout, queue: str) -> set[str]:
    """Ids of the running jobs (one claim per id; as many as busy worker slots)."""
    try:
        return set(zk.get_children(layout.claims(queue)))
    except NoNodeError:
        return set()


class _Places:
    """Each pending job's place as ``position`` gives it: the pending jobs of the priorities
    above its own, and those ahead of it in its own lane. Other tenants' lanes of its priority
    are not counted: the head takes from them by fair share, interleaved with its lane."""

    def __init__(self) -> None:
        self.priority: str | None = None
        #: Pending jobs of the priorities listed before ``priority``.
        self.higher = 0
        #: Pending jobs of ``priority`` so far, by tenant.
        self.lanes: dict[str, int] = {}

    def next(self, priority: str, tenant: str) -> int:
        if priority != self.priority:
            self.priority, self.higher = priority, self.higher + sum(self.lanes.values())
            self.lanes = {}
        self.lanes[tenant] = self.lanes.get(tenant, 0) + 1
        return self.higher + self.lanes[tenant]


def list_jobs(
    zk: KazooClient, layout: Layout, queue: str, limit: int | None
) -> list[dict[str, Any]]:
    """Pending and running jobs, at most ``limit`` (None: all): priority by priority, and in
    each lane by lane (the default tenant's, then each tenant's by name), each lane in the
    order its jobs are taken; between lanes the head takes by fair share. A pending job's
    ``position`` is its place as ``position`` counts it."""
    running = claimed(zk, layout, queue)
    rows: list[dict[str, Any]] = []
    places = _Places()
    page: list[tuple[str, EntryName]] = []
    for item in counts.in_order(zk, layout, queue):
        if limit is not None and len(rows) + len(page) >= limit:
            break
        page.append(item)
        if len(page) >= _PAGE:
            _rows(zk, layout, queue, page, running, rows, places)
            page = []
    _rows(zk, layout, queue, page, running, rows, places)
    return rows


def _rows(
    zk: KazooClient,
    layout: Layout,
    queue: str,
    page: list[tuple[str, EntryName]],
    running: set[str],
    rows: list[dict[str, Any]],
    places: _Places,
) -> None:
    stats = [zk.exists_async(layout.entry(queue, p, e.name)) for p, e in page]
    claims = {
        e.job_id: zk.get_async(layout.claim(queue, e.job_id))
        for _, e in page
        if e.job_id in running
    }
    for (priority, entry), stat_call in zip(page, stats, strict=True):
        stat = stat_call.get()
        if stat is None:
            continue  # finished while we listed
        row = {
            "id": entry.job_id,
            "queue": queue,
            "priority": priority,
            "tenant": entry.tenant_name,
            "attempts": stat.version,
            "submitted_at": stat.ctime / 1000,
        }
        if entry.job_id in claims:
            row.update(state=RUNNING, worker=_claim_worker(claims[entry.job_id]))
        else:
            row.update(state=PENDING, position=places.next(priority, entry.tenant_name))
        rows.append(row)


def position(zk: KazooClient, layout: Layout, queue: str, entry: str) -> int | None:
    """About the 1-based place of ``entry`` among the unclaimed entries: entries in earlier
    buckets of its lane and in the lanes of higher priorities counted from their stats, those
    of them running taken off. Other tenants' lanes of its own priority are not counted: the
    head takes from them by fair share, interleaved with this one."""
    parsed = EntryName.parse(entry)
    calls = {p: zk.exists_async(layout.entry(queue, p, entry)) for p in defaults.PRIORITIES}
    mine = next((p for p, call in calls.items() if call.get() is not None), None)
    if mine is None:
        return None
    running = claimed(zk, layout, queue)
    own_lane = lane(mine, parsed.tenant)
    higher = defaults.PRIORITIES[: defaults.PRIORITIES.index(mine)]
    ahead = 0
    for path, pairs in counts.bucket_counts(zk, layout, queue).items():
        priority = lane_parts(path)[0]
        if priority == mine and path != own_lane:
            continue
        for bucket, n in pairs:
            if path == own_lane and bucket == parsed.bucket:
                own = counts.bucket_entries(zk, layout, queue, path, bucket)
                waiting = [e for e in own if e.order < parsed.order and e.job_id not in running]
                counted = _running_in(zk, layout, queue, running, higher, own_lane, bucket)
                return max(1, ahead - counted + len(waiting) + 1)
            ahead += n
    return None


def _running_in(
    zk: KazooClient,
    layout: Layout,
    queue: str,
    running: set[str],
    higher: tuple[str, ...],
    own_lane: str,
    bucket: int,
) -> int:
    """How many running jobs have their entry where ``position`` counted entries: in a lane of
    a ``higher`` priority, or in ``own_lane`` before ``bucket`` (read from their claims, one
    pipelined request each: as many as busy worker slots). A claim that names no entry, or
    that cannot be read, counts, as all did before claims named their entries."""
    calls = [zk.get_async(layout.claim(queue, job_id)) for job_id in running]
    counted = 0
    for call in calls:
        try:
            data, _ = call.get()
            named = ClaimBody.from_bytes(data).entry
        except NoNodeError:
            continue  # ended meanwhile
        except CorruptRecord:
            named = None
        if named is None:
            counted += 1
            continue
        priority, _, rest = named.partition("/")
        try:
            where = EntryName.parse(rest)
        except InvalidJob:
            counted += 1
            continue
        in_lane = lane(priority, where.tenant)
        counted += priority in higher or (in_lane == own_lane and where.bucket < bucket)
    return counted


def _claim_worker(call: Any) -> str | None:
    try:
        data, _ = call.get()
    except NoNodeError:
        return None
    try:
        return ClaimBody.from_bytes(data).worker
    except CorruptRecord:
        return "?"  # the listing shows the job as running; `zkq status` names the bad node
