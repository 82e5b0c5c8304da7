"""Fair share between tenants inside a priority: the order in which the head of the line takes
the entries of one priority's lanes (aging, which takes a lane's first entry a priority up, is in
``zkqueue.dispatch.aging``).

Strict priority between bands stays. Inside a band, the head takes next from the backlogged
tenant that has received the least weighted service: the *virtual token counter* of Sheng et al.
(OSDI 2024). A tenant's counter grows by each job's estimated tokens (prompt characters / 4 +
``max_new_tokens``: what the job may cost, known before it runs) divided by the tenant's weight
(queue settings, default 1). A backlogged tenant more than two jobs' cost below the highest
counter is lifted to that level, so idle time banks no credit. Jobs of one tenant keep their
order (its lane is first come, first served).

The counters live in ZooKeeper and survive worker restarts and a change of head. The queue's
``service`` node holds every tenant's ``{"service": V, "cost": C, "next": ...}`` (V in weighted
tokens, C the tenant's recent estimated cost per job, ``next`` its lanes' claim frontiers; the
format is ``zkqueue.protocol.counters``); ``service/corrections`` holds, per tenant, what its
jobs really cost less their estimates, weighted, which the workers that ran them add at their
heartbeat (``Corrections``). A tenant's level is the two together. The head reads the counters
in the first round trip of every turn where it chose between tenants last time (another head
may have charged them since), and writes them in each claim multi that chose between tenants
(no extra round trip). A claim from a band where one tenant alone waits charges its counter in
memory only: with nobody to share with, its level does not matter until another tenant joins,
who is lifted to it; in a queue with no tenant's lane at all, the head keeps only each job's
cost in the default tenant's average (``cost``), ready for when a tenant comes.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from zkqueue.protocol.counters import (
    CORRECTIONS,
    Counter,
    add_corrections,
    encode_counters,
    frontiers_by_tenant,
    parse_corrections,
    parse_counters,
)
from zkqueue.protocol.layout import EntryName, Layout
from zkqueue.protocol.nodes import data_of
from zkqueue.protocol.spec import JobSpec, estimate_tokens

log = logging.getLogger("zkq.share")

#: How many jobs' weighted cost a backlogged tenant's counter may lag the highest before it is
#: lifted (``FairShare.observe``).
SLACK = 2.0


def estimate(spec: JobSpec) -> int:
    """The tokens a job may cost, known before it runs: its prompt's (or its messages'
    contents') characters / 4 plus ``max_new_tokens`` (``estimate_tokens``, as the gateway's
    token rate limits take it)."""
    if spec.messages:
        text = "".join(str(m.get("content", "")) for m in spec.messages)
    else:
        text = spec.prompt or ""
    return estimate_tokens(text, spec.max_new_tokens)


@dataclass
class FairShare:
    """The head's copy of one queue's service counters."""

    zk: KazooClient
    layout: Layout
    queue: str
    #: A tenant's weight (the queue's settings).
    weight: Callable[[str], float] = lambda _tenant: 1.0
    #: Each tenant's level: its counter and its corrections (weighted tokens), as this head
    #: knows it (between turns, the last turn's: good enough to guess which lanes come first).
    service: dict[str, float] = field(default_factory=dict)
    #: The corrections part of each level, as read.
    corrected: dict[str, float] = field(default_factory=dict)
    #: Whether a counter changed since the counters were last written.
    unsaved: set[str] = field(default_factory=set)
    #: The tenants backlogged in each band at the last look.
    backlogged: dict[str, frozenset[str]] = field(default_factory=dict)
    #: A tenant's average estimated cost per job (tokens), from the jobs claimed, kept with its
    #: counter (the order of a turn's candidates charges each with it before their specs are
    #: read, and the lift's slack is counted in it).
    cost: dict[str, float] = field(default_factory=dict)
    #: Each lane's claim frontier, by lane path: the order (bucket, sequence) of the last entry
    #: claimed from it, as this turn's counters say (``next``), then as this head's claim sets
    #: it. While the counters read this turn (``front``), the view hides the entries at or
    #: before it in buckets it did not list this turn: other heads claimed them (and, for
    #: short jobs, completed them) since (``PendingView``).
    frontier: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        #: The reads of this turn, sent ahead (``refetch``): the counters, the corrections.
        self._read: Any = None
        self._fix: Any = None
        #: Whether this turn's counters were read (``load``).
        self._fresh = False
        #: When the corrections were last read (monotonic): they change at heartbeats only.
        self._fixed_at = 0.0

    def forget(self) -> None:
        """This worker stopped being head (or lost its session): read the counters again.
        ``backlogged`` stays: it only says whether the next turn's first round trip should
        carry the read (each turn sets it afresh before any choice rests on it), and a worker
        leaves the head after each claim that fills its slots. The corrections stay too: they
        change at workers' heartbeats and are read once a second, and a counter is written as
        the level less the corrections the same turn used, so an older copy shifts no count.
        ``frontier`` stays as a guess: it hides nothing until ``load`` reads it afresh, but
        says which lanes had a frontier when the next turn chooses what to list before the
        read is back (``PendingView._sources``)."""
        self.service.clear()
        self.unsaved.clear()
        self._read = self._fix = None
        self._fresh = False

    @property
    def reading(self) -> bool:
        """Whether this turn's read of the counters is in flight (``refetch`` sent it)."""
        return self._read is not None and not self._fresh

    def refetch(self) -> None:
        """Another head may have claimed since this one's last turn: send the read of the
        counters now, without waiting (it rides in the turn's first round trip; ``load``
        takes the answer), and of the corrections once a second."""
        self._fresh = False
        self.unsaved.clear()
        if not any(len(t) > 1 for t in self.backlogged.values()):
            self._read = self._fix = None  # no choice between tenants last time: read if needed
            return
        self._send()

    def _send(self) -> None:
        path = self.layout.service(self.queue)
        self._read = self.zk.get_async(path)
        if time.monotonic() - self._fixed_at > 1.0:
            self._fix = self.zk.get_async(f"{path}/{CORRECTIONS}")

    def load(self) -> None:
        """Take this turn's counters (reading them now if ``refetch`` did not)."""
        if self._fresh:
            return
        if self._read is None:
            self._send()
        read, fix, self._read, self._fix = self._read, self._fix, None, None
        data = data_of(read)
        if data is None:  # a queue made without it (by a producer of another language)
            with contextlib.suppress(NodeExistsError):
                self.zk.create(self.layout.service(self.queue), b"", makepath=True)
        if fix is not None:
            self._fixed_at = time.monotonic()
            self.corrected = parse_corrections(data_of(fix))
        self.service = {}
        self.frontier = {}
        for tenant, counter in parse_counters(data).items():
            self.service[tenant] = counter.service
            if counter.cost is not None and tenant not in self.cost:
                self.cost[tenant] = counter.cost
            self.frontier.update(counter.lanes(tenant))
        for tenant, fixed in self.corrected.items():
            self.service[tenant] = max(0.0, self.service.get(tenant, 0.0) + fixed)
        self._fresh = True

    def observe(self, priority: str, tenants: frozenset[str]) -> None:
        """The tenants backlogged in ``priority`` now. Any of them whose counter lies more than
        ``SLACK`` jobs' cost below the highest is lifted to that level: a tenant that kept
        waiting stays within a job or two of the others (the virtual token counter's bound),
        so only one that was idle (or is new) is that far behind, and it banks no credit for
        the time it waited for nothing. Stateless: a new head lifts by the same rule."""
        self.backlogged[priority] = tenants
        if len(tenants) < 2:
            return
        self.load()
        for tenant in tenants:
            self.service.setdefault(tenant, 0.0)
        known = [self.cost[t] / self.weight(t) for t in tenants if t in self.cost]
        if not known:
            return  # no job of theirs charged yet: nothing to measure the slack in
        top = max(self.service[t] for t in tenants)
        step = max(known)
        floor = top - SLACK * step
        for tenant in tenants:
            if self.service[tenant] < floor:
                self.service[tenant] = floor
                self.unsaved.add(tenant)

    def contended(self, priority: str) -> bool:
        """Whether the head chose between tenants in ``priority`` at the last look."""
        return len(self.backlogged.get(priority, ())) > 1

    def front(self, path: str) -> tuple[int, int] | None:
        """Lane ``path``'s claim frontier, if the counters were read this turn (a frontier
        from an earlier turn, or from this head's own claims alone, hides nothing: the lane
        may have been emptied and made again since, its sequence starting over)."""
        return self.frontier.get(path) if self._fresh else None

    def claimed(self, fronts: dict[str, tuple[int, int]]) -> None:
        """The last entry of each lane in ``fronts`` this turn claims (by lane path): the
        lanes' frontiers, for the counters' write (the last claimed, not the highest ever: a
        lane made again starts its sequence over)."""
        self.frontier.update(fronts)

    def charge(self, tenant: str, tokens: int) -> None:
        """A job of ``tenant`` was claimed: its estimated tokens, weighted."""
        self.service[tenant] = self.service.get(tenant, 0.0) + tokens / self.weight(tenant)
        self.unsaved.add(tenant)
        self.average(tenant, tokens)

    def average(self, tenant: str, tokens: int) -> None:
        """A job of ``tenant`` was claimed: its cost in the tenant's average (``cost``), also
        where nothing else is counted (a queue with no tenant's lane)."""
        old = self.cost.get(tenant)
        self.cost[tenant] = tokens if old is None else 0.8 * old + 0.2 * tokens

    def writes(self, tenants: Iterable[str]) -> list[tuple[str, bytes]]:
        """The write of the counters, for a claim multi, when one of ``tenants`` changed (all
        of them in one node: every tenant's counter as this turn read it, these charged);
        call ``saved`` once it committed."""
        if not self._fresh or not set(tenants) & self.unsaved:
            return []
        fronts = frontiers_by_tenant(self.frontier)
        counters = {
            t: Counter(v - self.corrected.get(t, 0.0), self.cost.get(t), fronts.get(t, {}))
            for t, v in self.service.items()
        }
        return [(self.layout.service(self.queue), encode_counters(counters))]

    def saved(self) -> None:
        self.unsaved.clear()

    def merge(self, lanes: list[tuple[str, Iterator[EntryName]]]) -> Iterator[EntryName]:
        """The entries of several tenants' lanes of one band, in fair-share order: each next
        from the tenant with the least virtual service, charged its average cost as it goes
        (a simulation: only ``charge`` changes the counters). Ties go to the lane listed first.
        A heap: each entry costs O(log lanes), however many tenants wait."""
        heap: list[tuple[float, int, str, EntryName]] = []
        steps: dict[str, float] = {}
        iters = dict(lanes)
        for index, (tenant, entries) in enumerate(lanes):
            first = next(entries, None)
            if first is not None:
                steps[tenant] = self.cost.get(tenant, 1.0) / self.weight(tenant)
                heap.append((self.service.get(tenant, 0.0), index, tenant, first))
        heapq.heapify(heap)
        while heap:
            level, index, tenant, entry = heap[0]
            yield entry
            following = next(iters[tenant], None)
            if following is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (level + steps[tenant], index, tenant, following))


class Corrections:
    """What the jobs a worker ran really cost (prompt and output tokens, as its runner counted
    them) less the estimates the head charged, weighted, per tenant; written at the worker's
    heartbeat (``flush``: one versioned update of ``service/corrections``)."""

    def __init__(self, zk: KazooClient, layout: Layout, queue: str) -> None:
        self.zk = zk
        self.layout = layout
        self.queue = queue
        self.pending: dict[str, float] = {}

    def add(self, tenant: str, spec: JobSpec, tokens: int | None, weight: float) -> None:
        """A job of ``tenant`` ended having used ``tokens`` (None: its runner did not count)."""
        if tokens is None:
            return
        delta = (tokens - estimate(spec)) / weight
        if delta:
            self.pending[tenant] = self.pending.get(tenant, 0.0) + delta

    def flush(self) -> None:
        """Add what accumulated to the corrections (a versioned update, retried on a
        concurrent one; what cannot be written now stays for the next flush)."""
        path = f"{self.layout.service(self.queue)}/{CORRECTIONS}"
        for _ in range(8):
            try:
                data, stat = self.zk.get(path)
            except NoNodeError:
                try:
                    self.zk.create(path, add_corrections(None, self.pending), makepath=True)
                except NodeExistsError:
                    continue
                break
            try:
                self.zk.set(path, add_corrections(data, self.pending), version=stat.version)
            except BadVersionError:
                continue
            break
        else:
            return
        self.pending.clear()
