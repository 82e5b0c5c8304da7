"""Preemption: a worker with no free slot hears of a more urgent job, gives back its newest job
of a lower priority and takes the urgent one, in one multi.

Only workers with a free slot stand in the queue's line, so when every slot of the fleet is busy
nobody would claim a high job before some job ends. Full workers that run a job a more urgent one
may displace stand in a *busy line* instead (``<queue>/busy/<floor>``, ``floor`` being the lowest
priority among the jobs they could give back), and, as in the line, each member watches only its
predecessor: only the head of a busy line watches the pending entries of the priorities above
its floor (``zkqueue.dispatch.view.PendingView`` over those priorities, through the tails' arrival
signal, so a completion wakes nobody). A high job sent into a full fleet therefore wakes one
busy head per floor at most.

A busy head leaves the urgent job to those better placed to take it: to the line's head when
the line has a member (it has a free slot), and to the head of a busy line of a lower floor
(that worker gives back a less urgent job). It lists those lines without watching them (a watch
would wake it whenever any worker frees a slot) and looks again at its next heartbeat.
Otherwise it runs a head turn (``workers.head.HeadTurn``) whose claim multi also gives its
victims back: each victim's entry gets its spec with the preemption counted (``preemptions``
+ 1, ``preempted_at``) and its claim goes. The job is pending again,
with no attempt counted against ``max_attempts``; its partial output is discarded; the old
claim's token can no longer complete it, so its caller gets exactly one result. If anything
changed meanwhile (the victim was cancelled, the urgent job taken), the multi fails whole and
nothing happened.

Victims: the jobs this worker runs whose priority is below the urgent job's, the lowest
priority first and among them the newest (the least work lost). Never a job whose caller
already reads its output (a stream with some output), nor one preempted less than
``protect`` seconds ago; at most ``per_minute`` preemptions a minute per worker. So preemption
cannot thrash: a low job under a steady stream of high ones still advances between them.

A worker narrowed for a high job (``Worker._room``: while it runs one, it holds lower jobs only
up to its ``high_width``) has free slots for high jobs alone. It stands in no line then, but in
a busy line (its victims' floor, else ``normal``, whose view is the high priority alone), and as
its head fills those slots with high jobs before it gives anything back (``_Swap.room``), with
preemption off too. Taking a free slot loses no work, so it defers only to a worker of the line,
not to a busy line of a lower floor.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from workers.admission import Admission
from workers.events import Event
from workers.head import HeadTurn
from workers.metrics import WorkerMetrics
from workers.runners.base import CancelReason, RunningJob
from zkqueue import defaults
from zkqueue.defaults import Priority
from zkqueue.dispatch.line import Line
from zkqueue.dispatch.view import PendingView
from zkqueue.errors import SpecTooLarge
from zkqueue.plumbing.logs import job_context
from zkqueue.protocol.claims import Candidate, Claim, Claims
from zkqueue.protocol.layout import PREEMPTIBLE, Layout, is_line_member

log = logging.getLogger("zkq.worker")

_RANK = {p: i for i, p in enumerate(defaults.PRIORITIES)}


@dataclass(frozen=True)
class PreemptionPolicy:
    """When a worker may give a job back for a more urgent one."""

    enabled: bool = defaults.PREEMPT
    #: Seconds after a preemption during which the same job is not preempted again.
    protect: float = defaults.PREEMPT_PROTECT
    #: Preemptions one worker makes in any 60 seconds at most.
    per_minute: int = defaults.PREEMPT_PER_MINUTE


@dataclass
class _Swap:
    """The pairing of one turn: candidates in dispatch order with victims, lowest first, or
    with a slot a narrowed worker keeps for high-priority jobs (``room``: no victim)."""

    victims: list[RunningJob]
    now: float
    room: int = 0
    credit: int = 0
    #: Each candidate taken, with the job it displaces (None: it took a free slot).
    chosen: list[tuple[Candidate, RunningJob | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The victims' pages count as free when judging only without room: a candidate that
        # takes a free slot gives nothing back, and judged with that credit it could be
        # promised pages the cache does not have.
        self.credit = 0 if self.room > 0 else sum(v.pages for v in self.victims)

    def pair(self, picked: list[Candidate]) -> tuple[list[Candidate], list[tuple[Claim, bytes]]]:
        left = list(self.victims)
        room = self.room
        self.chosen = []
        for cand in picked:
            if room > 0 and cand.priority == Priority.HIGH:
                room -= 1  # a free slot loses no work: before any victim
                self.chosen.append((cand, None))
                continue
            victim = next((v for v in left if _RANK[v.priority] > _RANK[cand.priority]), None)
            if victim is None:
                continue
            left.remove(victim)
            self.chosen.append((cand, victim))
        give_back = []
        for _, victim in self.chosen:
            if victim is not None:
                assert victim.claim is not None and victim.given_back is not None
                give_back.append((victim.claim, victim.given_back))
        return [c for c, _ in self.chosen], give_back


class Preemption:
    """A full worker's place in a busy line and its preemption turns. Owned by the worker
    loop's thread; watches only post events (``post``)."""

    def __init__(
        self,
        zk: KazooClient,
        layout: Layout,
        queue: str,
        worker_id: str,
        claims: Claims,
        admission: Admission,
        metrics: WorkerMetrics,
        max_attempts: int,
        policy: PreemptionPolicy,
        post: Callable[..., None],
    ) -> None:
        """``post(Event.BUSY)`` and ``post(Event.URGENT, part)`` reach the worker loop, which
        calls ``line_changed`` and ``view_changed(part)``."""
        self.zk = zk
        self.layout = layout
        self.queue = queue
        self.worker_id = worker_id
        self.policy = policy
        self.metrics = metrics
        self._post = post
        self._turns: dict[str, HeadTurn] = {}
        for floor in PREEMPTIBLE:
            line = Line(
                zk,
                layout.busy_line(queue, floor),
                worker_id,
                lambda: post(Event.BUSY),
                functools.partial(self._make_line, floor),
            )
            above = defaults.PRIORITIES[: _RANK[floor]]
            view = PendingView(
                zk, layout, queue, lambda part: post(Event.URGENT, part), priorities=above
            )
            self._turns[floor] = HeadTurn(
                zk, claims, view, line, admission, metrics, layout, queue, max_attempts
            )
        #: The floor of the busy line this worker stands in (None: none).
        self.floor: str | None = None
        #: When this worker's recent preemptions happened (monotonic seconds).
        self._recent: deque[float] = deque()
        self.preempted = 0

    @property
    def capped(self) -> bool:
        """Whether this worker's last busy turn was held back by the queue's max_running (it
        then watches claims/: a job ending anywhere frees room under the cap)."""
        return self.floor is not None and self._turns[self.floor].capped

    @property
    def lines(self) -> list[Line]:
        return [turn.line for turn in self._turns.values()]

    def turn(self, held: dict[str, RunningJob], room: int = 0) -> list[tuple[Claim, int]]:
        """One step of a full worker: stand in the right busy line (or leave it) and, at its
        head, preempt for what waits above its floor. ``room``: slots this worker keeps free
        for high-priority jobs alone (it is narrowed: ``Worker._room``), which it fills before
        it gives anything back, with preemption off too. Returns what was claimed (to hand
        in)."""
        if not self.policy.enabled and room <= 0:
            self.leave()  # in a busy line only for its room, which is gone
            return []
        now = time.monotonic()
        while self._recent and now - self._recent[0] > 60.0:
            self._recent.popleft()
        allowed = self.policy.per_minute - len(self._recent)
        victims = self._victims(held)[: max(0, allowed)] if self.policy.enabled else []
        # The floor's view watches the priorities above it: with room alone, the high one.
        floor = victims[0].priority if victims else PREEMPTIBLE[0] if room > 0 else None
        if floor != self.floor:
            self.leave()
        if floor is None:
            return []
        turn = self._turns[floor]
        if not turn.line.joined:
            turn.line.join()
            self.floor = floor
        if turn.line.known is False:
            turn.drop_watches()
            return []  # waiting for the predecessor to leave
        if self._others_first(floor, taking_room=room > 0):
            return []
        swap = _Swap(victims, time.time(), room)
        claimed = turn.turn(len(victims) + room, set(held), rejoin_if_room=True, swap=swap)
        if claimed is None:
            self._post(Event.WAKE)  # lost a race: look again
            return []
        if claimed:
            self._gave_back(swap, now)
        return claimed

    def _victims(self, held: dict[str, RunningJob]) -> list[RunningJob]:
        """Jobs this worker may give back, the lowest priority first, then the newest; each
        with the spec its entry gets (``given_back``)."""
        wall = time.time()
        found = []
        for job in held.values():
            spec = job.spec
            if (
                job.claim is None
                or job.cancel_reason is not None
                or job.priority not in PREEMPTIBLE
                or (spec.stream and (job.partial_ids or job.partial))  # its caller reads it
                or (
                    spec.preempted_at is not None and wall - spec.preempted_at < self.policy.protect
                )
            ):
                continue
            try:
                job.given_back = spec.preempted(wall).to_bytes()
            except SpecTooLarge:  # at the size limit already: it runs to its end
                continue
            found.append(job)
        found.sort(key=_newest_lowest, reverse=True)
        return found

    def _others_first(self, floor: str, taking_room: bool = False) -> bool:
        """Whether a worker better placed to take an urgent job exists: a member of the line
        (a free slot) or, unless this one has ``room`` for it too, of a busy line of a lower
        floor. Listed, not watched: a watch on the line would wake this worker whenever any
        worker frees or fills a slot. Should they leave an urgent job behind (a line's head
        with fewer free slots than urgent jobs), this worker finds it at its next heartbeat
        (``recheck``)."""
        lower = [] if taking_room else PREEMPTIBLE[PREEMPTIBLE.index(floor) + 1 :]
        paths = [self.layout.line(self.queue)]
        paths += [self.layout.busy_line(self.queue, f) for f in lower]
        calls = [self.zk.get_children_async(path) for path in paths]
        for call in calls:
            try:
                if any(is_line_member(n) for n in call.get()):
                    return True
            except NoNodeError:
                continue
        return False

    def _gave_back(self, swap: _Swap, now: float) -> None:
        for cand, victim in swap.chosen:
            if victim is None:
                continue  # a free slot
            self._recent.append(now)
            self.preempted += 1
            victim.cancel(CancelReason.PREEMPTED)
            self.metrics.preempted(victim.queue, victim.priority)
            context = job_context(victim.id, victim.queue, victim.priority, self.worker_id)
            log.info(
                "preempted for %s job %s: pending again (preempted %d time(s))",
                cand.priority,
                cand.entry.job_id,
                victim.spec.preemptions + 1,
                extra=context,
            )

    def leave(self) -> None:
        """Out of the busy line (a free slot, nothing to give back, draining)."""
        if self.floor is None:
            return
        turn = self._turns[self.floor]
        self.floor = None
        turn.drop_watches_soon()
        turn.drop_watches()
        turn.line.leave()

    def forget(self) -> None:
        """The session is gone, and every place and watch with it."""
        for turn in self._turns.values():
            turn.line.forget()
            turn.view.forget_watches()
        self.floor = None

    def line_changed(self) -> None:
        """A busy line's predecessor left, or a line ahead changed: ask again."""
        for turn in self._turns.values():
            turn.line.invalidate()

    def view_changed(self, part: object) -> None:
        """A watched part of the busy head's view changed: re-read it."""
        if self.floor is not None:
            self._turns[self.floor].view.invalidate(part)

    def recheck(self) -> None:
        """At a heartbeat: a busy head asks again whether it is head, and re-lists the tails
        it watches through their data (entries created without the arrival signal)."""
        if self.floor is not None:
            turn = self._turns[self.floor]
            if turn.line.recheck():
                turn.view.poll()
                self._post(Event.WAKE)

    def _make_line(self, floor: str) -> None:
        """A queue made by an older zkq has no busy lines yet: make the one joined."""
        self.zk.ensure_path(self.layout.busy_line(self.queue, floor))


def _newest_lowest(job: RunningJob) -> tuple[int, float, tuple[int, int]]:
    """Victims sort by this, largest first: the lowest priority, then the latest claim, then
    the latest entry (jobs claimed in one multi share their claim time)."""
    assert job.claim is not None
    return _RANK[job.priority], job.claimed_at, job.claim.entry.order
