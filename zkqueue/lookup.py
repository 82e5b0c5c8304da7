"""Finding jobs by id: one (its result, its claim, or its entry in the buckets), or a batch of
ids a producer chose, in a few pipelined passes whatever their number."""

from __future__ import annotations

import contextlib

from kazoo.exceptions import NoNodeError

from zkqueue import counts, defaults
from zkqueue.errors import CorruptRecord
from zkqueue.job import Job, Owner
from zkqueue.records import ClaimBody
from zkqueue.result import Result


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
        name = counts.find(client.zk, client.layout, queue, priority, job_id)
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
            found[jid] = Job(client, jid, queue, record.priority)
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
