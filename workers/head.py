"""The head turn: the serial part of dispatch. At the head of the line, read the lowest pending
entries, judge each (dead-letter garbage and poison, expire what waited too long, reject what can
never run, leave what does not fit now), and claim what this worker admits in one multi.

Only the loop's thread calls it. It reads only as many entries as it can claim (more only when
some are refused), so its turn stays short whatever the depth of the queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from workers.admission import Admission, Verdict
from workers.metrics import WorkerMetrics
from zkqueue.dispatch.line import Line
from zkqueue.dispatch.share import FairShare, estimate
from zkqueue.dispatch.view import PendingView
from zkqueue.errors import InvalidJob
from zkqueue.protocol.claims import Candidate, Claim, Claims
from zkqueue.protocol.layout import (
    EntryName,
    Layout,
    in_lane,
    is_generated_id,
    lane,
    lane_parts,
)
from zkqueue.protocol.limits import RunningCap
from zkqueue.protocol.records import DeadLetter
from zkqueue.protocol.registry import read_records
from zkqueue.protocol.result import Status
from zkqueue.protocol.spec import JobSpec

log = logging.getLogger("zkq.worker")

#: Entries the head reads in one turn at most: keeps the serial part of dispatch short.
_SCAN_LIMIT = 64


@dataclass(frozen=True)
class _Read:
    """An entry's (data, stat) already known: answers like the read it saves."""

    found: tuple[bytes, Any]

    def get(self) -> tuple[bytes, Any]:
        return self.found


class Swap(Protocol):
    """How a busy line's head pairs the entries it may claim with jobs it gives back."""

    #: KV-cache pages of the jobs it may give back (they count as free when judging).
    credit: int
    #: Entries it may claim into free slots, with nothing given back (a narrowed worker's room
    #: for high-priority jobs; the running cap applies to these).
    room: int

    def pair(self, picked: list[Candidate]) -> tuple[list[Candidate], list[tuple[Claim, bytes]]]:
        """The candidates that get a job to displace (in order), and what to give back for
        them: each claim with the spec its entry gets (the preemption counted)."""
        ...


@dataclass
class HeadStats:
    """What the head did with the entries it judged (the worker's stats add these)."""

    dead_lettered: int = 0
    rejected: int = 0
    #: Candidates read and found gone (the view's listing was stale).
    gone: int = 0
    #: Entries claimed without being read: their tail's arrival signal carried them.
    unread: int = 0
    #: Claims failed by a guard: a more urgent job arrived between the look and the claim.
    guarded: int = 0


@dataclass
class HeadTurn:
    zk: KazooClient
    claims: Claims
    view: PendingView
    line: Line
    admission: Admission
    metrics: WorkerMetrics
    layout: Layout
    queue: str
    max_attempts: int
    stats: HeadStats = field(default_factory=HeadStats)
    #: Entries this turn found gone (the view's listing was stale).
    _gone: int = 0
    #: How many of the view's first candidates other heads took between this worker's last
    #: two turns (None: unknown). The next turn guesses they took as many again and reads the
    #: candidates after those in the refresh's round trip.
    _skip: int | None = None
    #: Whether this worker stayed in the line since its last turn (then nobody else claimed).
    _stayed: bool = False
    #: A claim took this worker out of the line: drop the view's watches, unless it is head
    #: again by the time the loop asks (it completed fast and rejoined a line it is alone in).
    _unwatch_due: bool = False
    #: The last turn claimed less than it could because of the queue's max_running.
    capped: bool = False
    #: The last turn left a job for a bigger worker that stands behind this one in the line:
    #: the loop sends this worker to the back of the line (``Line.step_aside``) when the
    #: turn claimed nothing, or the bigger one would never be head.
    step_aside: bool = False
    #: The workers' registrations, read once a turn when an entry is too big for this worker.
    _records: list[dict[str, Any]] | None = None
    #: The other workers standing in the line, listed once a turn in the same case.
    _members: set[str] | None = None
    #: The candidates this turn read and found still there (claimed or not: ``_claim`` tells
    #: which it passes over).
    _judged: list[tuple[str, EntryName]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cap = RunningCap(self.zk, self.layout, self.queue)
        self.share = FairShare(
            self.zk, self.layout, self.queue, weight=lambda t: self.cap.settings.weight(t)
        )
        self.view.share = self.share

    def turn(
        self,
        free: int,
        exclude: set[str],
        rejoin_if_room: bool,
        swap: Swap | None = None,
    ) -> list[tuple[Claim, int]] | None:
        """Claim up to ``free`` admissible entries not in ``exclude`` if this worker is the head
        of the line. Returns each claim with the KV-cache pages admission promised it ([] when
        nothing is claimable: the queue is empty for us, or we are not the head), or None if a
        race was lost. With ``swap`` (a busy line's head preempting: ``workers.preemption``)
        ``free`` is how many jobs it may give back; each entry claimed is paired with one of
        them, given back in the claim's multi, so the jobs running stay as many (the running
        cap does not apply) and the given-back pages count as free; ``free`` also counts the
        swap's ``room``, entries claimed with nothing given back (the cap applies to those)."""
        # A turn is two round trips: the first asks whether we are head (when our predecessor
        # left, or we rejoined a line we were alone in), re-lists claims/ and the buckets the
        # first candidates come from, and reads the candidates we expect to claim; the second
        # is the claim multi. Heads claim in order, so the candidates other heads took since
        # our last turn are the first ones our view holds: we guess they took as many as last
        # time (none if we stayed in the line) and read the ones after. A wrong guess costs a
        # third round trip (the reads after the refresh) and the reads it wasted.
        self.step_aside, self._judged, self._records, self._members = False, [], None, None
        asked = self.line.ask_async()
        if asked is None and not self.line.is_head():
            self.drop_watches()
            return []
        stayed, self._stayed = self._stayed, True
        # Other heads may have charged the tenants' counters since this one's last turn (it
        # cannot tell: it may have been head, then not, then head again): read them afresh,
        # in this round trip.
        self.share.refetch()
        skip = 0 if stayed else self._skip
        scan = self._scan(free)
        # Far enough to find where the first candidate now lies (others may have taken more
        # than ``scan``): a guess beyond the stale order's end reads nothing and lists the
        # wrong lanes.
        reach = max(scan, (_SCAN_LIMIT if skip is None else skip) + free)
        stale = list(islice(self.view.candidates(exclude), reach))
        guess = stale[skip : skip + free] if skip is not None else []
        reads = self._read(guess)
        # The refresh re-lists claims/ every turn, so with a cap the claims counted now are
        # every claim there is (only the head claims). Where tenants share a band, the lanes'
        # claim frontiers come with the counters in this round trip: the candidates we guess
        # others took are left to them, not listed (each may be in a lane of its own).
        gone = min(len(stale), skip or 0) if self.share.reading else 0
        want = min(len(stale), (skip or 0) + free)
        self.view.refresh(want, frozenset(exclude), first=gone, walked=stale)
        if not self.line.settle(asked):
            self.drop_watches()
            return []  # not the head after all (a predecessor that was not head left)
        self._unwatch_due = False  # head again: the watches still serve
        self.view.await_arrivals(free, frozenset(exclude))
        self._order(exclude)
        ordered = list(islice(self.view.candidates(exclude), scan))

        def read_first() -> None:
            # The first candidates' reads ride with the listing (one round trip, not two);
            # wasted only if the listing changes the order (an entry given back).
            reads.update(self._read([c for c in ordered[:free] if c not in reads]))

        for _ in range(3):  # the guess missed a lane: list it now (the order may change)
            if not self.view.confirm(ordered[:free], along=read_first):
                break
            ordered = list(islice(self.view.candidates(exclude), scan))
        arrived = self._arrived(ordered[:free], reads)
        reads.update(arrived)
        if not stayed:
            self._skip = stale.index(ordered[0]) if ordered and ordered[0] in stale else None
        self._letter_malformed()
        self._gone = 0
        cap = self.cap.value
        shrunk = False  # the cap took free slots from a busy head's room
        if swap is not None:
            if cap is not None and swap.room > 0:
                room = max(0, min(swap.room, cap - len(self.view.claimed)))
                shrunk = room < swap.room
                free -= swap.room - room
                swap.room = room
            cap = None
        want = free if cap is None else min(free, cap - len(self.view.claimed))
        self.capped = want < free or shrunk
        if self.capped:
            self.view.arm_claims()  # hear a claim end: it frees a slot under the cap
        else:
            self.view.watch_claims = False
        if want <= 0:
            return []
        picked = self._pick(want, ordered, reads, swap.credit if swap is not None else 0)
        give_back: list[tuple[Claim, bytes]] = []
        if swap is not None:
            picked, give_back = swap.pair(picked)
        if not picked:
            if self._gone:  # the view was stale (its entries had ended): list again, retry
                self.view.invalidate()
                return None
            return []
        claimed = self._claim(picked, rejoin_if_room and free - len(picked) > 0, give_back)
        if claimed is None and self.claims.guarded and swap is None:
            # A more urgent job arrived since this head looked: its band's own picks need no
            # guard, so claim them at once rather than none (under a stream of urgent jobs,
            # every claim that also held a less urgent one would fail); the rest waits for a
            # turn that sees the newcomers.
            self.stats.guarded += 1
            top = [c for c in picked if c.priority == self.view.priorities[0]]
            lowest = max(picked, key=lambda c: self.view.priorities.index(c.priority)).priority
            if top and len(top) < len(picked):
                picked = top
                claimed = self._claim(picked, rejoin_if_room and free - len(picked) > 0, [])
                if claimed is not None:
                    self.view.relist_above(lowest)  # the newcomers: seen next turn
        if claimed is None:
            self.view.invalidate()
            return None
        self._stayed = False  # the claim multi left the line (and maybe rejoined at the back)
        self.stats.unread += sum((c.priority, c.entry) in arrived for c in picked)
        # Out of the line (or at its back): the next head watches, not us. Dropping the
        # watches waits for the loop's next pass (after this job's completion, if it was
        # quick), so the removals do not delay that completion and are skipped when we are
        # head again by then (a worker alone in the line).
        self.drop_watches_soon()
        # Claimed entries stay pending until completed; mark them claimed, never forget them:
        # a release or crash makes them claimable again (the next turn's claims listing says so).
        self.view.claimed.update(c.entry.job_id for c in picked)
        return [(claim, c.pages) for claim, c in zip(claimed, picked, strict=True)]

    def _claim(
        self, picked: list[Candidate], rejoin: bool, give_back: list[tuple[Claim, bytes]]
    ) -> list[Claim] | None:
        """Charge the tenants and move their lanes' frontiers, then claim ``picked`` in one
        multi with the counters' write and the guards of the more urgent priorities; None
        (everything as it was) if the multi failed (``Claims.guarded``: a guard failed). In a
        queue with no tenant's lane, fair share has nothing to count: the claim alone."""
        shared = any(self.view.tenants.values())
        before = (self.share.service, self.share.cost, self.share.frontier)
        writes: list[tuple[str, bytes]] = []
        passed = False
        if shared:
            self.share.service, self.share.cost = dict(before[0]), dict(before[1])
            self.share.frontier = dict(before[2])
            writes, passed = self._charge(picked)
        lowest = max(picked, key=lambda c: self.view.priorities.index(c.priority)).priority
        claimed = self.claims.claim(
            picked,
            self.line,
            rejoin=rejoin,
            give_back=give_back,
            extra=writes,
            checks=self.view.guards(lowest),
            passed=passed,
        )
        if claimed is None:
            # Nobody was served: the counters as they were (charged on copies).
            self.share.service, self.share.cost, self.share.frontier = before
            return None
        if not shared:  # the cost average only, kept for when a tenant comes
            for c in picked:
                self.share.average(c.entry.tenant_name, estimate(c.spec))
        if writes:
            self.share.saved()
        if writes and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "claimed for tenants %s; their service now %s",
                ",".join(c.entry.tenant_name for c in picked),
                {t: round(v) for t, v in self.share.service.items()},
            )
        return claimed

    def _charge(self, picked: list[Candidate]) -> tuple[list[tuple[str, bytes]], bool]:
        """Charge the tenants of ``picked`` and move their lanes' frontiers: the write of the
        counters for the claim's multi, and whether the claim passes over an entry."""
        last: dict[str, tuple[int, int]] = {}
        for c in picked:
            self.share.charge(c.entry.tenant_name, estimate(c.spec))
            path = lane(c.priority, c.entry.tenant)
            last[path] = max(c.entry.order, last.get(path, c.entry.order))
        self.share.claimed(last)
        taken = {(c.priority, c.entry) for c in picked}
        writes = self.share.writes(
            c.entry.tenant_name for c in picked if self.share.contended(c.priority)
        )
        # An entry left pending before a later one of its lane (it did not fit): the lane's
        # frontier (written with the counters) moves past it, so the claim sets the give-back
        # signal (other heads list the lane again rather than hide it). Over-counted when it
        # was lettered or ended: a re-listing, no more. Without a write no frontier moves.
        passed = bool(writes) and any(
            e.order < last.get(lane(p, e.tenant), e.order)
            for p, e in self._judged
            if (p, e) not in taken
        )
        return writes, passed

    def _order(self, exclude: set[str]) -> None:
        """Bring what orders the candidates up to date: the queue's aging setting and the
        ctimes it needs (one pipelined read of the lanes' new first entries), and the
        tenants backlogged in each band (fair share lifts those that were idle)."""
        if self.share.reading:
            self.share.load()  # the claim frontiers first: they decide what is a candidate
            self.view.drop_behind_fronts()
        settings = self.cap.settings
        self.view.promote_after = settings.promote_after
        self.view.now = time.time()
        unaged = self.view.unaged(exclude)
        calls = [
            (
                path,
                e,
                self.zk.exists_async(self.layout.entry(self.queue, lane_parts(path)[0], e.name)),
            )
            for path, e in unaged
        ]
        for path, e, call in calls:
            stat = call.get()
            if stat is not None:
                self.view.ctimes[(path, e.name)] = stat.ctime / 1000
        if len(self.view.ctimes) > 4096:
            self.view.ctimes.clear()
        if not any(self.view.tenants.values()):
            self.share.backlogged.clear()  # one lane a priority: no choice between tenants
            return
        for priority in self.view.priorities:
            self.share.observe(priority, self.view.backlogged(priority, exclude))

    def _scan(self, free: int) -> int:
        """How many candidates a turn orders: _SCAN_LIMIT, or where tenants share a priority
        (each candidate then costs a step of the fair-share merge) a few more than it claims."""
        if not any(self.view.tenants.values()):
            return _SCAN_LIMIT
        return min(_SCAN_LIMIT, 4 * free + 8)

    def drop_watches_soon(self) -> None:
        """This worker left the line: drop its watches on the loop's next pass."""
        self._unwatch_due = True

    def drop_watches(self) -> None:
        """Remove the view's watches if a claim took this worker out of the line."""
        if self._unwatch_due:
            self._unwatch_due = False
            self.view.unwatch()

    def _read(self, part: list[tuple[str, EntryName]]) -> dict[tuple[str, EntryName], Any]:
        """Each entry's data, and whether its id already has a result (a raw producer's
        duplicate), pipelined: one round trip. The result is read first: a result there
        before the entry is read is a duplicate's, not that of a completion in between. A
        generated id is new by construction: its check is left to the completion (whose
        result create would fail on a duplicate), which saves a request per job."""
        reads = {}
        for p, e in part:
            result = None
            if not is_generated_id(e.job_id):
                result = self.zk.exists_async(self.layout.result(self.queue, e.job_id))
            reads[(p, e)] = (self.zk.get_async(self.claims.entry_path(p, e)), result)
        return reads

    def _arrived(
        self, first: list[tuple[str, EntryName]], reads: dict[tuple[str, EntryName], Any]
    ) -> dict[tuple[str, EntryName], Any]:
        """Reads of the first candidates that the refresh found in their tail's arrival signal
        (only for generated ids: another id needs its result check, a round trip anyway)."""
        return {
            (p, e): (_Read(found), None)
            for p, e in first
            if (p, e) not in reads
            and is_generated_id(e.job_id)
            and (found := self.view.arrived.get((p, e.name))) is not None
        }

    def _pick(
        self,
        want: int,
        ordered: list[tuple[str, EntryName]],
        reads: dict[tuple[str, EntryName], Any],
        credit: int = 0,
    ) -> list[Candidate]:
        """Judge ``ordered`` (the first candidates, in dispatch order) until ``want`` are
        admitted; ``reads`` holds those already read; ``credit`` pages of the promised ones
        are about to be given back."""
        picked: list[Candidate] = []
        start = 0
        while start < len(ordered):
            # Read only as many entries as could be claimed; more only when some are refused.
            chunk = want if start == 0 else max(want, 4)
            part = ordered[start : start + chunk]
            start += chunk
            fresh = self._read([c for c in part if c not in reads])
            calls = [reads.get(c) or fresh[c] for c in part]
            for (priority, entry), (call, result) in zip(part, calls, strict=True):
                try:
                    data, stat = call.get()
                except NoNodeError:
                    self.view.drop(priority, entry)
                    # Its bucket's listing is stale: list it again in the next refresh.
                    self.view.invalidate((lane(priority, entry.tenant), entry.bucket))
                    self._gone += 1
                    self.stats.gone += 1
                    continue
                self._judged.append((priority, entry))
                if result is not None and result.get() is not None:
                    self._duplicate(priority, entry, data, stat)
                    continue
                extra = sum(c.pages for c in picked) - credit
                cand = self._judge(priority, entry, data, stat, extra)
                if cand is not None:
                    picked.append(cand)
                    if len(picked) >= want:
                        return picked
        return picked

    def _judge(
        self, priority: str, entry: EntryName, data: bytes, stat: Any, extra: int
    ) -> Candidate | None:
        """A candidate if this worker should claim the entry now; otherwise deal with it."""
        if stat.numChildren:
            # Not a job znode: its completion's delete could never succeed (NotEmpty).
            reason = f"entry has {stat.numChildren} child node(s); a job entry has none"
            self._letter(priority, entry.name, data, stat, reason, entry.job_id)
            return None
        try:
            spec = JobSpec.from_bytes(data)
        except InvalidJob as exc:
            self._letter(priority, entry.name, data, stat, f"invalid job spec: {exc}", entry.job_id)
            return None
        if spec.attempts(stat.version) >= self.max_attempts:
            reason = (
                f"claimed {spec.attempts(stat.version)} times without finishing "
                f"(max_attempts={self.max_attempts}): a poison job or crashing workers"
            )
            self._letter(priority, entry.name, data, stat, reason, entry.job_id)
            return None
        if spec.queue_timeout is not None and time.time() - stat.ctime / 1000 > spec.queue_timeout:
            error = f"not started within queue_timeout of {spec.queue_timeout:g}s"
            self._end_unclaimed(priority, entry, stat, Status.EXPIRED, error)
            return None
        decision = self.admission.judge(spec, extra)
        if decision.verdict == Verdict.ADMIT:
            return Candidate(priority, entry, data, stat, spec, decision.pages)
        if decision.verdict == Verdict.REJECT:
            self._reject(priority, entry, stat, decision.reason)
        elif decision.verdict == Verdict.NEVER:
            self._never_here(priority, entry, stat, decision.pages, decision.reason)
        return None

    def _duplicate(self, priority: str, entry: EntryName, data: bytes, stat: Any) -> None:
        """An entry whose id already has a result is never run again: lettered, no result."""
        reason = DeadLetter.duplicate(entry.job_id)
        if self.claims.dead_letter(
            priority, entry.name, data, stat, reason, entry.job_id, with_result=False
        ):
            self.stats.dead_lettered += 1
        self.view.drop(priority, entry)

    def _reject(self, priority: str, entry: EntryName, stat: Any, reason: str) -> None:
        self._end_unclaimed(priority, entry, stat, Status.REJECTED, reason)
        self.stats.rejected += 1

    def _never_here(
        self, priority: str, entry: EntryName, stat: Any, pages: int, reason: str
    ) -> None:
        """Too big for this worker: reject it if no registered worker of the queue could ever
        hold it, else leave it for a bigger one."""
        need = pages * self.admission.page_tokens
        if self._records is None:  # once a turn
            self._records = read_records(self.zk, self.layout)
        records = self._records
        largest = self._largest_capacity(records)
        if largest is None or need <= largest:
            log.info("job %s left for a bigger worker: %s", entry.job_id, reason)
            if not self.step_aside:
                if self._members is None:  # once a turn, as the registrations
                    self._members = set(self.line.members()) - {self.line.worker_id}
                behind = self._members
                self.step_aside = any(
                    r.get("id") in behind and (self._capacity(r) or 0) >= need for r in records
                )
            return
        self._reject(
            priority,
            entry,
            stat,
            f"needs {pages} KV-cache pages ({need} tokens of cache); the largest worker of "
            f"queue {self.queue!r} holds {largest} tokens",
        )

    def _largest_capacity(self, records: list[dict[str, Any]]) -> int | None:
        """The most cache positions any registered worker of this queue holds."""
        capacities = [c for r in records if (c := self._capacity(r)) is not None]
        return max(capacities) if capacities else None

    def _capacity(self, record: dict[str, Any]) -> int | None:
        """The cache positions a registered worker of this queue holds (None: unknown)."""
        cache = record.get("memory") or {}
        if record.get("queue") != self.queue or cache.get("capacity_tokens") is None:
            return None
        return int(cache["capacity_tokens"])

    def _letter(
        self, priority: str, name: str, data: bytes, stat: Any, reason: str, job_id: str | None
    ) -> None:
        if self.claims.dead_letter(priority, name, data, stat, reason, job_id):
            self.stats.dead_lettered += 1
            self.metrics.job_finished(self.queue, priority, Status.DEAD, None, None, None)

    def _letter_malformed(self) -> None:
        for path, names in self.view.malformed.items():
            priority = lane_parts(path)[0]
            for below in names:
                name = in_lane(path, below)
                try:
                    data, stat = self.zk.get(self.layout.entry(self.queue, priority, name))
                except NoNodeError:
                    continue
                reason = f"entry name {below!r} is not <bucket>/<id>-<sequence>"
                self._letter(priority, name, data, stat, reason, None)
            names.clear()

    def _end_unclaimed(
        self, priority: str, entry: EntryName, stat: Any, status: Status, error: str
    ) -> None:
        ended = self.claims.end_unclaimed(
            priority,
            entry,
            version=stat.version,
            submitted_at=stat.ctime / 1000,
            status=status,
            error=error,
        )
        if ended:
            self.metrics.job_finished(self.queue, priority, status, None, None, None)
