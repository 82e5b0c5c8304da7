"""The claim/complete protocol: every state change of a job is one ZooKeeper multi.

- claim:    create claims/<entry> (ephemeral) + set_data(entry, same bytes, version=read version)
            [+ leave the line, + rejoin it at the back]. The entry's new version is the fencing
            token and the attempt count.
- complete: check(entry, token) + create results/<id> + delete(entry) + delete(claims/<entry>)
            [+ rejoin the line]. A stale worker's multi fails as a whole.
- release:  check(entry, token) + delete(claims/<entry>): the job is pending again.
- dead:     create dead/<entry> + create results/<id> + delete(entry, version).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import ZnodeStat

from zkqueue import defaults
from zkqueue import result as results
from zkqueue.layout import EntryName, Layout, child
from zkqueue.line import Line
from zkqueue.records import Candidate, Claim, ClaimBody, DeadLetter
from zkqueue.result import Result

log = logging.getLogger("zkq.claims")
#: Nodes below an entry that dead-lettering removes at most (one multi must stay small).
_MAX_DESCENDANTS = 256


class Claims:
    """Runs the protocol's transactions for one worker on one queue."""

    def __init__(
        self,
        zk: KazooClient,
        layout: Layout,
        queue: str,
        worker_id: str,
        lease: float = defaults.LEASE,
    ) -> None:
        self.zk = zk
        self.layout = layout
        self.queue = queue
        self.worker_id = worker_id
        #: Seconds a claim stays valid without a renewal (written into the claim for the janitor).
        self.lease = lease

    def entry_path(self, priority: str, entry: EntryName) -> str:
        return self.layout.entry(self.queue, priority, entry.name)

    def claim(self, picked: list[Candidate], line: Line, rejoin: bool) -> list[Claim] | None:
        """Claim ``picked`` in one multi that also leaves the line (and rejoins it at the back
        when slots stay free). None if any entry changed under us: nothing was claimed."""
        now = time.time()
        txn = self.zk.transaction()
        bodies = []
        for c in picked:
            token = c.stat.version + 1
            body = ClaimBody(self.worker_id, token, now, self.lease)
            bodies.append(body)
            claim_path = self.layout.claim(self.queue, c.entry.name)
            txn.create(claim_path, body.to_bytes(), ephemeral=True)
            txn.set_data(self.entry_path(c.priority, c.entry), c.data, version=c.stat.version)
        left = line.joined
        line.add_leave(txn)
        if rejoin:
            line.add_join(txn)
        outcome = txn.commit()
        if transaction_failed(outcome):
            log.debug("claim of %d entries lost a race: %s", len(picked), _first_error(outcome))
            return None
        line.committed(left, outcome[-1] if rejoin else None)
        return [
            Claim(
                self.queue,
                c.priority,
                c.entry,
                c.spec,
                c.stat.version + 1,
                c.stat.ctime / 1000,
                now,
                body,
            )
            for c, body in zip(picked, bodies, strict=True)
        ]

    def complete(self, claim: Claim, record: Result, line: Line | None) -> bool:
        """Write the result and remove the job, fenced by the token. False if we were fenced
        out (cancelled, reclaimed, or our session is gone): nothing was written."""
        return self.complete_many([(claim, record)], line)[0]

    def complete_many(self, done: list[tuple[Claim, Result]], line: Line | None) -> list[bool]:
        """Complete several jobs in one multi, each fenced by its own token (and rejoin the line
        after them when ``line`` is given). A fenced job fails the whole multi, so then each is
        tried alone: only the fenced one fails. Returns whether each was completed."""
        txn = self.zk.transaction()
        for claim, record in done:
            self._add_complete(txn, claim, record.to_bytes_or_failure())
        if line is not None:
            line.add_join(txn)
        outcome = txn.commit()
        if not transaction_failed(outcome):
            if line is not None:
                line.committed(False, outcome[-1])
            return [True] * len(done)
        if len(done) == 1:
            claim = done[0][0]
            log.warning(
                "job %s: result not written, fenced out (%s)", claim.id, _first_error(outcome)
            )
            return [False]
        return [self.complete(claim, record, None) for claim, record in done]

    def _add_complete(self, txn: TransactionRequest, claim: Claim, data: bytes) -> None:
        entry = self.entry_path(claim.priority, claim.entry)
        txn.check(entry, claim.token)
        txn.create(self.layout.result(self.queue, claim.id), data)
        txn.delete(entry, claim.token)
        txn.delete(self.layout.claim(self.queue, claim.entry.name))

    def renew(self, claims: list[Claim]) -> list[Claim]:
        """Renew the leases (a write bumps the claim's server-side mtime, which the janitor
        reads). Returns the claims that are gone: reclaimed, or lost with the session."""
        calls = [
            (c, self.zk.set_async(self.layout.claim(self.queue, c.entry.name), c.body.to_bytes()))
            for c in claims
        ]
        lost = []
        for claim, call in calls:
            try:
                call.get()
            except NoNodeError:
                lost.append(claim)
        return lost

    def set_partial(self, claim: Claim, text: str) -> None:
        """Put a streaming job's output so far into its claim's data (written by the next
        renew(), so every write also renews the lease)."""
        claim.body.partial = text

    def sweep(self, line: Line, held: set[str]) -> list[str]:
        """Delete this session's claims on entries not in ``held`` and its places in the line
        other than ``line.node``: a claim or join that committed while its reply was lost with
        the connection. Left alone, a place nobody holds heads the line and stalls the queue,
        and a claim nobody runs holds its job until the lease runs out. Returns what went."""
        claims = self.layout.claims(self.queue)
        stray = [child(claims, n) for n in own_untracked(self.zk, claims, held)]
        places = own_untracked(self.zk, line.directory, {line.node} if line.node else set())
        stray += [child(line.directory, n) for n in places]
        for path in stray:
            with contextlib.suppress(NoNodeError):
                self.zk.delete(path)
        return stray

    def release(self, claim: Claim) -> bool:
        """Give the job back (drain, out of memory): it is pending again for any worker."""
        txn = self.zk.transaction()
        txn.check(self.entry_path(claim.priority, claim.entry), claim.token)
        txn.delete(self.layout.claim(self.queue, claim.entry.name))
        return not transaction_failed(txn.commit())

    def drop(self, claim: Claim) -> None:
        """Remove our claim on an entry that is gone (cancelled or withdrawn), if still ours."""
        path = self.layout.claim(self.queue, claim.entry.name)
        try:
            stat = self.zk.exists(path)
            if stat is not None and stat.ephemeralOwner == self.zk.client_id[0]:
                self.zk.delete(path, version=stat.version)
        except NoNodeError:
            pass

    def dead_letter(
        self,
        priority: str,
        name: str,
        data: bytes,
        stat: ZnodeStat | None,
        reason: str,
        job_id: str | None,
    ) -> bool:
        """Move an entry to dead/ with the reason; record a ``dead`` result when it has an id."""
        now = time.time()
        letter = DeadLetter.of_entry(
            data,
            queue=self.queue,
            priority=priority,
            entry=name,
            reason=reason,
            id=job_id,
            worker=self.worker_id,
            dead_at=now,
        )
        record = None
        if job_id is not None:
            record = Result(
                id=job_id,
                queue=self.queue,
                priority=priority,
                status=results.DEAD,
                error=reason,
                worker=self.worker_id,
                attempts=stat.version if stat else 0,
                submitted_at=stat.ctime / 1000 if stat else None,
                finished_at=now,
            )
        path = self.layout.entry(self.queue, priority, name)
        # Nodes another client hung under the entry would make its delete fail (NotEmpty) on
        # every try, leaving the entry pending forever: they go in the same multi.
        below = self._descendants(path) if stat is None or stat.numChildren else []
        # A hand-made entry may reuse an id that already has a result: then letter it alone.
        for with_result in (True, False) if record else (False,):
            txn = self.zk.transaction()
            txn.create(self.layout.dead_node(self.queue, name), letter.to_bytes())
            if with_result and record is not None:
                txn.create(self.layout.result(self.queue, record.id), record.to_bytes())
            for node in below:
                txn.delete(node)
            txn.delete(path, stat.version if stat is not None else -1)
            outcome = txn.commit()
            if not transaction_failed(outcome):
                log.warning("dead-lettered %s/%s: %s", priority, name, reason)
                return True
        log.warning("dead-lettering %s failed: %s", name, _first_error(outcome))
        return False

    def _descendants(self, path: str, limit: int = _MAX_DESCENDANTS) -> list[str]:
        """Every node below ``path``, deepest first (at most ``limit``): delete order."""
        found: list[str] = []
        stack = [path]
        while stack and len(found) < limit:
            parent = stack.pop()
            try:
                kids = [child(parent, k) for k in self.zk.get_children(parent)]
            except NoNodeError:
                continue
            found.extend(kids)
            stack.extend(kids)
        return sorted(found[:limit], key=lambda p: p.count("/"), reverse=True)

    def end_unclaimed(
        self,
        priority: str,
        entry: EntryName,
        *,
        version: int,
        submitted_at: float,
        status: str,
        error: str,
        finished_at: float | None = None,
    ) -> bool:
        """End an unclaimed entry with a result (expired, rejected), fenced by its version."""
        record = Result(
            id=entry.job_id,
            queue=self.queue,
            priority=priority,
            status=status,
            error=error,
            worker=self.worker_id,
            attempts=version,
            submitted_at=submitted_at,
            finished_at=time.time() if finished_at is None else finished_at,
        )
        txn = self.zk.transaction()
        txn.create(self.layout.result(self.queue, entry.job_id), record.to_bytes())
        txn.delete(self.entry_path(priority, entry), version)
        return not transaction_failed(txn.commit())


# -- transitions made by clients other than the claiming worker ------------------------------


def enqueue_async(zk: KazooClient, entries: list[tuple[str, bytes]], ephemeral: bool) -> Any:
    """Create several entries (sequential-create prefix, spec bytes) in one multi, without
    waiting: the returned async result gives one created path, or an exception, per entry."""
    txn = zk.transaction()
    for prefix, data in entries:
        txn.create(prefix, data, ephemeral=ephemeral, sequence=True)
    return txn.commit_async()


def cancel(zk: KazooClient, layout: Layout, queue: str, priority: str, name: str) -> bool:
    """Cancel a pending or running entry: record a ``cancelled`` result and delete the entry in
    one multi (a running worker sees the delete and stops). False if it had already ended."""
    path = layout.entry(queue, priority, name)
    claim_call = zk.get_async(layout.claim(queue, name))
    try:
        _, stat = zk.get(path)
    except NoNodeError:
        return False
    running = ClaimBody.from_call(claim_call)
    call = cancel_async(zk, layout, queue, priority, name, stat, running)
    return not transaction_failed(call.get())


def cancel_async(
    zk: KazooClient,
    layout: Layout,
    queue: str,
    priority: str,
    name: str,
    stat: ZnodeStat,
    running: ClaimBody | None,
) -> Any:
    """The cancel multi for an entry read with ``stat`` (and its claim, ``running``, when it
    runs: the result names the worker and when it started), without waiting for its answer."""
    job_id = EntryName.parse(name).job_id
    now = time.time()
    record = Result(
        id=job_id,
        queue=queue,
        priority=priority,
        status=results.CANCELLED,
        error=f"cancelled by request {_where(running, now)}",
        worker=running.worker if running else None,
        started_at=running.claimed_at if running else None,
        attempts=stat.version,
        submitted_at=stat.ctime / 1000,
        finished_at=now,
    )
    txn = zk.transaction()
    txn.create(layout.result(queue, job_id), record.to_bytes())
    txn.delete(layout.entry(queue, priority, name))  # whatever claims happened since the read
    return txn.commit_async()


def _where(running: ClaimBody | None, now: float) -> str:
    if running is None:
        return "before it started"
    return f"while running on {running.worker} (started {now - running.claimed_at:.1f}s before)"


def reclaim(
    zk: KazooClient, layout: Layout, queue: str, priority: str, name: str, token: int, version: int
) -> bool:
    """Take back a claim whose lease lapsed (the janitor): delete it if the entry still carries
    its token and the claim was not renewed since it was read. The job is pending again."""
    txn = zk.transaction()
    txn.check(layout.entry(queue, priority, name), token)
    txn.delete(layout.claim(queue, name), version)
    return not transaction_failed(txn.commit())


def requeue(
    zk: KazooClient,
    layout: Layout,
    queue: str,
    priority: str,
    job_id: str,
    letter: str,
    spec: bytes,
) -> str | None:
    """Enqueue a dead-lettered job again under the same id (detached, attempts from 0), and
    remove its letter and its ``dead`` result in the same multi. Returns the new entry name,
    None if the letter changed meanwhile."""
    txn = zk.transaction()
    txn.create(layout.entry_prefix(queue, priority, job_id), spec, sequence=True)
    txn.delete(layout.dead_node(queue, letter))
    if zk.exists(layout.result(queue, job_id)) is not None:
        txn.delete(layout.result(queue, job_id))
    outcome = txn.commit()
    if transaction_failed(outcome):
        return None
    return str(outcome[0]).rsplit("/", 1)[1]


def own_untracked(zk: KazooClient, directory: str, known: set[str]) -> list[str]:
    """Names of the ephemeral nodes in ``directory`` owned by this session but not in
    ``known``: what a create or multi left behind when its reply was lost."""
    try:
        names = zk.get_children(directory)
    except NoNodeError:
        return []
    session = zk.client_id[0]
    calls = [(n, zk.exists_async(child(directory, n))) for n in names if n not in known]
    return [n for n, call in calls if (s := call.get()) is not None and s.ephemeralOwner == session]


def transaction_failed(outcome: list[Any]) -> bool:
    """A committed multi's results: did any operation fail (then none took effect)?"""
    return any(isinstance(r, Exception) for r in outcome)


def _first_error(outcome: list[Any]) -> str:
    for r in outcome:
        if isinstance(r, Exception) and type(r).__name__ != "RolledBackError":
            return type(r).__name__
    return "unknown"
