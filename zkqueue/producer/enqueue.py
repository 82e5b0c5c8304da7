"""Creating pending entries exactly once, in order, even when the reply is lost with the
connection.

An entry goes into its priority's tail bucket, in a multi fenced by the version of the priority
node that names the tail: a producer whose tail is stale (someone opened the next bucket) fails
as a whole, reads the tail again and retries, so entries order exactly by (bucket, sequence). The
producer whose entry fills a bucket opens the next one. A bulk enqueue sends several multis at
once, all to the tails read before them; it stops a window at the chunk that fills a tail, so a
bucket holds at most a chunk more than its size (a head lists its whole first bucket each turn).
The asyncio client sends a single create from its event loop only where the tail it knows has
room for every entry on its way there (a multi counts from when it is sent, from any thread,
until its reply arrives), and on a thread otherwise, so a burst overfills a bucket by no more
than its threads.

After a ConnectionLoss a create may or may not have committed. The entry's name starts with the
job id, so the producer waits (bounded) for the connection to come back and looks the id up
before creating again: a retry never enqueues a job twice. What it finds counts as its reply
would have: a bucket it filled is opened.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Any, Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NoNodeError,
    RolledBackError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError

from zkqueue import defaults
from zkqueue.errors import ConfigurationError, QueueFull, ZkqConnectionError
from zkqueue.plumbing.connection import (
    RECONNECT_POLL,
    TRANSIENT,
    ConnectionSettings,
    await_connected,
    lost_error,
    read_through_loss,
)
from zkqueue.protocol import arrival, claims, counts, revision
from zkqueue.protocol.layout import TENANT_MARK, EntryName, Layout
from zkqueue.protocol.nodes import read_tail

#: Creates per multi in create_many, and multis in flight at once.
_MULTI_CREATES = 100
_MULTIS_IN_FLIGHT = 8
#: Tries when the tail keeps moving under us (every try reads it again).
_STALE_TRIES = 50

#: (job id, queue, lane, spec bytes) of one entry to create: the lane is the priority, or its
#: tenant's directory below it (``zkqueue.protocol.layout.lane``).
Prepared = tuple[str, str, str, bytes]
#: A multi sent: (how many of its results are checks and signals, its kazoo call).
Sent = tuple[int, Any]


class Producer(Protocol):
    """What the enqueuer needs of its client (``zkqueue.producer.client.Client`` is one)."""

    @property
    def zk(self) -> KazooClient: ...

    layout: Layout
    settings: ConnectionSettings

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None: ...


class _Stale(Exception):
    """A multi failed its tail check (or its bucket is gone): read the tails again."""


class Enqueuer:
    """Creates entries for one client."""

    def __init__(
        self,
        client: Producer,
        bucket_size: int = defaults.PENDING_BUCKET,
        signal_limit: int = defaults.SIGNAL_SPEC_BYTES,
    ) -> None:
        self.client = client
        self.bucket_size = bucket_size
        if signal_limit < 0:
            raise ConfigurationError(f"signal_spec_bytes must be 0 or more, not {signal_limit}")
        #: Specs up to this size ride in the arrival signal (zkqueue.protocol.arrival); 0: none do.
        self.signal_limit = signal_limit
        #: Tenants' lanes a priority may hold before a new tenant's first job is refused.
        self.max_lanes = defaults.MAX_LANES
        #: (queue, priority) -> (tail bucket, version of the priority node) as last read.
        self._tails: dict[tuple[str, str], tuple[int, int]] = {}
        #: (queue, priority) -> (a bucket, the sequence after the last entry this client made
        #: there or 0 for a bucket it opened): how full the tail is, as far as it knows.
        self._filled: dict[tuple[str, str], tuple[int, int]] = {}
        #: (queue, priority) -> entries sent in multis (from any thread) whose replies have not
        #: arrived; a reply moves its entries from here into ``_filled`` at once.
        self._flying: Counter[tuple[str, str]] = Counter()
        #: Guards ``_filled`` and ``_flying``: multis are sent from the asyncio client's loop and
        #: its threads, and replies arrive on kazoo's completion thread.
        self._lock = threading.RLock()

    def _zk(self) -> KazooClient:
        return self.client.zk

    @property
    def layout(self) -> Layout:
        return self.client.layout

    @property
    def settings(self) -> ConnectionSettings:
        return self.client.settings

    def find(self, queue: str, priority: str, job_id: str) -> str | None:
        return self.client.find_entry(queue, priority, job_id)

    def tail(self, queue: str, priority: str) -> tuple[int, int]:
        """The tail bucket and the priority node's version as last read (safe from several
        threads: the asyncio client enqueues on pool threads)."""
        found = self._tails.get((queue, priority))
        if found is None:
            try:
                found = read_tail(self._zk(), self.layout, queue, priority)
            except NoNodeError:  # the queue was deleted since this client made it: again
                # (every directory: a delete under way may have left the others), or a
                # tenant's first job in this priority: its lane is made
                revision.ensure_dirs(self._zk(), self.layout, queue, all_of="/" not in priority)
                if "/" in priority:
                    self._check_lanes(queue, priority.partition("/")[0])
                    claims.make_lane(self._zk(), self.layout, queue, priority)
                found = read_tail(self._zk(), self.layout, queue, priority)
            self._tails[(queue, priority)] = found
        return found

    def _check_lanes(self, queue: str, priority: str) -> None:
        """Refuse a new tenant's lane where ``priority`` already holds ``max_lanes`` (a soft
        bound: two producers may pass it at once)."""
        lanes = len(counts.lanes(self._zk(), self.layout, queue, priority)) - 1
        if lanes >= self.max_lanes:
            raise QueueFull(
                f"queue {queue!r} holds {lanes} tenants' lanes in priority {priority!r}, its "
                f"most: a new tenant's jobs are refused until the janitor removes lanes left "
                f"empty for {defaults.LANE_IDLE:g} s"
            )

    def _send(
        self,
        chunk: list[Prepared],
        ephemeral: bool,
        tails: dict[tuple[str, str], tuple[int, int]] | None = None,
    ) -> Sent:
        if tails is None:
            # Not sent while ZooKeeper is away (zkq's client would fail it at once): wait for
            # it, within connect_timeout.
            zk, settings = self._zk(), self.settings
            await_connected(zk, settings, time.monotonic() + settings.connect_timeout, "enqueuing")
            tails = {(q, p): self.tail(q, p) for _, q, p, _ in chunk}  # one read of each tail
        order = sorted(tails)
        checks = [(self.layout.pending(q, p), tails[q, p][1]) for q, p in order]
        buckets = [
            (self.layout.bucket(q, p, tails[q, p][0]), self._signal(chunk, q, p)) for q, p in order
        ]
        entries = [
            (self.layout.entry_prefix(q, p, jid, tails[q, p][0]), data) for jid, q, p, data in chunk
        ]
        lanes = Counter((q, p) for _, q, p, _ in chunk)
        with self._lock:
            call = claims.enqueue_async(self._zk(), checks, buckets, entries, ephemeral)
            self._flying.update(lanes)
        call.rawlink(self._arrived(chunk, len(checks) + len(buckets), lanes))
        return len(checks) + len(buckets), call

    def _arrived(self, chunk: list[Prepared], skip: int, lanes: Counter[tuple[str, str]]) -> Any:
        """The callback for a multi's reply: count the entries it made as made, and none of the
        chunk as flying any more, in one step (kazoo may run a callback twice: once only). A
        lost reply (the connection went) may hide entries made: how full its lanes' tails are
        is forgotten, until a reply tells again."""
        settled = False

        def arrived(call: Any) -> None:
            nonlocal settled
            with self._lock:
                if settled:
                    return
                settled = True
                self._flying.subtract(lanes)
                for lane in lanes:
                    if self._flying[lane] <= 0:
                        del self._flying[lane]
                if not call.successful():
                    for lane in lanes:
                        self._filled.pop(lane, None)
                    return
                outcome = call.value
                if not any(isinstance(r, Exception) for r in outcome):
                    for (_, queue, priority, _), path in zip(chunk, outcome[skip:], strict=True):
                        entry = EntryName.parse(_relative(str(path)))
                        self._count(queue, priority, entry.bucket, entry.seq + 1)

        return arrived

    def _count(self, queue: str, priority: str, bucket: int, filled: int) -> None:
        """Note that ``bucket`` holds at least ``filled`` entries. What is noted only grows:
        a later bucket replaces an earlier one, whatever that held."""
        after = (bucket, filled)
        with self._lock:
            self._filled[(queue, priority)] = max(after, self._filled.get((queue, priority), after))

    def _signal(self, chunk: list[Prepared], queue: str, priority: str) -> bytes:
        """The arrival signal for one tail bucket: its one new entry, or empty for several."""
        mine = [(jid, data) for jid, q, p, data in chunk if (q, p) == (queue, priority)]
        return arrival.encode(*mine[0], self.signal_limit) if len(mine) == 1 else b""

    def create_many(self, prepared: list[Prepared], ephemeral: bool) -> list[str | None]:
        """Create every entry, ``_MULTI_CREATES`` to a multi, several multis in flight; returns
        the names in order (None for a job that finished before a lost reply was recovered).
        A multi whose reply is lost may have committed: its ids are looked up before anything
        is created again."""
        names: list[str | None] = []
        chunks = [prepared[i : i + _MULTI_CREATES] for i in range(0, len(prepared), _MULTI_CREATES)]
        start = sent = 0
        try:
            while start < len(chunks):
                window = self._window(chunks[start : start + _MULTIS_IN_FLIGHT])
                start += len(window)
                calls = []
                for chunk in window:  # counted as each goes: the first may commit
                    calls.append(self._send(chunk, ephemeral))
                    sent += len(chunk)
                for chunk, call in zip(window, calls, strict=True):
                    try:
                        names.extend(self._created(chunk, call, ephemeral))
                    except _Stale:
                        names.extend(self._retry(chunk, ephemeral))
        except (ZkqConnectionError, *TRANSIENT) as exc:
            if not isinstance(exc, ZkqConnectionError):
                exc = lost_error(self.settings, "enqueuing", exc)
            raise _cut_short(str(exc), prepared, len(names), sent) from None
        return names

    def _window(self, chunks: list[list[Prepared]]) -> list[list[Prepared]]:
        """The first of ``chunks`` to send at once: every one goes to the tails read before the
        window, and the next bucket is opened only when the replies show a tail full, so the
        window ends with the chunk that fills a tail (the first, where this client does not
        know how full a tail is: its reply tells)."""
        window: list[list[Prepared]] = []
        sent: Counter[tuple[str, str]] = Counter()
        for chunk in chunks:
            window.append(chunk)
            sent.update((q, p) for _, q, p, _ in chunk)
            if any(n >= self._room(q, p) for (q, p), n in sent.items()):
                break
        return window

    def _room(self, queue: str, priority: str) -> int:
        """Entries the tail bucket still takes, as far as this client knows (0: it does not)."""
        bucket, filled = self._filled.get((queue, priority), (-1, 0))
        return self.bucket_size - filled if bucket == self.tail(queue, priority)[0] else 0

    def _retry(self, chunk: list[Prepared], ephemeral: bool) -> list[str | None]:
        for _ in range(_STALE_TRIES):
            try:
                return self._created(chunk, self._send(chunk, ephemeral), ephemeral)
            except _Stale:
                continue
        raise ZkqConnectionError("the tail bucket kept moving while enqueuing; try again")

    def _created(self, chunk: list[Prepared], call: Sent, ephemeral: bool) -> list[str | None]:
        checks, pending = call
        try:
            outcome = self._reply(pending)
        except (ConnectionLoss, SessionExpiredError):
            return self._recover(chunk, ephemeral)
        errors = [r for r in outcome if isinstance(r, Exception)]
        if errors:  # nothing was created; the first error that is not a rollback says why
            first = next((e for e in errors if not isinstance(e, RolledBackError)), errors[0])
            if isinstance(first, BadVersionError | NoNodeError):
                for _, q, p, _ in chunk:
                    self._tails.pop((q, p), None)
                raise _Stale
            raise first
        names = [_relative(str(path)) for path in outcome[checks:]]
        self._open_full(chunk, names)
        return [*names]

    def _reply(self, pending: Any) -> Any:
        """A multi's reply. A multi is sent only while connected (``_send``), but the
        connection may go in the instant between zkq's client's check and kazoo's queueing
        of it: kazoo then holds it until ZooKeeper comes back. Once it has been away
        ``connect_timeout`` meanwhile, ZkqConnectionError: the create may still happen if this
        client reconnects within its session, so nothing is sent again (``finish`` names the
        job to look up). While connected, however slow, it waits."""
        away_since: float | None = None
        while True:
            try:
                return pending.get(timeout=RECONNECT_POLL)
            except KazooTimeoutError:  # the threading handler's (zkq's handler is one)
                zk, timeout = self._zk(), self.settings.connect_timeout
                if zk.connected:
                    away_since = None
                    continue
                now = time.monotonic()
                away_since = now if away_since is None else away_since
                if now - away_since > timeout:
                    raise ZkqConnectionError(
                        f"ZooKeeper at {self.settings.hosts} went away while enqueuing and did "
                        f"not come back within {timeout:g}s"
                    ) from None

    def _open_full(self, chunk: list[Prepared], names: list[str]) -> None:
        """Count the entries this chunk made (``names``, one per entry) and open the next
        bucket of every priority whose tail bucket they filled. Best effort: the jobs are
        enqueued, which a connection lost here must not make look otherwise, and the next entry
        past a full bucket opens it otherwise."""
        full: set[tuple[str, str, int]] = set()
        for (_, queue, priority, _), name in zip(chunk, names, strict=True):
            entry = EntryName.parse(name)
            self._count(queue, priority, entry.bucket, entry.seq + 1)
            if entry.seq + 1 >= self.bucket_size:
                full.add((queue, priority, entry.bucket))
        for queue, priority, bucket in full:
            with contextlib.suppress(*TRANSIENT):
                tail, version = self.tail(queue, priority)
                opened = bucket == tail and claims.open_bucket(
                    self._zk(), self.layout, queue, priority, tail, version
                )
                if opened:  # else someone else moved the tail: how full, a reply will tell
                    self._count(queue, priority, tail + 1, 0)
            self._tails.pop((queue, priority), None)

    def _recover(self, chunk: list[Prepared], ephemeral: bool) -> list[str | None]:
        """A multi whose reply was lost committed as a whole or not at all: look its ids up
        once the connection is back (an entry, or a result if a worker already finished it)
        and create them again only if none is there. None: finished before it was found."""
        jid, queue, priority, _ = chunk[0]
        first = read_through_loss(
            self._zk(), self.settings, lambda: self.find(queue, priority, jid), "enqueuing"
        )
        names = [first, *(self.find(q, p, j) for j, q, p, _ in chunk[1:])]
        found = [(one, name) for one, name in zip(chunk, names, strict=True) if name]
        if found:  # it committed: count what it made, and open the bucket it may have filled
            self._open_full([one for one, _ in found], [name for _, name in found])
            return names
        zk = self._zk()
        if any(zk.exists(self.layout.result(q, j)) for j, q, _, _ in chunk):
            return names
        return self._retry(chunk, ephemeral)

    def create(
        self, queue: str, priority: str, job_id: str, data: bytes, ephemeral: bool
    ) -> str | None:
        """Create the entry exactly once: after a ConnectionLoss the create may have happened,
        so wait for the connection to come back and look for the id before creating again.
        None: the job was found already finished."""
        return self.finish([(job_id, queue, priority, data)], None, ephemeral)

    def send_known(self, one: Prepared, ephemeral: bool) -> Sent | None:
        """Send the multi that creates one entry, without blocking, where this client knows
        its lane's tail and that it has room for the entries on their way to it (from any
        thread); None otherwise: the tail must be read first (a blocking read), or the multi
        waits for a thread, as in ``create``, which sends to the tail it knows without that
        check. So a burst of submits overfills a bucket by no more than the client's threads."""
        lane = (one[1], one[2])
        if not self._zk().connected:  # a thread waits for ZooKeeper first (``_send``)
            return None
        with self._lock:
            tail = self._tails.get(lane)
            if tail is None:
                return None
            bucket, filled = self._filled.get(lane, (-1, 0))
            room = self.bucket_size - filled if bucket == tail[0] else 1
            if self._flying[lane] >= room:
                return None
            return self._send([one], ephemeral, {lane: tail})

    def quick(self, one: Prepared, sent: Sent) -> str | None:
        """The entry's name where the reply to ``sent`` (arrived) created it and it left room in
        its bucket: nothing that blocks remains. None otherwise: ``finish`` it (a stale tail, a
        lost reply, an error, or a bucket to open)."""
        checks, call = sent
        if not call.ready() or not call.successful():
            return None
        outcome = call.value
        if any(isinstance(r, Exception) for r in outcome):
            return None
        name = _relative(str(outcome[checks]))
        if EntryName.parse(name).seq + 1 >= self.bucket_size:
            return None
        self._open_full([one], [name])  # counts the entry; opens nothing
        return name

    def finish(self, chunk: list[Prepared], sent: Sent | None, ephemeral: bool) -> str | None:
        """``create`` for one entry whose multi may already be ``sent`` (blocking)."""
        job_id = chunk[0][0]
        try:
            if sent is not None:
                try:
                    return self._created(chunk, sent, ephemeral)[0]
                except _Stale:
                    pass
            return self._retry(chunk, ephemeral)[0]
        except ZkqConnectionError as exc:
            # The create may have committed: give the caller the id to look it up by.
            raise ZkqConnectionError(
                f"{exc}; job {job_id} may or may not have been enqueued "
                f"(check with: zkq status {job_id})",
                job_id=job_id,
            ) from None


def _cut_short(cause: str, prepared: list[Prepared], done: int, sent: int) -> ZkqConnectionError:
    """A batch's connection error that says which of its jobs were enqueued (``done``, in
    order), which were sent and may or may not have been, and how many were not sent."""
    enqueued = tuple(one[0] for one in prepared[:done])
    unsure = tuple(one[0] for one in prepared[done:sent])
    where = f" (the first is {unsure[0]}: check each with zkq status ID)" if unsure else ""
    return ZkqConnectionError(
        f"{cause}; of the batch's {len(prepared)} jobs, {len(enqueued)} were enqueued, "
        f"{len(unsure)} may or may not have been{where}, and {len(prepared) - sent} were not "
        "sent",
        job_id=unsure[0] if unsure else None,
        enqueued=enqueued,
        unsure=unsure,
    )


def _relative(path: str) -> str:
    """An entry's name below its priority (``[@<tenant>/]<bucket>/<id>-<seq>``) from its full
    path."""
    _, lane_dir, bucket, leaf = path.rsplit("/", 3)
    return f"{lane_dir}/{bucket}/{leaf}" if lane_dir.startswith(TENANT_MARK) else f"{bucket}/{leaf}"
