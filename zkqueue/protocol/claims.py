"""The claim/complete protocol: every state change of a job is one ZooKeeper multi.

- enqueue:  check(pending/<priority>, version read) + set_data(<bucket>) + create
            <bucket>/<id>- (sequential): a producer whose tail bucket is stale fails and reads
            it again. The set_data is the arrival signal a waiting head watches.
- open:     check(pending/<priority>) + create the next bucket + set the priority's tail to it.
- lane:     create pending/<priority>/@<tenant> + its first bucket + set_data(pending/<priority>,
            same data, version read): a tenant's first job in a priority.
- claim:    create claims/<id> (ephemeral) + set_data(entry, same bytes, version=read version)
            [+ leave the line, + rejoin it at the back]. The entry's new version is the fencing
            token and the attempt count; one claim per id, so an id never runs twice at once.
- complete: check(entry, token) + create results/<hh>/<id> + create its expiry index node +
            delete(entry) + delete(claims/<id>) [+ rejoin the line]. A stale worker's multi
            fails as a whole.
- release:  check(entry, token) + delete(claims/<id>) + set_data(claims/): the job is pending
            again.
- preempt:  the claim multi of a more urgent job, which also gives jobs of this worker back:
            set_data(their entry, spec with preemptions + 1, version=token) + delete(their
            claim) + set_data(claims/). All or nothing: a preempted job is pending again
            exactly when the urgent one is claimed, and its old token can no longer complete it.
- reclaim:  (the janitor, a lapsed lease) check(entry, token) + delete(claims/<id>, version)
            + set_data(claims/).
- dead:     create dead/<letter> [+ result + index] + delete(entry, version).

The set_data(claims/) in each give-back is the **give-back signal**: claims/'s data version
counts the jobs given back (and the claims that passed over an entry of a tenant's lane and
wrote the lane's claim frontier past it, the entry left pending behind it). A head that lists
claims/ in a turn learns from its stat whether any job went back since it listed a bucket, so
it may reuse that listing (``zkqueue.dispatch.view``). A claim lost with its session gives its
job back without the signal: heads re-list what they reuse at least every ``TRUST_FOR``
seconds.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any, Protocol

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError
from kazoo.protocol.states import ZnodeStat

from zkqueue import defaults
from zkqueue.errors import CorruptRecord, ZkqConnectionError
from zkqueue.protocol import result as results
from zkqueue.protocol.layout import EntryName, Layout, child, entry_job_id, in_lane
from zkqueue.protocol.nodes import Ticks, descendants, own_untracked
from zkqueue.protocol.records import Candidate, Claim, ClaimBody, DeadLetter
from zkqueue.protocol.result import Result

log = logging.getLogger("zkq.claims")
#: Nodes below an entry that dead-lettering removes at most (one multi must stay small).
_MAX_DESCENDANTS = 256


class Line(Protocol):
    """What a transition needs of a worker's place in a line (``zkqueue.dispatch.line.Line`` is one,
    in dispatch, above this module): the multis that claim and complete leave and rejoin it."""

    directory: str
    node: str | None

    @property
    def joined(self) -> bool: ...

    def add_leave(self, txn: TransactionRequest) -> None: ...

    def add_join(self, txn: TransactionRequest) -> None: ...

    def committed(self, left: bool, joined_path: Any) -> None: ...


class Claims:
    """Runs the protocol's transactions for one worker on one queue, and the plain writes on
    its own claims (renewing leases, streaming output, sweeping what a lost reply left)."""

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
        #: The base URL of this worker's stream server (None: streaming jobs publish their
        #: output in their claims only): each claim of a streaming job names its stream there,
        #: ``<streams>/<job id>``, with a fresh secret.
        self.streams: str | None = None
        self.ticks = Ticks()
        #: Whether the last ``claim`` failed on one of its ``checks`` (a more urgent priority
        #: changed since the head looked).
        self.guarded = False

    def entry_path(self, priority: str, entry: EntryName) -> str:
        return self.layout.entry(self.queue, priority, entry.name)

    def claim(
        self,
        picked: list[Candidate],
        line: Line,
        rejoin: bool,
        give_back: Sequence[tuple[Claim, bytes]] = (),
        extra: Sequence[tuple[str, bytes]] = (),
        checks: Sequence[tuple[str, int]] = (),
        passed: bool = False,
    ) -> list[Claim] | None:
        """Claim ``picked`` in one multi that also leaves the line (and rejoins it at the back
        when slots stay free). ``give_back`` preempts claims of this worker in the same multi:
        each entry's data becomes the given spec (its preemption counted) and is pending
        again. None if any entry changed under us: nothing was claimed, nothing given back
        (a preempted job was cancelled or fenced meanwhile, or an urgent one claimed by
        another head). ``extra``: plain writes (path, data) that go with the claim (the
        tenants' service counters that the choice changed); ``checks``: (path, version) that
        must still hold (the tails of more urgent priorities, unchanged since the head looked);
        ``passed``: the claim passes over an entry of a lane it claims a later one from (the
        entry did not fit this worker): the multi sets the give-back signal, as a give-back
        does, since the lane's claim frontier moves past an entry still pending."""
        now = time.time()
        txn = self.zk.transaction()
        for path, version in checks:
            txn.check(path, version)
        for path, data in extra:
            txn.set_data(path, data)
        for claim, spec in give_back:
            txn.set_data(self.entry_path(claim.priority, claim.entry), spec, version=claim.token)
            txn.delete(self.layout.claim(self.queue, claim.id))
        if give_back or passed:
            signal(txn, self.layout, self.queue)
        bodies = []
        for c in picked:
            token = c.stat.version + 1
            body = ClaimBody(self.worker_id, token, now, self.lease, f"{c.priority}/{c.entry.name}")
            if self.streams is not None and c.spec.stream:
                body.stream = f"{self.streams}/{c.entry.job_id}"
                body.secret = secrets.token_urlsafe(24)
            bodies.append(body)
            txn.create(
                self.layout.claim(self.queue, c.entry.job_id), body.to_bytes(), ephemeral=True
            )
            txn.set_data(self.entry_path(c.priority, c.entry), c.data, version=c.stat.version)
        left = line.joined
        line.add_leave(txn)
        if rejoin:
            line.add_join(txn)
        outcome = txn.commit()
        self.guarded = any(isinstance(r, BadVersionError) for r in outcome[: len(checks)])
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
        """Write the result and remove the job, fenced by the token (False: fenced out)."""
        return self.complete_many([(claim, record)], line)[0]

    def complete_many(self, done: list[tuple[Claim, Result]], line: Line | None) -> list[bool]:
        """Complete several jobs in one multi, each fenced by its own token (and rejoin the line
        after them when ``line`` is given). A fenced job fails the whole multi, so then each is
        tried alone: only the fenced one fails. Returns whether each was completed."""
        txn = self.zk.transaction()
        for claim, record in done:
            entry = self.entry_path(claim.priority, claim.entry)
            txn.check(entry, claim.token)
            self._add_result(txn, record)
            txn.delete(entry, claim.token)
            txn.delete(self.layout.claim(self.queue, claim.id))
        if line is not None:
            line.add_join(txn)
        outcome = txn.commit()
        if not transaction_failed(outcome):
            if line is not None:
                line.committed(False, outcome[-1])
            return [True] * len(done)
        self.ticks.forget()
        if len(done) == 1:
            log.warning("job %s: result not written (%s)", done[0][0].id, _first_error(outcome))
            return [False]
        return [self.complete(claim, record, None) for claim, record in done]

    def _add_result(self, txn: TransactionRequest, record: Result) -> None:
        """Create the result and its node in the expiry index (whose tick bucket exists)."""
        if record.finished_at is None:
            record.finished_at = time.time()
        self.ticks.ensure(self.zk, self.layout, self.queue, record.finished_at)
        add_result(txn, self.layout, self.queue, record)

    def release(self, claim: Claim) -> bool:
        """Give the job back (drain, out of memory): it is pending again for any worker."""
        txn = self.zk.transaction()
        txn.check(self.entry_path(claim.priority, claim.entry), claim.token)
        txn.delete(self.layout.claim(self.queue, claim.id))
        signal(txn, self.layout, self.queue)
        return not transaction_failed(txn.commit())

    def dead_letter(
        self,
        priority: str,
        name: str,
        data: bytes,
        stat: ZnodeStat | None,
        reason: str,
        job_id: str | None,
        *,
        with_result: bool = True,
    ) -> bool:
        """Move an entry to dead/ with the reason, and a ``dead`` result (``with_result``)."""
        now = time.time()
        fields = dict(queue=self.queue, priority=priority, entry=name, reason=reason, id=job_id)
        letter = DeadLetter.of_entry(data, **fields, worker=self.worker_id, dead_at=now)
        record = None
        if job_id is not None and with_result:
            record = self._ended(job_id, priority, results.DEAD, reason, stat, now)
            self.ticks.ensure(self.zk, self.layout, self.queue, now)
        path = self.layout.entry(self.queue, priority, name)
        # Nodes another client hung under the entry would make its delete fail (NotEmpty) on
        # every try, leaving the entry pending forever: they go in the same multi.
        below = descendants(self.zk, path, _MAX_DESCENDANTS) if not stat or stat.numChildren else []
        # A hand-made entry may reuse an id that already has a result: then letter it alone.
        for add in (True, False) if record else (False,):
            txn = self.zk.transaction()
            txn.create(
                self.layout.dead_node(self.queue, Layout.dead_name(priority, name)),
                letter.to_bytes(),
            )
            if add and record is not None:
                add_result(txn, self.layout, self.queue, record)
            for node in below:
                txn.delete(node)
            txn.delete(path, stat.version if stat is not None else -1)
            outcome = txn.commit()
            if not transaction_failed(outcome):
                log.warning("dead-lettered %s/%s: %s", priority, name, reason)
                return True
        log.warning("dead-lettering %s failed: %s", name, _first_error(outcome))
        return False

    def _ended(
        self, job_id: str, priority: str, status: str, error: str, stat: Any, now: float
    ) -> Result:
        return Result(
            id=job_id,
            queue=self.queue,
            priority=priority,
            status=status,
            error=error,
            worker=self.worker_id,
            attempts=stat.version if stat else 0,
            submitted_at=stat.ctime / 1000 if stat else None,
            finished_at=now,
        )

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
        record = self._ended(entry.job_id, priority, status, error, None, time.time())
        record.attempts, record.submitted_at = version, submitted_at
        if finished_at is not None:
            record.finished_at = finished_at
        txn = self.zk.transaction()
        self._add_result(txn, record)
        txn.delete(self.entry_path(priority, entry), version)
        return not transaction_failed(txn.commit())

    # -- transitions made by clients other than the claiming worker ------------------------------

    # -- plain writes on this worker's own claims (no multi) -----------------------------------

    def renew(self, claims: list[Claim]) -> list[Claim]:
        """Renew the leases (a write bumps the claim's server-side mtime, which the janitor
        reads). Returns the claims that are gone: reclaimed, or lost with the session."""
        calls = [
            (c, self.zk.set_async(self.layout.claim(self.queue, c.id), c.body.to_bytes()))
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

    def sweep(self, lines: Sequence[Line], held: set[str]) -> list[str]:
        """Delete this session's claims on job ids not in ``held`` and its places in the
        ``lines`` other than each one's ``node``: a claim or join that committed while its
        reply was lost with the connection. Left alone, a place nobody holds heads its line
        and stalls it, and a claim nobody runs holds its job until the lease runs out. Returns
        what went."""
        claims = self.layout.claims(self.queue)
        stray = [child(claims, n) for n in own_untracked(self.zk, claims, held)]
        for line in lines:
            places = own_untracked(self.zk, line.directory, {line.node} if line.node else set())
            stray += [child(line.directory, n) for n in places]
        for path in stray:
            txn = self.zk.transaction()
            txn.delete(path)
            if path.startswith(f"{claims}/"):
                signal(txn, self.layout, self.queue)  # a claim nobody runs: its job goes back
            txn.commit()  # NoNode: gone meanwhile
        return stray

    def drop(self, claim: Claim) -> None:
        """Remove our claim on an entry that is gone (cancelled or withdrawn), if still ours."""
        path = self.layout.claim(self.queue, claim.id)
        try:
            stat = self.zk.exists(path)
            if stat is not None and stat.ephemeralOwner == self.zk.client_id[0]:
                self.zk.delete(path, version=stat.version)
        except NoNodeError:
            pass

    def failed_completion(
        self, claim: Claim, finished_at: float
    ) -> tuple[str, tuple[bytes, ZnodeStat] | None]:
        """Why a completion of ``claim`` failed, in one round trip:
        - ``ours``: it committed, the reply was lost, and the retry found the result it wrote
          (this worker's, with this claim's token and ``finished_at``);
        - ``gone``: the entry was cancelled or withdrawn while the claim stayed ours;
        - ``duplicate``: the claim and the entry (at its token) are ours, but the id already
          has another result: a producer reused it. The entry's data and stat come with it;
        - ``lost``: the claim went (reclaimed, or lost with the session)."""
        entry = self.zk.get_async(self.layout.entry(self.queue, claim.priority, claim.entry.name))
        mine = self.zk.exists_async(self.layout.claim(self.queue, claim.id))
        result = self.zk.get_async(self.layout.result(self.queue, claim.id))
        try:
            record = Result.from_bytes(result.get()[0], f"result of job {claim.id}")
        except (NoNodeError, CorruptRecord):
            record = None
        mark = (self.worker_id, claim.token, finished_at)
        if record is not None and (record.worker, record.attempts, record.finished_at) == mark:
            return "ours", None
        stat = mine.get()
        held = stat is not None and stat.ephemeralOwner == self.zk.client_id[0]
        try:
            data, entry_stat = entry.get()
        except NoNodeError:
            return ("gone" if held else "lost"), None
        if held and record is not None and entry_stat.version == claim.token:
            return "duplicate", (data, entry_stat)
        return "lost", None


def add_result(txn: TransactionRequest, layout: Layout, queue: str, record: Result) -> bytes:
    """Create ``record``'s result node and its expiry index node (the tick bucket must exist)."""
    data = record.to_bytes_or_failure()
    assert record.finished_at is not None
    txn.create(layout.result(queue, record.id), data)
    txn.create(layout.expiry_entry(queue, record.finished_at, record.id, len(data)))
    return data


def enqueue_async(
    zk: KazooClient,
    checks: list[tuple[str, int]],
    tails: list[tuple[str, bytes]],
    entries: list[tuple[str, bytes]],
    eph: bool,
) -> Any:
    """Create several entries (sequential-create prefix in a tail bucket, spec bytes) in one
    multi, fenced by the versions of the priority nodes naming those tails, and set each tail
    bucket's data to its arrival signal (zkqueue.protocol.arrival: a waiting head watches it),
    without waiting: the async result gives one outcome per check and per tail, then one created
    path per entry."""
    txn = zk.transaction()
    for path, version in checks:
        txn.check(path, version)
    for bucket, signal in tails:
        txn.set_data(bucket, signal)
    for prefix, data in entries:
        txn.create(prefix, data, ephemeral=eph, sequence=True)
    return txn.commit_async()


def open_bucket(
    zk: KazooClient, layout: Layout, queue: str, priority: str, tail: int, version: int
) -> bool:
    """Open the bucket after ``tail`` and make it the tail; False if someone else moved it."""
    txn = zk.transaction()
    txn.check(layout.pending(queue, priority), version)
    txn.create(layout.bucket(queue, priority, tail + 1))
    txn.set_data(layout.pending(queue, priority), str(tail + 1).encode(), version=version)
    return not transaction_failed(txn.commit())


def make_lane(zk: KazooClient, layout: Layout, queue: str, lane: str) -> None:
    """Create a tenant's lane in a priority and its first bucket where missing, in one multi
    that also sets the priority's node to the data it holds (the head hears of the new lane
    through its watch on the priority's children, and a head about to claim less urgent jobs
    checks that node's version: ``zkqueue.dispatch.view``)."""
    priority = lane.partition("/")[0]
    for _ in range(16):
        data, stat = zk.get(layout.pending(queue, priority))
        txn = zk.transaction()
        txn.create(layout.pending(queue, lane))
        txn.create(layout.bucket(queue, lane, 0))
        txn.set_data(layout.pending(queue, priority), data, version=stat.version)
        outcome = txn.commit()
        if not transaction_failed(outcome):
            return
        if any(isinstance(r, NodeExistsError) for r in outcome):
            with contextlib.suppress(NodeExistsError):  # made by another producer (or by hand)
                zk.create(layout.bucket(queue, lane, 0))
            return
    raise ZkqConnectionError(f"the priority {priority!r} of queue {queue!r} kept changing")


def remove_lane(
    zk: KazooClient, layout: Layout, queue: str, lane: str, bucket: int, versions: tuple[int, int]
) -> bool:
    """Remove a tenant's empty lane: its only bucket and its node, at ``versions`` (the
    bucket's, the lane's) as read, in one multi; an enqueue since (it sets the bucket's data,
    or adds an entry) or a bucket opened since fails it (False)."""
    txn = zk.transaction()
    txn.delete(layout.bucket(queue, lane, bucket), version=versions[0])
    txn.delete(layout.pending(queue, lane), version=versions[1])
    return not transaction_failed(txn.commit())


def cancel(zk: KazooClient, layout: Layout, queue: str, priority: str, name: str) -> bool:
    """Cancel an entry: a ``cancelled`` result and its delete in one multi (False: it ended)."""
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
    now = time.time()
    record = Result(
        id=entry_job_id(name) or name,
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
    Ticks().ensure(zk, layout, queue, now)
    txn = zk.transaction()
    add_result(txn, layout, queue, record)
    txn.delete(layout.entry(queue, priority, name))  # whatever claims happened since the read
    return txn.commit_async()


def _where(running: ClaimBody | None, now: float) -> str:
    if running is None:
        return "before it started"
    return f"while running on {running.worker} (started {now - running.claimed_at:.1f}s before)"


def consume(zk: KazooClient, layout: Layout, queue: str, record: Result, size: int) -> None:
    """Remove a read result and its index node, unawaited (a failure: the janitor's retention)."""
    if record.finished_at is None:
        zk.delete_async(layout.result(queue, record.id))
        return
    txn = zk.transaction()
    txn.delete(layout.result(queue, record.id))
    txn.delete(layout.expiry_entry(queue, record.finished_at, record.id, size))
    txn.commit_async()


def signal(txn: TransactionRequest, layout: Layout, queue: str) -> None:
    """Add the give-back signal to a multi that makes a claimed job pending again: a write of
    claims/'s data (left empty), which moves its data version (see the module's docstring)."""
    txn.set_data(layout.claims(queue), b"")


def step_aside(zk: KazooClient, line: Line) -> bool:
    """Leave ``line`` and join it again at its back, in one multi (a head that leaves a job
    for a bigger worker behind it: ``zkqueue.dispatch.line.Line.step_aside``). False if this
    member's node was gone (nothing done)."""
    txn = zk.transaction()
    line.add_leave(txn)
    line.add_join(txn)
    outcome = txn.commit()
    if transaction_failed(outcome):
        return False
    line.committed(True, outcome[-1])
    return True


def reclaim(
    zk: KazooClient,
    layout: Layout,
    queue: str,
    claim: str,
    version: int,
    entry: tuple[str, int] | None = None,
) -> bool:
    """Take back a claim whose lease lapsed (the janitor): delete it if it was not renewed
    since it was read (its ``version``) and, when ``entry`` (path, token) is given, the entry
    still carries the claim's token; a claim nobody can read, or that names no entry, is fenced
    by its own version alone. The job is pending again (the multi sets the give-back signal)."""
    txn = zk.transaction()
    if entry is not None:
        txn.check(*entry)
    txn.delete(claim, version)
    signal(txn, layout, queue)
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
    """Enqueue a dead-lettered job again under the same id (detached, attempts from 0) in the
    tail bucket, and remove its letter and its ``dead`` result in the same multi. Returns the
    new entry name, None if the letter or the tail changed meanwhile."""
    from zkqueue.protocol.nodes import read_tail

    tail, version = read_tail(zk, layout, queue, priority)
    txn = zk.transaction()
    txn.check(layout.pending(queue, priority), version)
    txn.set_data(layout.bucket(queue, priority, tail), b"")  # the arrival signal
    txn.create(layout.entry_prefix(queue, priority, job_id, tail), spec, sequence=True)
    txn.delete(layout.dead_node(queue, letter))
    if zk.exists(layout.result(queue, job_id)) is not None:
        txn.delete(layout.result(queue, job_id))
    outcome = txn.commit()
    if transaction_failed(outcome):
        return None
    _, bucket, leaf = str(outcome[2]).rsplit("/", 2)
    return in_lane(priority, f"{bucket}/{leaf}")


def move(
    zk: KazooClient,
    old: str,
    new: str,
    data: bytes,
    *,
    sequence: bool = False,
    index: str | None = None,
) -> str | None:
    """Move a node (``zkq migrate``): create it anew [+ an index node], delete the old one."""
    txn = zk.transaction()
    txn.create(new, data, sequence=sequence)
    if index is not None:
        txn.create(index)
    txn.delete(old)
    outcome = txn.commit()
    return None if transaction_failed(outcome) else str(outcome[0])


def delete_all(zk: KazooClient, paths: list[str]) -> list[Any]:
    """Delete ``paths`` in one multi, all or none (queue delete: a priority's buckets, then it)."""
    txn = zk.transaction()
    for path in paths:
        txn.delete(path)
    return txn.commit()


def transaction_failed(outcome: list[Any]) -> bool:
    """A committed multi's results: did any operation fail (then none took effect)?"""
    return any(isinstance(r, Exception) for r in outcome)


def _first_error(outcome: list[Any]) -> str:
    for r in outcome:
        if isinstance(r, Exception) and type(r).__name__ != "RolledBackError":
            return type(r).__name__
    return "unknown"
