"""Counting and paging without listing whole parents: depths from the child counts of pending
buckets, results from the child counts of their hash buckets, entries in dispatch order bucket by
bucket. Every reply stays far under ZooKeeper's 1 MB limit whatever the depth."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zkqueue import defaults
from zkqueue.errors import InvalidJob
from zkqueue.protocol.layout import (
    RESULT_BUCKETS,
    EntryName,
    Layout,
    in_lane,
    lane,
    lane_mark,
    lane_parts,
    parse_bucket,
    tenant_of_child,
)


def _answer(call: Any) -> Any:
    return call.get()


def buckets(zk: KazooClient, layout: Layout, queue: str, priority: str) -> list[int]:
    """A lane's bucket numbers in order (its child list: one name per ~1,000 entries; none
    while the queue is not set up). ``priority`` is a lane: a priority, or its tenant's."""
    try:
        return _numbers(zk.get_children(layout.pending(queue, priority)))
    except NoNodeError:
        return []


def lanes_in(priority: str, names: list[str]) -> list[str]:
    """The lanes of a priority given its directory's child names: its own (the default
    tenant's), then each tenant's, by name."""
    tenants = sorted(t for n in names if (t := tenant_of_child(n)) is not None)
    return [priority, *(lane(priority, t) for t in tenants)]


def lanes(zk: KazooClient, layout: Layout, queue: str, priority: str) -> list[str]:
    """A priority's lanes (``lanes_in``), from one listing of its directory."""
    try:
        return lanes_in(priority, zk.get_children(layout.pending(queue, priority)))
    except NoNodeError:
        return [priority]


def _numbers(names: list[str]) -> list[int]:
    """The bucket numbers among a priority's child names, in order."""
    return sorted(b for n in names if (b := parse_bucket(n)) is not None)


def _leaves(
    zk: KazooClient, layout: Layout, queue: str, priority: str, numbers: list[int]
) -> Iterator[tuple[int, list[str]]]:
    """Each of these buckets with its children, listed in the order given, 16 pipelined at a
    time (a bucket deleted meanwhile is skipped)."""
    for start in range(0, len(numbers), 16):
        calls = [
            (b, zk.get_children_async(layout.bucket(queue, priority, b)))
            for b in numbers[start : start + 16]
        ]
        for bucket, call in calls:
            try:
                yield bucket, call.get()
            except NoNodeError:
                continue


def bucket_counts(
    zk: KazooClient, layout: Layout, queue: str, wait: Callable[[Any], Any] = _answer
) -> dict[str, list[tuple[int, int]]]:
    """Per lane (priorities first, in order, each followed by its tenants' lanes), (bucket,
    entries in it) in order: the priorities' child names, then the tenants' lanes' bucket names,
    then one stat per bucket, each round pipelined. ``wait`` takes each answer (a caller with a
    deadline bounds it)."""
    listings = {p: zk.get_children_async(layout.pending(queue, p)) for p in defaults.PRIORITIES}
    listed: dict[str, list[int]] = {}
    tenant_calls = {}
    for p, call in listings.items():
        try:
            names = wait(call)
        except NoNodeError:
            names = []
        listed[p] = _numbers(names)
        for path in lanes_in(p, names)[1:]:
            tenant_calls[path] = zk.get_children_async(layout.pending(queue, path))
    for path, call in tenant_calls.items():
        try:
            listed[path] = _numbers(wait(call))
        except NoNodeError:
            listed[path] = []
    listed = {k: listed[k] for k in sorted(listed, key=_lane_order)}
    calls = {
        p: [(b, zk.exists_async(layout.bucket(queue, p, b))) for b in bs]
        for p, bs in listed.items()
    }
    return {
        p: [(b, s.numChildren if (s := wait(c)) is not None else 0) for b, c in pairs]
        for p, pairs in calls.items()
    }


def _lane_order(path: str) -> tuple[int, str]:
    priority, _, tenant = path.partition("/")
    return defaults.PRIORITIES.index(priority), tenant


def by_priority(per_lane: dict[str, list[tuple[int, int]]]) -> dict[str, int]:
    """Entries per priority from ``bucket_counts``: the sums of its lanes."""
    depth = dict.fromkeys(defaults.PRIORITIES, 0)
    for path, pairs in per_lane.items():
        depth[lane_parts(path)[0]] += sum(n for _, n in pairs)
    return depth


def by_tenant(per_lane: dict[str, list[tuple[int, int]]]) -> dict[tuple[str, str], int]:
    """Entries per (priority, tenant) from ``bucket_counts``."""
    return {lane_parts(path): sum(n for _, n in pairs) for path, pairs in per_lane.items()}


def depth(zk: KazooClient, layout: Layout, queue: str) -> dict[str, int]:
    """Entries per priority (running ones included)."""
    return by_priority(bucket_counts(zk, layout, queue))


def waiting(zk: KazooClient, layout: Layout, queue: str) -> int:
    """Jobs of a queue not yet started (``not_started``), from child counts only: never a
    listing of entries. The count that ``max_pending`` bounds and ``zkq stats`` shows."""
    claims = zk.exists_async(layout.claims(queue))
    entries = depth(zk, layout, queue)
    stat = claims.get()
    return not_started(entries, stat.numChildren if stat is not None else 0)


def not_started(depth: dict[str, int], running: int) -> int:
    """Waiting jobs: the entries of every priority (running ones included) minus the claims."""
    return sum(depth.values()) - running


def tenant_waiting(zk: KazooClient, layout: Layout, queue: str, tenant: str | None) -> int:
    """Jobs of one tenant not yet started: its lanes' entries less those claimed. It lists the
    tenant's buckets (a tenant with a cap holds about that many), so only producers of capped
    tenants pay for it."""
    claims = zk.get_children_async(layout.claims(queue))
    paths = [lane(p, tenant) for p in defaults.PRIORITIES]
    numbers = {path: zk.get_children_async(layout.pending(queue, path)) for path in paths}
    calls = []
    for path, call in numbers.items():
        try:
            found = _numbers(call.get())
        except NoNodeError:
            continue
        calls += [zk.get_children_async(layout.bucket(queue, path, b)) for b in found]
    try:
        running = set(claims.get())
    except NoNodeError:
        running = set()
    count = 0
    for call in calls:
        try:
            names = call.get()
        except NoNodeError:
            continue
        count += sum(1 for n in names if "-" in n and n.partition("-")[0] not in running)
    return count


def results(zk: KazooClient, layout: Layout, queue: str) -> int:
    """Stored results of a queue: the sum of its 256 hash buckets' child counts."""
    calls = [zk.exists_async(layout.result_dir(queue, b)) for b in RESULT_BUCKETS]
    return sum(s.numChildren for c in calls if (s := c.get()) is not None)


def bucket_entries(
    zk: KazooClient, layout: Layout, queue: str, priority: str, bucket: int
) -> list[EntryName]:
    """One bucket's parseable entries in order (``priority`` is a lane)."""
    try:
        names = zk.get_children(layout.bucket(queue, priority, bucket))
    except NoNodeError:
        return []
    tenant = lane_mark(priority)
    parsed = []
    for leaf in names:
        try:
            parsed.append(EntryName.parse_leaf(leaf, bucket, tenant))
        except InvalidJob:
            continue
    return sorted(parsed, key=lambda e: e.order)


def in_order(zk: KazooClient, layout: Layout, queue: str) -> Iterator[tuple[str, EntryName]]:
    """Every entry of a queue, listing one bucket at a time (lazily): priorities in order, and
    in each its lanes one after the other (the default tenant's, then the others' by name;
    among tenants the head dispatches by fair share, ``zkqueue.dispatch.share``)."""
    for priority in defaults.PRIORITIES:
        for path in lanes(zk, layout, queue, priority):
            for bucket in buckets(zk, layout, queue, path):
                for entry in bucket_entries(zk, layout, queue, path, bucket):
                    yield priority, entry


def find(zk: KazooClient, layout: Layout, queue: str, priority: str, job_id: str) -> str | None:
    """The entry name (below its priority) of a job id in one lane: its buckets are listed
    newest first, pipelined a few at a time (a lost reply's entry is in the tail)."""
    prefix = f"{job_id}-"
    newest_first = buckets(zk, layout, queue, priority)[::-1]
    for bucket, leaves in _leaves(zk, layout, queue, priority, newest_first):
        leaf = next((n for n in leaves if n.startswith(prefix)), None)
        if leaf is not None:
            return in_lane(priority, f"{bucket:010d}/{leaf}")
    return None


def find_many(
    zk: KazooClient, layout: Layout, queue: str, job_ids: set[str]
) -> dict[str, tuple[str, str]]:
    """The (priority, entry name) of each of ``job_ids`` pending or running in the queue, in
    one pass over its buckets (each listed once, pipelined 16 at a time), whatever their
    number: what a batch of chosen ids costs to look up."""
    found: dict[str, tuple[str, str]] = {}
    for priority in defaults.PRIORITIES:
        for path in lanes(zk, layout, queue, priority):
            numbers = buckets(zk, layout, queue, path)
            for bucket, leaves in _leaves(zk, layout, queue, path, numbers):
                for leaf in leaves:
                    job_id = leaf.rpartition("-")[0]
                    if job_id in job_ids and job_id not in found:
                        name = f"{bucket:010d}/{leaf}"
                        found[job_id] = (priority, in_lane(path, name))
    return found
