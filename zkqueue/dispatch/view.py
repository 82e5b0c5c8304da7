"""The head's view of a queue: pending entries in dispatch order and the ids of claimed ones,
kept current by child watches that only the head of the line sets.

The view is depth-flat: per priority it lists the bucket names (one per ~1,000 entries) and only
the first buckets, until it holds enough unclaimed candidates; a bucket's names are parsed once
(cached by name). A bucket before the tail never gains an entry (producers' multis check the
tail), so it is listed once more when it stops being the tail and never again; its finished
entries are dropped when a read finds them gone. Empty buckets before the tail are deleted.

Watches are set only when the head runs short of candidates (it is waiting for arrivals): then on
the bucket names and the tail bucket of each priority. While any job runs, a tail is watched
through its data (the arrival signal, which may carry the new entry: zkqueue.protocol.arrival), not
its children: a running job's entry stays in its bucket until its completion, whose delete would
wake the head for nothing. Entries created without the signal are found by a re-listing at each
heartbeat. A busy head sets none, so completions notify nobody; each turn it re-lists (unwatched)
the bucket its first candidates come from (other workers' completions would otherwise be read as
candidates and found gone) and the tail buckets of priorities above its best candidate, so a more
urgent arrival is never passed over.

Each priority holds lanes: its own buckets (the default tenant's) and one directory per tenant,
``@<tenant>``, found in the same listing as the bucket names. The view lists each lane as it
lists a priority; a priority's candidates are its lanes' merged by fair share and aging
(``zkqueue.dispatch.share``).

Where tenants share a priority, a head claims from several lanes a turn, and re-listing each of
them every turn would cost a request per lane. It need not: the lanes' claim frontiers (read with
the counters each turn) hide the entries other heads claimed since, and claims/'s data version,
which every give-back moves (the give-back signal: ``zkqueue.protocol.claims``) and which the
head reads with the claims/ listing it makes each turn, says whether any job went back behind a
frontier since a bucket was listed. Such a bucket's listing is reused (``_reusable``) while the
version is the one it was listed at, for at most ``TRUST_FOR`` seconds (a claim lost with its
session gives its job back without the signal), and only if it was made in a turn that read the
frontiers before its claims/ listing and it showed no job pending at or before its lane's
frontier (one given back before the listing, which the frontier would hide again)."""

from __future__ import annotations

import logging
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice, repeat
from operator import attrgetter
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import WatchedEvent, ZnodeStat

from zkqueue import defaults
from zkqueue.dispatch import aging
from zkqueue.dispatch.share import FairShare
from zkqueue.errors import InvalidJob
from zkqueue.plumbing.watches import remove_child_watch, remove_data_watch
from zkqueue.protocol import arrival
from zkqueue.protocol.layout import (
    TENANT_MARK,
    EntryName,
    Layout,
    bucket_name,
    lane,
    lane_mark,
    lane_parts,
    parse_bucket,
    tenant_of_child,
)

log = logging.getLogger("zkq.view")
CLAIMS = "claims"
#: Seconds between listings of the tail of a lane with no candidate, while tenants share a
#: priority (``PendingView._idle_tails``).
IDLE_RELIST = 0.25
#: Dry lanes one refresh lists at most (``PendingView._idle_tails``).
IDLE_PER_TURN = 8
#: Unclaimed candidates per priority the view keeps listed (when the buckets hold that many).
WANT = 64
#: Seconds a bucket's listing is reused, in a priority where tenants share, while no job was
#: given back (``PendingView._reusable``): the longest a job whose claim was lost with its
#: worker's session (no give-back signal) may stay hidden behind its lane's claim frontier.
TRUST_FOR = 2.0
#: A part of the view, re-read when its watch fires: CLAIMS, a lane (its bucket names: a
#: priority's also name its tenants' lanes), or (lane, bucket) (the bucket's entries).
Part = Any


@dataclass(eq=False)
class _Watch:
    """A stable callable per watched path: kazoo keeps watchers in a set, so re-arming the same
    object never stacks duplicate callbacks."""

    part: Part
    view: PendingView

    def __call__(self, event: WatchedEvent) -> None:
        # Runs on kazoo's thread: only count and post; the loop's thread calls invalidate(),
        # which marks the part unwatched (the view's sets are the loop thread's alone).
        self.view.events += 1
        self.view.on_change(self.part)


@dataclass(eq=False)
class PendingView:
    zk: KazooClient
    layout: Layout
    queue: str
    on_change: Callable[[Part], None]
    #: Bucket numbers per lane, in order.
    buckets: dict[str, list[int]] = field(default_factory=dict)
    #: Entries of the listed buckets, in order, by (lane, bucket).
    listed: dict[tuple[str, int], list[EntryName]] = field(default_factory=dict)
    #: Names (below the lane) that are not entries, by lane: the head dead-letters them.
    malformed: dict[str, list[str]] = field(default_factory=dict)
    #: The tenants with a lane in each priority, by name (the default tenant's is the
    #: priority's own buckets, not listed here).
    tenants: dict[str, list[str]] = field(default_factory=dict)
    #: Orders the lanes of a band (None: one after the other).
    share: FairShare | None = None
    #: Aging: seconds of waiting that take a lane's first entry one priority up (None: off).
    promote_after: float | None = None
    #: ZooKeeper ctime (seconds) of entries the head read, by (lane, name): aging's clock.
    ctimes: dict[tuple[str, str], float] = field(default_factory=dict)
    #: Ids of the running jobs (claims/ is one node per id).
    claimed: set[str] = field(default_factory=set)
    events: int = 0
    #: Child listings this view made (benchmarks count them).
    listings: int = 0
    #: Parts with a watch set on the server: a child watch, or a data watch for those also in
    #: ``signalled`` (tail buckets whose data producers touch on every enqueue).
    armed: set[Any] = field(default_factory=set)
    signalled: set[Any] = field(default_factory=set)
    #: Watch claims/ too (the head is capped by max_running: a claim ending frees a slot).
    watch_claims: bool = False
    #: The priorities this view covers, in dispatch order: all of them for the line's head;
    #: those above its floor for a busy line's head (``workers.preemption``).
    priorities: tuple[str, ...] = defaults.PRIORITIES

    def __post_init__(self) -> None:
        self._dirty: set[Part] = {*self.priorities, CLAIMS}
        #: The wall clock aging compares ctimes with (the head sets it each turn).
        self.now = 0.0
        #: When the tails below the first priority were last listed for aging (monotonic).
        self._aged_at = 0.0
        #: The data version of each lane's node and listed bucket, by path, as its last listing
        #: found it (``guards``).
        self.versions: dict[str, int] = {}
        #: When each bucket was last listed (monotonic; ``_idle_tails``).
        self._listed_at: dict[Part, float] = {}
        #: Buckets listed since the last refresh began (after the counters' read that came
        #: with it; ``confirm`` and ``await_arrivals`` add theirs):
        #: their entries are current, whatever the lanes' claim frontiers say.
        self._fresh: set[Part] = set()
        #: The last turn found fewer candidates than it could claim (it armed watches).
        self._waiting = False
        self._watches: dict[Part, _Watch] = {}
        self._parsed: dict[tuple[str, int], dict[str, EntryName]] = {}
        #: Entries (by priority and name) the last refresh found in their tail's arrival
        #: signal: (spec bytes, stat), so the head claims them without reading them.
        self.arrived: dict[tuple[str, str], tuple[bytes, ZnodeStat]] = {}
        #: Each priority's lanes (``lanes``), made when its listing sets its ``tenants``.
        self._lane_paths: dict[str, list[str]] = {}
        #: Tails listed since this worker last became head: only an entry that appeared after
        #: such a listing can have come to no other head (none claimed it meanwhile).
        self._headed: set[Part] = set()
        #: claims/'s data version at its last listing: the count of give-backs (the give-back
        #: signal, ``zkqueue.protocol.claims``), None until listed.
        self.given: int | None = None
        #: ``given`` as it was when each bucket was last listed (read before the listing, in
        #: the same session: a give-back after it moves ``given`` past this); None where that
        #: listing showed a job pending behind its lane's frontier (``_mark_behind``).
        self._given_at: dict[Part, int | None] = {}
        #: This turn's claim frontiers were read before its claims/ listing (``_reusable``).
        self._ahead = False

    def invalidate(self, part: Part | None = None) -> None:
        """Mark one part, or everything, to be re-read."""
        if part is None:
            # Re-list everything; the watches stay set on the server (and in these books, so a
            # bucket is never watched both ways, and unwatch() removes what is set). A fired
            # watch comes back through invalidate(part); a lost session through forget_watches().
            self._dirty = {*self.lanes(), CLAIMS, *self.listed}
        else:
            self._dirty.add(part)
            self.armed.discard(part)
            self.signalled.discard(part)

    def relist_above(self, lowest: str) -> None:
        """List again, in the next refresh, what a claim of ``lowest`` guards (``guards``): the
        lanes and tail buckets of the priorities above it (a guard failed: something arrived
        there). Their watches, if any, stay as they are."""
        rank = self.priorities.index(lowest) if lowest in self.priorities else 0
        above = self.priorities[:rank]
        self._dirty |= {path for p in above for path in self.lanes(p)}
        self._dirty |= {t for t in self._tails() if lane_parts(t[0])[0] in above}

    def forget_watches(self) -> None:
        """The session is gone, and every watch with it: re-list and re-arm everything."""
        self.invalidate()
        if self.share is not None:
            self.share.forget()
        self._headed.clear()
        self.armed.clear()
        self.signalled.clear()
        self.watch_claims = False

    def refresh(
        self,
        want: int = 1,
        exclude: frozenset[str] = frozenset(),
        first: int = 0,
        walked: list[tuple[str, EntryName]] | None = None,
    ) -> None:
        """Re-list what changed since the last refresh, the claims (never watched: a job's
        claim and completion notify nobody; the loop's periodic turn sees a claim that
        vanished), the buckets the candidates ``first`` to ``want`` come from and the tails
        above the best candidate, pipelined (in the same round trip as whatever the caller
        sent just before); list the next buckets of any priority short of candidates.
        ``await_arrivals`` follows when the caller is the head. ``first``: how many of the
        first candidates the caller expects other heads to have claimed since its last turn,
        when the lanes' claim frontiers come in the same round trip (``FairShare.reading``):
        those are hidden by the frontiers instead of listed. ``walked``: the candidates as the
        caller just walked them, at least ``want`` if there are (the walk is not made twice:
        with tenants, each candidate is a step of the fair-share merge)."""
        dirty, self._dirty = self._dirty, set()
        self._fresh = set()
        self.arrived = {}
        # The frontiers reuse hides by were read before this refresh's claims/ listing.
        self._ahead = self.share is not None and self.share.reading
        # Each priority's bucket names stay watched (they change once per ~1,000 jobs), so the
        # tails of the priorities above the best candidate are always the current ones.
        names = {p for p in self.lanes() if p not in self.armed}
        arm = names | ({CLAIMS} if self.watch_claims else set())
        # The best candidate as listed so far: what the tails above it, the uncertain tails and
        # the idle lanes to list are measured against (one merge, not one each).
        if walked is None:
            walked = list(islice(self.candidates(set(exclude)), want))
        best = walked[0] if walked else None
        parts = dirty | names | {CLAIMS} | self._tails_above(best)
        parts |= self._sources(walked[first:want])
        parts |= self._uncertain(exclude, best) | self._aging() | self._idle_tails(exclude, best)
        # Woken from waiting: an arrival's entry may be in the signal (zkqueue.protocol.arrival) of
        # a tail whose watch fired.
        peek = self._tails() & dirty if self._waiting else set()
        self._read(parts, arm, peek=peek)
        for _ in range(8):
            more, self._dirty = self._short() | self._dirty, set()
            if not more:
                break
            self._read(more)

    def await_arrivals(self, want: int, exclude: frozenset[str]) -> None:
        """When fewer than ``want`` candidates remain, list the bucket names and tails again
        with watches, to hear of arrivals (only the head of the line calls it)."""
        have = self._count(want, set(exclude))
        self._waiting = have < want
        if self._waiting:
            # A waiting head watches each priority's bucket names and its tail bucket.
            waiting = {*self.lanes(), *self._tails()} - self.armed
            # While jobs run (or are about to: the head claims ``have`` now), tails are watched
            # through their data, which producers touch in every enqueue: a child watch would
            # also fire when those jobs complete (a running job's entry stays in its bucket,
            # which may be the tail, until then).
            busy = bool(self.claimed or have)
            signal = {p for p in waiting if not isinstance(p, str)} if busy else set()
            signal |= waiting & self.signalled
            self._read(waiting, waiting - signal, signal, peek=waiting & self._tails())

    def _count(self, want: int, exclude: set[str]) -> int:
        """How many candidates there are, up to ``want`` (their order does not matter: no
        merge)."""
        have = 0
        for path in self.lanes():
            for _ in self._lane_entries(path, exclude):
                have += 1
                if have >= want:
                    return have
        return have

    def poll(self) -> None:
        """Re-list the tails watched through their data (the loop calls it at each heartbeat
        while this worker is head): an entry a producer created without touching the bucket's
        data (docs/PROTOCOL.md) waits for this, or for the next event, at most."""
        self._dirty |= self.signalled & self._tails()  # their data watches stay set: not re-armed

    def guards(self, lowest: str) -> list[tuple[str, int]]:
        """(path, data version) to check in a claim whose least urgent entry is of ``lowest``:
        each lane of the priorities above it, its tail bucket and the priority's node, at the
        versions their last listings found. Producers set a tail's data in each enqueue (the
        arrival signal), and a priority's node changes when a tenant's lane is made there (or
        a bucket opens): if a more urgent job arrived after this head looked, the claim fails
        and the head looks again."""
        rank = self.priorities.index(lowest) if lowest in self.priorities else 0
        checks = []
        for priority in self.priorities[:rank]:
            paths = [self._path(path) for path in self.lanes(priority)]  # a bucket opening
            paths += [self._path(t) for t in self._tails() if lane_parts(t[0])[0] == priority]
            checks += [(p, self.versions[p]) for p in paths if p in self.versions]
        return checks

    def _idle_tails(self, exclude: frozenset[str], best: tuple[str, EntryName] | None) -> set[Part]:
        """The tails of the lanes with no candidate listed in the priorities down to the best
        candidate's, each at most every IDLE_RELIST seconds: a busy head watches nothing, and
        a tenant whose lane ran dry must still be seen when it sends more (its new jobs would
        otherwise wait until every other tenant's had run)."""
        if not any(self.tenants.values()):
            return set()  # one lane a priority: its arrivals are the tail listings' business
        if best is None:
            return set()
        bands = self.priorities[: self.priorities.index(best[0]) + 1]
        now = time.monotonic()
        due: list[tuple[float, str, int, int]] = []
        for path in [path for p in bands for path in self.lanes(p)]:
            numbers = self.buckets.get(path)
            if not numbers or next(self._lane_entries(path, set(exclude)), None) is not None:
                continue
            listed_at = self._listed_at.get((path, numbers[-1]), 0.0)
            if now - listed_at >= IDLE_RELIST:
                due.append((listed_at, path, numbers[0], numbers[-1]))
        found: set[Part] = set()
        # The longest unlisted first, IDLE_PER_TURN a turn: many dry lanes (a tenant per
        # caller) must not make every turn list them all.
        for _, path, first, tail in sorted(due)[:IDLE_PER_TURN]:
            # And its first bucket: an entry given back there may be hidden by the lane's
            # claim frontier (``_lane_entries``).
            found.add((path, tail))
            if not self._reusable((path, first), self.share.frontier if self.share else None):
                found.add((path, first))
        return found - self._trusted()

    def _aging(self) -> set[Part]:
        """With aging on, the tails below the first priority, at most once a second: a busy
        head lists lower priorities only when it runs short, and an entry that arrived there
        meanwhile must still be seen to age."""
        if self.promote_after is None:
            return set()
        now = time.monotonic()
        if now - self._aged_at < min(1.0, self.promote_after / 4):
            return set()
        self._aged_at = now
        top = self.priorities[0]
        return {t for t in self._tails() if lane_parts(t[0])[0] != top} - self._trusted()

    def _uncertain(self, exclude: frozenset[str], best: tuple[str, EntryName] | None) -> set[Part]:
        """Tails watched through their data whose listing may be stale, since neither a
        completion nor a raw producer's entry fires a data watch: those holding jobs that were
        running (their completions would be read as candidates), and all of them when the view
        has no candidate (the head wakes from waiting, perhaps to claim from a lower priority
        than a raw entry in one of them). Jobs of this worker (``exclude``) do not count: it
        drops their entries itself. Re-listed, unwatched, in the refresh."""
        if self._waiting or best is None:
            return set(self.signalled)
        return {
            part
            for part in self.signalled
            if any(
                e.job_id in self.claimed and e.name not in exclude
                for e in self.listed.get(part, ())
            )
        }

    def _sources(self, chosen: list[tuple[str, EntryName]]) -> set[Part]:
        """The unwatched buckets the candidates ``chosen`` come from, and those before them in
        their lanes: re-listed each turn (with one lane, one bucket of at most ~1,100 names),
        since other workers' completions are not watched and their entries would otherwise be
        read as candidates and found gone. The candidates before them (that the caller expects
        other heads took) are left to the claim frontiers (``_lane_entries``): where tenants
        share a band, they come from as many lanes, a listing each."""
        found: set[Part] = set()
        for path, bucket in {(lane(p, e.tenant), e.bucket) for p, e in chosen}:
            found |= self._up_to(path, bucket) | {(path, bucket)}
        if self.share is not None and self.share.reading:
            # The frontiers come in this round trip: a listing no give-back made stale is
            # reused (guessed from the signal as last read; ``confirm`` lists what a give-back
            # since made stale).
            found = {part for part in found if not self._reusable(part, self.share.frontier)}
        return found - self._trusted()

    def _reusable(self, part: Part, fronts: dict[str, tuple[int, int]] | None = None) -> bool:
        """Whether a bucket's last listing may stand for a new one: its lane is in a priority
        where this head chose between tenants at its last look (every claim from it then
        moves the lane's claim frontier, which hides what other heads claimed since), the lane
        has a frontier (in ``fronts``; this turn's when None), no job was given back since the
        listing (the give-back signal), the listing showed none pending at or before the
        frontier (one given back earlier: reuse would hide it), and it is under ``TRUST_FOR``
        seconds old."""
        if not self._ahead or self.given is None or self._given_at.get(part) != self.given:
            return False
        assert self.share is not None
        path = part[0]
        known = self._front(path) if fronts is None else fronts.get(path)
        return (
            known is not None
            and self.share.contended(lane_parts(path)[0])
            and time.monotonic() - self._listed_at.get(part, 0.0) < TRUST_FOR
        )

    def _up_to(self, path: str, bucket: int) -> set[Part]:
        """The listed buckets of lane ``path`` up to ``bucket``."""
        return {(path, b) for b in self.buckets.get(path, []) if b <= bucket}

    def _trusted(self) -> set[Part]:
        """Parts whose child watch reports every change (a data watch hears arrivals only)."""
        return self.armed - self.signalled

    def _tails_above(self, best: tuple[str, EntryName] | None) -> set[Part]:
        """The listed tail buckets of the priorities ranked above the best candidate's."""
        above = self.priorities[: self.priorities.index(best[0])] if best else ()
        return {t for t in self._tails() if lane_parts(t[0])[0] in above} - self._trusted()

    def _tails(self) -> set[Part]:
        """Each priority's tail bucket, as listed."""
        return {(p, ns[-1]) for p, ns in self.buckets.items() if ns}

    def lanes(self, priority: str | None = None) -> list[str]:
        """The lanes of ``priority`` (of every priority of the view when None), in order: its
        own, then its tenants'."""
        found = []
        for p in self.priorities if priority is None else (priority,):
            found += self._lane_paths.get(p) or [p]
        return found

    def _lane_entries(self, path: str, exclude: set[str]) -> Iterator[EntryName]:
        """One lane's unclaimed entries in order, as far as its buckets are listed. In a
        bucket not listed in the last refresh, the entries at or before the lane's claim
        frontier (``FairShare.frontier``) are left out: claimed since that listing (a claim
        running would be in claims/; one no longer there completed, or was given back, which
        the next listing of the bucket shows)."""
        for bucket in self.buckets.get(path, []):
            entries = self.listed.get((path, bucket))
            if entries is None:
                break  # not listed: the lane has enough candidates before it
            hide = self._hiding((path, bucket))
            for e in entries:
                if e.job_id in self.claimed or (exclude and e.name in exclude):
                    continue
                if hide is not None and e.order <= hide:
                    continue
                yield e

    def confirm(
        self, first: list[tuple[str, EntryName]], along: Callable[[], None] | None = None
    ) -> bool:
        """Where this turn's claim frontiers hide entries, list (one round trip) the buckets
        of the lanes ``first`` (the candidates about to be claimed) come from, up to each
        one's bucket, that the last refresh did not list and whose listing a give-back may
        have made stale (``_reusable``): an entry given back behind its lane's frontier (or left
        there by a worker it did not fit) must go before the lane's later ones. True if it
        listed any (the candidates may have changed). ``along`` is called just before the
        listings are sent, so what it sends shares their round trip."""
        parts: set[Part] = set()
        for p, e in first:
            path = lane(p, e.tenant)
            if self._front(path) is not None:
                parts |= self._up_to(path, e.bucket)
        parts = {part for part in parts - self._fresh if not self._reusable(part)}
        if parts:
            if along is not None:
                along()  # sent ahead of the listings: in the same round trip
            self._read(parts)
        return bool(parts)

    def drop_behind_fronts(self) -> None:
        """Drop, from the buckets not listed in this turn, the entries at or before their
        lane's claim frontier (``_lane_entries`` would skip them in every walk of the
        candidates: other heads claimed them since, and most completed). One given back
        comes back with the bucket's next listing. The buckets listed in this turn before the
        frontiers were read are checked against them first (``_mark_behind``)."""
        if self.share is None:
            return
        for key in self._fresh:
            self._mark_behind(key)  # listed before the frontiers were known
        for key, entries in self.listed.items():
            front = self._hiding(key)
            if front is None or not entries or entries[0].order > front:
                continue
            self.listed[key] = entries[bisect_right(entries, front, key=_ORDER) :]  # in order

    def _mark_behind(self, key: tuple[str, int]) -> None:
        """Make a bucket listed in this turn not reusable if its listing holds an entry pending
        at or before its lane's frontier (given back before the listing: only a fresh listing
        shows it). Called once the turn's frontiers are known: for the listings made before,
        by ``drop_behind_fronts``; for those after, by ``_read``."""
        front = self._front(key[0])
        entries = self.listed.get(key)
        if front is None or not entries or entries[0].order > front:
            return
        behind = entries[: bisect_right(entries, front, key=_ORDER)]
        if any(e.job_id not in self.claimed for e in behind):
            self._given_at[key] = None

    def _front(self, path: str) -> tuple[int, int] | None:
        """The lane's claim frontier (``FairShare.frontier``), if known."""
        return self.share.front(path) if self.share is not None else None

    def _hiding(self, key: tuple[str, int]) -> tuple[int, int] | None:
        """The frontier at or before which a bucket's entries are hidden: its lane's, unless
        the bucket was listed in the last refresh (its listing is current)."""
        return None if key in self._fresh else self._front(key[0])

    def candidates(self, exclude: set[str]) -> Iterator[tuple[str, EntryName]]:
        """Unclaimed entries in dispatch order: priority rank (entries promoted by aging first
        in the band they reached, oldest first), then inside a priority its lanes by fair share
        (one lane: bucket and sequence)."""
        promoted = (
            []
            if self.promote_after is None
            else aging.promoted(
                self._firsts(exclude), self.ctimes, self.priorities, self.now, self.promote_after
            )
        )
        skip = {e.name for _, _, _, e in promoted}
        for rank, priority in enumerate(self.priorities):
            for _, _, p, e in sorted(x for x in promoted if x[0] == rank):
                yield p, e
            paths = self.lanes(priority)
            if len(paths) == 1 and not skip:
                yield from zip(repeat(priority), self._lane_entries(priority, exclude))
                continue
            streams = [
                (lane_parts(path)[1], self._lane_entries(path, exclude | skip)) for path in paths
            ]
            if self.share is None:
                for _, stream in streams:
                    for e in stream:
                        yield priority, e
                continue
            for e in self.share.merge(streams):
                yield priority, e

    def backlogged(self, priority: str, exclude: set[str]) -> frozenset[str]:
        """The tenants of ``priority`` with an unclaimed entry listed."""
        return frozenset(
            lane_parts(path)[1]
            for path in self.lanes(priority)
            if next(self._lane_entries(path, exclude), None) is not None
        )

    def _firsts(self, exclude: set[str]) -> list[tuple[str, EntryName | None]]:
        """Each lane's first unclaimed entry below the first priority, as far as listed (aging's
        candidates)."""
        lanes = [path for p in self.priorities[1:] for path in self.lanes(p)]
        return [(path, next(self._lane_entries(path, exclude), None)) for path in lanes]

    def unaged(self, exclude: set[str]) -> list[tuple[str, EntryName]]:
        """Lanes' first entries whose ctime aging needs (``zkqueue.dispatch.aging``)."""
        if self.promote_after is None:
            return []
        return aging.unaged(self._firsts(exclude), self.ctimes, self.priorities)

    def unwatch(self) -> None:
        """Stop watching (this worker leaves the head of the line): remove the bucket watches
        it set, so later arrivals and completions notify the new head only (the bucket names'
        watches stay: they fire once per ~1,000 jobs). What they covered is re-listed next
        time. The service counters are read again next time too: another head charges them
        meanwhile."""
        if self.share is not None:
            self.share.forget()
        self.watch_claims = False
        self._headed.clear()
        self._waiting = False  # a later refresh is no wake-up from this head's wait
        for part in [
            p for p in self.armed | self.signalled if not isinstance(p, str) or p == CLAIMS
        ]:
            watch = self._watches.get(part)
            if watch is not None:
                remove = remove_data_watch if part in self.signalled else remove_child_watch
                remove(self.zk, self._path(part), watch)
            self.invalidate(part)

    def drop(self, priority: str, entry: EntryName) -> None:
        """Forget an entry that is gone (its bucket's watch will confirm it)."""
        entries = self.listed.get((lane(priority, entry.tenant), entry.bucket), [])
        if entry in entries:
            entries.remove(entry)

    def arm_claims(self) -> None:
        """Watch claims/ from now on (set now: the turn's refresh already listed it)."""
        if not self.watch_claims:
            self.watch_claims = True
            self._read({CLAIMS}, {CLAIMS})

    def _read(
        self,
        parts: set[Part],
        arm: frozenset[Part] | set[Part] = frozenset(),
        signal: frozenset[Part] | set[Part] = frozenset(),
        peek: frozenset[Part] | set[Part] = frozenset(),
    ) -> None:
        """List ``parts`` (pipelined: one round trip), with a child watch on those in ``arm``
        and a data watch on those in ``signal``, set before their listing (an arrival after
        the watch fires it; one before is in the listing). Buckets in ``peek`` have their data
        read just before their listing: an arrival's entry may be in it (``arrived``)."""
        self.armed |= (arm | signal) & parts
        self.signalled |= signal & parts
        data = {
            part: self.zk.get_async(self._path(part), watch=self._watch(part))
            for part in signal & parts
        }
        # claims/ first (a session's requests are served in order): an entry whose claim it
        # does not show and which a later bucket listing still holds is pending, not a job
        # that completed in between (whose claim and entry both went).
        ordered = sorted(parts, key=lambda part: part != CLAIMS)
        calls = {}
        for part in ordered:
            if part in peek and part not in data:
                data[part] = self.zk.get_async(self._path(part))
            watch = self._watch(part) if part in arm else None
            # With the node's stat: its data version is what a claim's guard checks.
            listing = self.zk.get_children_async(self._path(part), watch, True)
            calls[part] = (listing, data.get(part) if part in peek else None)
        self.listings += len(calls)
        for part, (call, signalled) in calls.items():
            try:
                names, stat = call.get()
            except NoNodeError:  # and no watch was set: the next refresh lists it again
                names, stat = [], None
                self.armed.discard(part)
                self.signalled.discard(part)
            if stat is not None and part != CLAIMS:
                self.versions[self._path(part)] = stat.version
            elif stat is not None:
                self.given = stat.version  # listed first: before the buckets of this call
            if not isinstance(part, str):
                self._listed_at[part] = time.monotonic()
                # Only a turn that read the frontiers ahead checks its listings against them
                # (``_mark_behind``): another's are never reused.
                self._given_at[part] = self.given if self._ahead else None
                self._fresh.add(part)
            if part == CLAIMS:
                self.claimed = set(names)
            elif isinstance(part, str):
                self._store_buckets(part, names)
            elif part[1] in self.buckets.get(part[0], []):
                if signalled is None:
                    self._store(part, names)
                else:
                    self._store_signalled(part, (names, stat), signalled)
                self._mark_behind(part)  # once the turn's frontiers are known

    def _store_signalled(self, key: tuple[str, int], listing: Any, signalled: Any) -> None:
        """Store a bucket listed with its stat just after its data was read; keep its newest
        entry in ``arrived`` if the signal carries it (zkqueue.protocol.arrival) and it appeared
        since this head's last listing of the bucket (so, as a rule, no other head claimed it)."""
        names, stat = listing if listing else ([], None)
        seen = self._parsed.get(key, {}) if key in self._headed else None
        self._headed.add(key)
        self._store(key, names)
        if seen is None:
            return
        entries = self.listed.get(key)
        try:
            data, data_stat = signalled.get()
        except NoNodeError:
            return
        if entries and stat is not None:
            found = arrival.carried(entries[-1], seen, stat.pzxid, data, data_stat)
            if found is not None:
                self.arrived[(lane_parts(key[0])[0], entries[-1].name)] = found

    def _short(self) -> set[Part]:
        """Buckets to list next: per priority, the first unlisted ones while the listed ones
        hold fewer than WANT unclaimed entries. Empty buckets before the tail are deleted."""
        more: set[Part] = set()
        for priority in self.lanes():
            numbers = self.buckets.get(priority, [])
            # Counting matters only while one of the lane's buckets is unlisted.
            counting = any((priority, b) not in self.listed for b in numbers)
            have = 0
            for bucket in numbers:
                key = (priority, bucket)
                entries = self.listed.get(key)
                if entries is None:
                    more.add(key)
                    break
                if not entries and bucket != numbers[-1]:
                    self.zk.delete_async(self._path(key))  # NotEmpty, NoNode: not ours to do
                    self._forget(key)
                    # Out of the lane too: an unlisted bucket ends the lane's walk
                    # (``_lane_entries``), which would hide the buckets after it. Its bucket
                    # names are listed again after the delete: one an entry went into anyway
                    # (a raw producer's, created without the tail's check) comes back.
                    self.buckets[priority] = [b for b in self.buckets[priority] if b != bucket]
                    self._dirty.add(priority)
                    continue
                if not counting:
                    continue
                hide = self._hiding(key)
                if hide is not None:  # those after the frontier (the entries are in order)
                    entries = entries[bisect_right(entries, hide, key=_ORDER) :]
                # Each running job hides at most one: a count, not a walk, when that is enough.
                if have + len(entries) - len(self.claimed) >= WANT:
                    break
                have += sum(e.job_id not in self.claimed for e in entries)
                if have >= WANT:
                    break
        return more

    def _forget(self, key: tuple[str, int]) -> None:
        self.versions.pop(self._path(key), None)
        for book in (self._listed_at, self._given_at, self.listed, self._parsed, self._watches):
            book.pop(key, None)
        for marks in (self._headed, self.armed, self.signalled):
            marks.discard(key)

    def _store_buckets(self, priority: str, names: list[str]) -> None:
        """Store a lane's listing: its bucket numbers (and a priority's tenants)."""
        numbers, bad, tenants = [], [], []
        for name in names:
            number = parse_bucket(name)
            tenant = tenant_of_child(name) if "/" not in priority else None
            if tenant is not None:
                tenants.append(tenant)
            elif name.startswith(TENANT_MARK) and "/" not in priority:
                continue  # a lane no tenant may have (@default, a bad name): ignored
            elif number is None:
                bad.append(name)  # an entry created outside any bucket
            else:
                numbers.append(number)
        if "/" not in priority:
            before = set(self.tenants.get(priority, ()))
            new = set(tenants) - before
            for tenant in before - set(tenants):  # removed (the janitor: empty for long)
                self._drop_lane(lane(priority, tenant))
            self.tenants[priority] = sorted(tenants)
            paths = [lane(priority, t) for t in self.tenants[priority]]
            self._lane_paths[priority] = [priority, *paths]
            # A new tenant's lane: list it in this refresh (its first job is on its way).
            self._dirty |= {lane(priority, t) for t in new}
        numbers.sort()
        old = self.buckets.get(priority)
        if old and numbers and numbers[-1] > old[-1] and (priority, old[-1]) in self.listed:
            self._dirty.add((priority, old[-1]))  # no longer the tail: list it once more
        self.buckets[priority] = numbers
        inside = [m for m in self.malformed.get(priority, []) if "/" in m]
        self.malformed[priority] = bad + inside
        present = set(numbers)
        for key in [k for k in self.listed if k[0] == priority and k[1] not in present]:
            self._forget(key)

    def _drop_lane(self, path: str) -> None:
        """Forget a lane that is gone: its buckets, their listings and watches."""
        for key in [k for k in self.listed if k[0] == path]:
            self._forget(key)
        for book in (self.buckets, self.malformed, self._watches):
            book.pop(path, None)
        self.versions.pop(self._path(path), None)
        for marks in (self.armed, self.signalled, self._dirty):
            marks.discard(path)

    def _store(self, key: tuple[str, int], names: list[str]) -> None:
        priority, bucket = key
        old = self._parsed.get(key, {})
        parsed: dict[str, EntryName] = {}
        mark = lane_mark(priority)
        for leaf in names:
            entry = old.get(leaf)
            if entry is None:
                try:
                    entry = EntryName.parse_leaf(leaf, bucket, mark)
                except InvalidJob:
                    self.malformed.setdefault(priority, []).append(f"{bucket_name(bucket)}/{leaf}")
                    continue
            parsed[leaf] = entry
        self._parsed[key] = parsed
        self.listed[key] = sorted(parsed.values(), key=_ORDER)

    def _watch(self, part: Part) -> _Watch:
        watch = self._watches.get(part)
        if watch is None:
            watch = self._watches[part] = _Watch(part, self)
        return watch

    def _path(self, part: Part) -> str:
        if part == CLAIMS:
            return self.layout.claims(self.queue)
        if isinstance(part, str):
            return self.layout.pending(self.queue, part)
        return self.layout.bucket(self.queue, part[0], part[1])


_ORDER = attrgetter("order")
