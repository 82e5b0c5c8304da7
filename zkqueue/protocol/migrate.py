"""``zkq migrate``: move a root written by protocol version 1 or 2 to version 3.

Version 2 to 3 moves nothing: version 3 adds tenants' lanes (``pending/<priority>/@<tenant>``)
beside the default tenant's buckets, which stay where they are, and the tenants' service
counters (``service/``). The step needs the version 2 workers stopped (their head would take a
tenant's lane for a malformed entry): it refuses while a queue has claims or a line, creates
the new directories and writes ``3``.

Version 1 kept pending entries flat (``pending/<priority>/<id>-<seq>``), results flat
(``results/<id>``) and claims by entry name. The move needs the queue idle of version 1 workers
(no claims, no line): it refuses otherwise. Detached entries move in dispatch order into buckets
(each move one multi: create the new entry, delete the old), keeping their spec; attached
(ephemeral) entries belong to version 1 callers and cannot be moved: they are left to their
sessions, and reported. Results move into their hash buckets with an expiry index node. Dead
letters keep their names. Then ``<root>/protocol`` says 3 (version 1's layout is version 2's
with no tenants)."""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from zkqueue import defaults
from zkqueue.errors import ConfigurationError
from zkqueue.protocol import claims, revision
from zkqueue.protocol.layout import PROTOCOL_VERSION, EntryName, Layout, child, parse_bucket
from zkqueue.protocol.nodes import Ticks, children
from zkqueue.protocol.result import Result

log = logging.getLogger("zkq.migrate")


@dataclass
class MigrationReport:
    entries: int = 0
    results: int = 0
    left_attached: int = 0
    skipped: list[str] = field(default_factory=list)


def migrate(
    zk: KazooClient, layout: Layout, bucket_size: int = defaults.PENDING_BUCKET
) -> MigrationReport:
    """Move every queue of a version 1 or 2 root to version 3 (a version 3 root: nothing to
    do)."""
    report = MigrationReport()
    version = revision.read_version(zk, layout)
    if version == PROTOCOL_VERSION:
        return report
    if version not in (None, 1, 2):
        raise ConfigurationError(revision.mismatch(layout, version))
    try:
        queues = sorted(zk.get_children(layout.queues()))
    except NoNodeError:
        queues = []
    for queue in queues:
        _check_idle(zk, layout, queue, version or 1)
    for queue in queues:
        if version == 2:
            revision.ensure_dirs(zk, layout, queue, all_of=True)
        else:
            _migrate_queue(zk, layout, queue, bucket_size, report)
    marker = str(PROTOCOL_VERSION).encode()
    try:
        zk.create(layout.protocol(), marker, makepath=True)
    except NodeExistsError:
        zk.set(layout.protocol(), marker)
    return report


def _check_idle(zk: KazooClient, layout: Layout, queue: str, version: int) -> None:
    for path in (layout.claims(queue), layout.line(queue)):
        stat = zk.exists(path)
        if stat is not None and stat.numChildren:
            raise ConfigurationError(
                f"queue {queue!r} still has version {version} workers ({path} is not empty): "
                "stop them before migrating"
            )


def _migrate_queue(
    zk: KazooClient, layout: Layout, queue: str, bucket_size: int, report: MigrationReport
) -> None:
    ticks = Ticks()
    flat_results = [n for n in children(zk, layout.results(queue)) if len(n) != 2]
    revision.ensure_dirs(zk, layout, queue)
    for priority in defaults.PRIORITIES:
        _move_entries(zk, layout, queue, priority, bucket_size, report)
    for job_id in flat_results:
        old = child(layout.results(queue), job_id)
        try:
            data, stat = zk.get(old)
        except NoNodeError:
            continue
        try:
            finished = Result.from_bytes(data).finished_at or stat.mtime / 1000
        except Exception:
            finished = stat.mtime / 1000
        ticks.ensure(zk, layout, queue, finished)
        index = layout.expiry_entry(queue, finished, job_id, len(data))
        if claims.move(zk, old, layout.result(queue, job_id), data, index=index) is None:
            report.skipped.append(old)
        else:
            report.results += 1


def _move_entries(
    zk: KazooClient, layout: Layout, queue: str, priority: str, size: int, report: MigrationReport
) -> None:
    directory = layout.pending(queue, priority)
    flat = []
    for name in children(zk, directory):
        if parse_bucket(name) is not None:
            continue
        try:
            flat.append(EntryName.parse_leaf(name, 0))
        except Exception:
            report.skipped.append(child(directory, name))
    bucket, moved = 0, 0
    for entry in sorted(flat, key=lambda e: e.order):
        old = child(directory, entry.leaf)
        try:
            data, stat = zk.get(old)
        except NoNodeError:
            continue
        if stat.ephemeralOwner:
            report.left_attached += 1
            continue
        if moved and moved % size == 0:
            bucket += 1
            with suppress(NodeExistsError):
                zk.create(layout.bucket(queue, priority, bucket))
            zk.set(directory, str(bucket).encode())
        prefix = layout.entry_prefix(queue, priority, entry.job_id, bucket)
        if claims.move(zk, old, prefix, data, sequence=True) is None:
            report.skipped.append(old)
            continue
        moved += 1
        report.entries += 1
    log.info("queue %s/%s: %d entries moved at %s", queue, priority, moved, time.time())
