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
from zkqueue.protocol.layout import RESULT_BUCKETS, EntryName, Layout, parse_bucket


def _answer(call: Any) -> Any:
    return call.get()


def buckets(zk: KazooClient, layout: Layout, queue: str, priority: str) -> list[int]:
    """A priority's bucket numbers in order (its child list: one name per ~1,000 entries; none
    while the queue is not set up)."""
    try:
        return _numbers(zk.get_children(layout.pending(queue, priority)))
    except NoNodeError:
        return []


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
    """Per priority, (bucket, entries in it) in order: the priorities' bucket names, then one
    stat per bucket, each round pipelined. ``wait`` takes each answer (a caller with a deadline
    bounds it)."""
    listings = {p: zk.get_children_async(layout.pending(queue, p)) for p in defaults.PRIORITIES}
    listed = {}
    for p, call in listings.items():
        try:
            names = wait(call)
        except NoNodeError:
            names = []
        listed[p] = _numbers(names)
    calls = {
        p: [(b, zk.exists_async(layout.bucket(queue, p, b))) for b in bs]
        for p, bs in listed.items()
    }
    return {
        p: [(b, s.numChildren if (s := wait(c)) is not None else 0) for b, c in pairs]
        for p, pairs in calls.items()
    }


def depth(zk: KazooClient, layout: Layout, queue: str) -> dict[str, int]:
    """Entries per priority (running ones included)."""
    return {p: sum(n for _, n in pairs) for p, pairs in bucket_counts(zk, layout, queue).items()}


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


def results(zk: KazooClient, layout: Layout, queue: str) -> int:
    """Stored results of a queue: the sum of its 256 hash buckets' child counts."""
    calls = [zk.exists_async(layout.result_dir(queue, b)) for b in RESULT_BUCKETS]
    return sum(s.numChildren for c in calls if (s := c.get()) is not None)


def bucket_entries(
    zk: KazooClient, layout: Layout, queue: str, priority: str, bucket: int
) -> list[EntryName]:
    """One bucket's parseable entries in order."""
    try:
        names = zk.get_children(layout.bucket(queue, priority, bucket))
    except NoNodeError:
        return []
    parsed = []
    for leaf in names:
        try:
            parsed.append(EntryName.parse_leaf(leaf, bucket))
        except InvalidJob:
            continue
    return sorted(parsed, key=lambda e: e.order)


def in_order(zk: KazooClient, layout: Layout, queue: str) -> Iterator[tuple[str, EntryName]]:
    """Every entry of a queue in dispatch order, listing one bucket at a time (lazily)."""
    for priority in defaults.PRIORITIES:
        for bucket in buckets(zk, layout, queue, priority):
            for entry in bucket_entries(zk, layout, queue, priority, bucket):
                yield priority, entry


def find(zk: KazooClient, layout: Layout, queue: str, priority: str, job_id: str) -> str | None:
    """The entry name of a job id in one priority: its buckets are listed newest first,
    pipelined a few at a time (a lost reply's entry is in the tail)."""
    prefix = f"{job_id}-"
    newest_first = buckets(zk, layout, queue, priority)[::-1]
    for bucket, leaves in _leaves(zk, layout, queue, priority, newest_first):
        leaf = next((n for n in leaves if n.startswith(prefix)), None)
        if leaf is not None:
            return f"{bucket:010d}/{leaf}"
    return None


def find_many(
    zk: KazooClient, layout: Layout, queue: str, job_ids: set[str]
) -> dict[str, tuple[str, str]]:
    """The (priority, entry name) of each of ``job_ids`` pending or running in the queue, in
    one pass over its buckets (each listed once, pipelined 16 at a time), whatever their
    number: what a batch of chosen ids costs to look up."""
    found: dict[str, tuple[str, str]] = {}
    for priority in defaults.PRIORITIES:
        numbers = buckets(zk, layout, queue, priority)
        for bucket, leaves in _leaves(zk, layout, queue, priority, numbers):
            for leaf in leaves:
                job_id = leaf.rpartition("-")[0]
                if job_id in job_ids and job_id not in found:
                    found[job_id] = (priority, f"{bucket:010d}/{leaf}")
    return found
