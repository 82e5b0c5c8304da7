"""Queues as a whole: the numbers of one queue (waiting, running, limits), the table of every
queue with the workers serving it, and deleting a queue."""

from __future__ import annotations

import time
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, NotEmptyError

from zkqueue import counts
from zkqueue.errors import JobNotFound, QueueBusy
from zkqueue.layout import Layout
from zkqueue.limits import QueueSettings
from zkqueue.registry import read_records

#: Tries at a recursive delete that a concurrent create keeps from finishing.
_DELETE_TRIES = 5


def queue_stats(zk: KazooClient, layout: Layout, queue: str) -> dict[str, Any]:
    """Depth per priority (running jobs included), ``waiting`` (= ``pending``, not started),
    ``running``, idle workers in the line, results, dead letters and the queue's limits; each
    number is a child count from stat reads (bucket by bucket), nothing long is listed."""
    calls = {
        "running": zk.exists_async(layout.claims(queue)),
        "idle_workers": zk.exists_async(layout.line(queue)),
        "dead": zk.exists_async(layout.dead(queue)),
    }
    settings_call = zk.get_async(layout.queue(queue))
    depth = counts.depth(zk, layout, queue)
    found = {k: (s.numChildren if (s := c.get()) else 0) for k, c in calls.items()}
    found["results"] = counts.results(zk, layout, queue)
    waiting = sum(depth.values()) - found["running"]
    try:
        settings = QueueSettings.from_bytes(settings_call.get()[0])
    except NoNodeError:
        settings = QueueSettings()
    return {
        "depth": depth,
        "pending": waiting,
        "waiting": waiting,
        **found,
        "max_pending": settings.max_pending,
        "max_running": settings.max_running,
    }


def queue_table(
    zk: KazooClient, layout: Layout, names: list[str], workers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per queue (every queue with a node, and every queue a worker serves): its
    workers, limits and depth."""
    serving = serving_workers(workers)
    rows = []
    for queue in sorted({*names, *serving}):
        stats = queue_stats(zk, layout, queue) if queue in names else None
        rows.append(
            {
                "queue": queue,
                "workers": sorted(serving.get(queue, [])),
                "waiting": stats["waiting"] if stats else 0,
                "running": stats["running"] if stats else 0,
                "dead": stats["dead"] if stats else 0,
                "max_pending": stats["max_pending"] if stats else None,
                "max_running": stats["max_running"] if stats else None,
            }
        )
    return rows


def serving_workers(workers: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Worker ids by the queue they serve, from their registrations."""
    serving: dict[str, list[str]] = {}
    for record in workers:
        for queue in record.get("queues") or [record.get("queue")]:
            if isinstance(queue, str):
                serving.setdefault(queue, []).append(str(record.get("id")))
    return serving


def delete_queue(zk: KazooClient, layout: Layout, queue: str, *, force: bool) -> dict[str, Any]:
    """Delete a queue and everything under it (results and dead letters too). Refused while
    a worker serves it (its place in the line and its watches would go with the tree), and
    while jobs wait or run unless ``force``; returns the numbers it had."""
    if zk.exists(layout.queue(queue)) is None:
        raise JobNotFound(f"no queue {queue!r}")
    serving = sorted(serving_workers(read_records(zk, layout)).get(queue, []))
    if serving:
        more = f" and {len(serving) - 3} more" if len(serving) > 3 else ""
        shown = ", ".join(serving[:3]) + more
        raise QueueBusy(
            f"queue {queue!r} is served by {len(serving)} worker(s) ({shown}); stop them "
            f"first (zkq workers lists them), then delete it"
        )
    stats = queue_stats(zk, layout, queue)
    if not force and (stats["waiting"] or stats["running"]):
        raise QueueBusy(
            f"queue {queue!r} has {stats['waiting']} waiting and {stats['running']} running "
            "job(s); cancel them or delete with --force"
        )
    for attempt in range(_DELETE_TRIES):
        try:
            zk.delete(layout.queue(queue), recursive=True)
            break
        except NoNodeError:
            break
        except NotEmptyError:  # a producer or worker created a node meanwhile: again
            if attempt == _DELETE_TRIES - 1:
                raise QueueBusy(f"queue {queue!r} keeps getting new nodes; try again") from None
            time.sleep(0.1)
    return stats
