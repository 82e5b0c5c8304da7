"""Queues as a whole: the numbers of one queue (waiting, running, limits), the table of every
queue with the workers serving it, and deleting a queue."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, NotEmptyError

from zkqueue import defaults
from zkqueue.errors import JobNotFound, QueueBusy
from zkqueue.protocol import claims, counts, nodes, revision
from zkqueue.protocol.counters import CORRECTIONS, level, parse_corrections, parse_counters
from zkqueue.protocol.layout import Layout, child
from zkqueue.protocol.limits import QueueSettings
from zkqueue.protocol.nodes import data_of
from zkqueue.protocol.registry import read_records

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
    service_call = zk.get_async(layout.service(queue))
    per_lane = counts.bucket_counts(zk, layout, queue)
    depth = counts.by_priority(per_lane)
    found = {k: (s.numChildren if (s := c.get()) else 0) for k, c in calls.items()}
    found["results"] = counts.results(zk, layout, queue)
    waiting = counts.not_started(depth, found["running"])
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
        "promote_after": settings.promote_after,
        "tenants": _tenants(zk, layout, queue, per_lane, settings, service_call),
    }


def _tenants(
    zk: KazooClient,
    layout: Layout,
    queue: str,
    per_lane: dict[str, list[tuple[int, int]]],
    settings: QueueSettings,
    service_call: Any,
) -> dict[str, dict[str, Any]]:
    """Per tenant with a lane, a counter or settings: its depth per priority (running jobs
    included), its weight and cap, and its service counter (weighted tokens; fair share)."""
    fixes = parse_corrections(data_of(zk.get_async(f"{layout.service(queue)}/{CORRECTIONS}")))
    counters = parse_counters(data_of(service_call))
    tenants: dict[str, dict[str, Any]] = {}
    for (priority, tenant), n in counts.by_tenant(per_lane).items():
        row = tenants.setdefault(tenant, {"depth": dict.fromkeys(defaults.PRIORITIES, 0)})
        row["depth"][priority] += n
    for name in {*tenants, *counters, *settings.tenants}:
        row = tenants.setdefault(name, {"depth": dict.fromkeys(defaults.PRIORITIES, 0)})
        row.update(settings.tenant(name).to_dict())
        row.setdefault("max_pending", None)
        counter = counters.get(name)
        row["service"] = None if counter is None else level(counter, fixes.get(name))
    return dict(sorted(tenants.items()))


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
                "promote_after": stats["promote_after"] if stats else None,
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
    # The completeness marker first (the last directory a queue is made with): a delete that
    # stops anywhere after it leaves a queue every producer and worker makes whole again.
    # Then pending, a priority at a time in one multi (its buckets and its node: all or
    # nothing); without force a job submitted after the count above makes its bucket's delete
    # fail, and the queue stays with it. Then the rest, and the queue's node last, never
    # recursively: a producer that made the queue again meanwhile keeps it (and its job).
    try:
        _delete_tree(zk, layout.queue_dirs(queue)[-1], queue)  # it may hold results
        for priority in defaults.PRIORITIES:
            for path in counts.lanes(zk, layout, queue, priority)[::-1]:  # tenants' first
                _delete_priority(zk, layout.pending(queue, path), force, queue)
        for directory in (
            layout.claims,
            layout.line,
            layout.busy,
            layout.expiry,
            layout.dead,
            layout.service,
            layout.results,
        ):
            _delete_tree(zk, directory(queue), queue)
        for path in (layout.queue_dirs(queue)[0], layout.queue(queue)):  # pending, the queue
            with contextlib.suppress(NoNodeError):
                zk.delete(path)
    except NotEmptyError:
        revision.ensure_dirs(zk, layout, queue, all_of=True)
        raise QueueBusy(
            f"queue {queue!r} was made again while it was being deleted (a producer or worker "
            "used it); it stays"
        ) from None
    except QueueBusy:
        revision.ensure_dirs(zk, layout, queue, all_of=True)  # what went before the job came
        raise
    return stats


def _delete_priority(zk: KazooClient, path: str, force: bool, queue: str) -> None:
    """Delete a priority's buckets and its node in one multi (all or nothing: a tail pointer
    never outlives its bucket); their entries first, only with ``force``."""
    for _ in range(_DELETE_TRIES):
        try:
            buckets = [child(path, b) for b in zk.get_children(path)]
        except NoNodeError:
            return
        if force:
            for bucket in buckets:
                for name in nodes.children(zk, bucket):
                    with contextlib.suppress(NoNodeError):
                        zk.delete(child(bucket, name), recursive=True)
        outcome = claims.delete_all(zk, [*buckets, path])
        if not claims.transaction_failed(outcome):
            return
        if not force and any(isinstance(r, NotEmptyError) for r in outcome):
            raise QueueBusy(
                f"a job was submitted to queue {queue!r} while it was being deleted: the "
                "queue stays, with it"
            )
        # a bucket went or came meanwhile (another delete, a head pruning, a new tail): again
    raise QueueBusy(f"queue {queue!r} keeps getting new jobs; try again")


def _delete_tree(zk: KazooClient, path: str, queue: str) -> None:
    """Delete a directory of the queue that holds no jobs (claims, results...) and all below."""
    for _ in range(_DELETE_TRIES):
        try:
            zk.delete(path, recursive=True)
            return
        except NoNodeError:
            return
        except NotEmptyError:  # a worker or producer created a node below meanwhile: again
            time.sleep(0.1)
    raise QueueBusy(f"queue {queue!r} keeps getting new nodes; try again")
