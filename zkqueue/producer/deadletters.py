"""Dead letters: listing them, and re-enqueuing a job whose letter holds a valid spec."""

from __future__ import annotations

import logging
import time
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zkqueue.errors import CorruptRecord, InvalidJob, JobNotFound
from zkqueue.protocol import claims
from zkqueue.protocol.layout import Layout, lane, tenant_of_child
from zkqueue.protocol.records import DeadLetter
from zkqueue.protocol.result import Result, Status
from zkqueue.protocol.spec import JobSpec

log = logging.getLogger("zkq.dead")
#: Letters read or deleted per pipelined page.
_PAGE = 256


def list_dead(zk: KazooClient, layout: Layout, queues: list[str]) -> list[dict[str, Any]]:
    """Every dead letter of ``queues``, oldest first, each with its node ``name``."""
    letters = []
    for queue in queues:
        try:
            names = zk.get_children(layout.dead(queue))
        except NoNodeError:
            continue
        calls = [(n, zk.get_async(layout.dead_node(queue, n))) for n in names]
        for name, call in calls:
            try:
                data, _ = call.get()
            except NoNodeError:
                continue
            try:
                letter = DeadLetter.from_bytes(data, f"dead letter {queue}/{name}").to_dict()
            except CorruptRecord as exc:
                letter = {"id": None, "priority": None, "reason": f"unreadable: {exc}"}
            letter.update(name=name, queue=queue)
            letters.append(letter)
    return sorted(letters, key=lambda x: x.get("dead_at") or 0)


def dead_result(letters: list[dict[str, Any]], job_id: str) -> Result | None:
    """The ``dead`` result of a job known by its dead letter (when the result node is gone:
    removed after the retention, or never written for a hand-made entry)."""
    for letter in letters:
        if letter.get("id") == job_id and letter.get("priority"):
            return Result(
                id=job_id,
                queue=letter["queue"],
                priority=letter["priority"],
                status=Status.DEAD,
                error=letter["reason"],
                worker=letter.get("worker"),
                finished_at=letter.get("dead_at"),
            )
    return None


def requeue(zk: KazooClient, layout: Layout, letter: dict[str, Any]) -> str:
    """Enqueue the letter's spec again under the same id (a detached job, attempts from 0), and
    remove the letter and its ``dead`` result in the same multi. Returns the new entry name."""
    job_id, queue, priority = letter.get("id"), letter["queue"], letter["priority"]
    if not job_id or "raw" not in letter:
        raise InvalidJob(
            f"dead letter {letter['name']} cannot be requeued: it has no job id or no readable spec"
        )
    try:
        data = JobSpec.from_bytes(letter["raw"].encode()).to_bytes()
    except InvalidJob as exc:
        raise InvalidJob(f"dead letter {letter['name']} cannot be requeued: {exc}") from None
    first = str(letter.get("entry") or "").partition("/")[0]
    tenant = tenant_of_child(first)  # the lane it was in, even when its own name was bad
    name = claims.requeue(zk, layout, queue, lane(priority, tenant), job_id, letter["name"], data)
    if name is None:
        raise JobNotFound(f"dead letter {letter['name']} changed while requeueing it; try again")
    log.info("requeued %s as %s/%s", job_id, priority, name)
    return name


def purge(
    zk: KazooClient,
    layout: Layout,
    queue: str,
    *,
    older_than: float | None = None,
    limit: int | None = None,
    now: float | None = None,
) -> int:
    """Delete a queue's dead letters, oldest first: those created more than ``older_than``
    seconds before ``now`` (all when None), at most ``limit``. Returns how many went."""
    try:
        names = zk.get_children(layout.dead(queue))
    except NoNodeError:
        return 0
    stats = []
    for start in range(0, len(names), _PAGE):
        calls = [
            (n, zk.exists_async(layout.dead_node(queue, n))) for n in names[start : start + _PAGE]
        ]
        stats += [(s.ctime, n) for n, c in calls if (s := c.get()) is not None]
    stats.sort()
    if older_than is not None:
        cutoff = ((now if now is not None else time.time()) - older_than) * 1000
        stats = [(c, n) for c, n in stats if c < cutoff]
    doomed = [n for _, n in stats[:limit]]
    removed = 0
    for start in range(0, len(doomed), _PAGE):
        deletes = [
            zk.delete_async(layout.dead_node(queue, n)) for n in doomed[start : start + _PAGE]
        ]
        for call in deletes:
            try:
                call.get()
                removed += 1
            except NoNodeError:
                continue
    if removed:
        log.info("purged %d dead letter(s) of queue %s", removed, queue)
    return removed
