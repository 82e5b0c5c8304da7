"""Fair share between tenants inside a priority, and aging across priorities: the order in which
the head of the line takes the entries of one priority's lanes.

Strict priority between bands stays. Inside a band, the head takes next from the backlogged
tenant that has received the least weighted service: the *virtual token counter* of Sheng et al.
(OSDI 2024). A tenant's counter grows by each job's estimated tokens (prompt characters / 4 +
``max_new_tokens``: what the job may cost, known before it runs) divided by the tenant's weight
(queue settings, default 1). A tenant that becomes backlogged again is lifted to the level of
the tenants already backlogged (within two jobs' cost of the highest counter), so idle time banks
no credit. Jobs of one tenant
keep their order (its lane is first come, first served).

The counters live in ZooKeeper (``<queue>/service/<tenant>``, JSON ``{"service": V}``, V in
weighted tokens; ``<queue>/service/<tenant>/corrections``, ``{"service": D}``, what the jobs
really cost less their estimates, weighted, written by the workers that ran them a few times
a minute: ``Corrections``; a tenant's counter is V + D) and survive worker restarts and a
change of head: a head reads a tenant's counter
the first time it chooses between tenants, keeps it in memory (only the head claims, so only the
head charges), and writes the counters it changed into each claim multi that chose between
tenants (no extra round trip). A claim from a band where one tenant alone waits charges its
counter in memory only: with nobody to share with, its level does not matter until another
tenant joins, who is lifted to it.

Aging (``promote_after`` in the queue's settings): the first waiting entry of a lane that has
waited ``promote_after`` seconds is taken as if it were one priority up, two after twice that, and
so on; among those promoted into a band, the oldest first, ahead of the band's own entries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from zkqueue.protocol.layout import EntryName, Layout
from zkqueue.protocol.spec import JobSpec

log = logging.getLogger("zkq.share")

#: The child of a tenant's counter node that holds the workers' corrections.
CORRECTIONS = "corrections"
#: How many jobs' weighted cost a backlogged tenant's counter may lag the highest before it is
#: lifted (``FairShare.observe``).
SLACK = 2.0
#: Characters per prompt token in the estimate (the gateway's rate limits use the same rule).
CHARS_PER_TOKEN = 4


def estimate(spec: JobSpec) -> int:
    """The tokens a job may cost, known before it runs: its prompt's characters / 4 (or its
    messages') plus ``max_new_tokens``."""
    if spec.messages:
        chars = sum(len(str(m.get("content", ""))) for m in spec.messages)
    else:
        chars = len(spec.prompt or "")
    return math.ceil(chars / CHARS_PER_TOKEN) + spec.max_new_tokens


@dataclass
class FairShare:
    """The head's copy of one queue's service counters."""

    zk: KazooClient
    layout: Layout
    queue: str
    #: A tenant's weight (the queue's settings).
    weight: Callable[[str], float] = lambda _tenant: 1.0
    #: Virtual service per tenant (weighted tokens), as this head knows it.
    service: dict[str, float] = field(default_factory=dict)
    #: Tenants whose counter changed since it was last written.
    unsaved: set[str] = field(default_factory=set)
    #: The tenants backlogged in each band at the last look.
    backlogged: dict[str, frozenset[str]] = field(default_factory=dict)
    #: A tenant's average estimated cost per job (tokens), from the jobs claimed, kept with its
    #: counter (the order of a turn's candidates charges each with it before their specs are
    #: read, and the lift's slack is counted in it).
    cost: dict[str, float] = field(default_factory=dict)
    #: Tenants whose counter node exists.
    stored: set[str] = field(default_factory=set)
    #: Reads of counters sent ahead (``refetch``), by tenant: (counter, corrections).
    _reads: dict[str, Any] = field(default_factory=dict)
    #: The corrections part of each tenant's counter (in ``service``), as read.
    corrected: dict[str, float] = field(default_factory=dict)

    def forget(self) -> None:
        """This worker stopped being head (or lost its session): read the counters again."""
        self.service.clear()
        self.unsaved.clear()
        self.backlogged.clear()
        self.stored.clear()
        self._reads.clear()

    def refetch(self) -> None:
        """Another head may have claimed since this one's last turn: drop the counters and send
        the reads of those it chose between last time now, without waiting (they ride in the
        turn's first round trip; ``load`` takes their answers)."""
        contended = set().union(*(t for t in self.backlogged.values() if len(t) > 1))
        self.service.clear()
        self.unsaved.clear()
        self._reads = {t: self._read(t) for t in contended}

    def _read(self, tenant: str) -> tuple[Any, Any]:
        path = self.layout.tenant_service(self.queue, tenant)
        return self.zk.get_async(path), self.zk.get_async(f"{path}/{CORRECTIONS}")

    def load(self, tenants: Iterable[str]) -> None:
        """Read the counters of tenants this head has not read yet (pipelined, once each)."""
        missing = [t for t in tenants if t not in self.service]
        calls = [(t, self._reads.pop(t, None) or self._read(t)) for t in missing]
        for tenant, (call, corrections) in calls:
            try:
                data, _ = call.get()
            except NoNodeError:
                data = None
            else:
                self.stored.add(tenant)
            value, cost, _ = _read_counter(data)
            try:
                corrected = _read_counter(corrections.get()[0])[2]
            except NoNodeError:
                corrected = 0.0
            self.corrected[tenant] = corrected
            self.service[tenant] = max(0.0, value + corrected)
            if cost is not None and tenant not in self.cost:
                self.cost[tenant] = cost

    def looked(self) -> None:
        """The turn's looks are over: reads sent ahead and not used are stale from now on."""
        self._reads.clear()

    def observe(self, priority: str, tenants: frozenset[str]) -> None:
        """The tenants backlogged in ``priority`` now. Any of them whose counter lies more than
        ``SLACK`` jobs' cost below the highest is lifted to that level: a tenant that kept
        waiting stays within a job or two of the others (the virtual token counter's bound),
        so only one that was idle (or is new) is that far behind, and it banks no credit for
        the time it waited for nothing. Stateless: a new head lifts by the same rule."""
        self.backlogged[priority] = tenants
        if len(tenants) < 2:
            return
        self.load(tenants)
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

    def charge(self, tenant: str, tokens: int) -> None:
        """A job of ``tenant`` was claimed: its estimated tokens, weighted."""
        self.service[tenant] = self.service.get(tenant, 0.0) + tokens / self.weight(tenant)
        self.unsaved.add(tenant)
        old = self.cost.get(tenant)
        self.cost[tenant] = tokens if old is None else 0.8 * old + 0.2 * tokens

    def writes(self, tenants: Iterable[str]) -> list[tuple[str, bytes]]:
        """The (path, data) writes of the counters of ``tenants`` that changed, for a claim
        multi (their nodes are created first where missing; call ``saved`` once it committed)."""
        written = sorted(set(tenants) & self.unsaved)
        self.ensure_nodes(written)
        return [
            (
                self.layout.tenant_service(self.queue, t),
                json.dumps(
                    {
                        "service": round(self.service[t] - self.corrected.get(t, 0.0), 3),
                        "cost": round(self.cost.get(t, 0.0), 1),
                    }
                ).encode(),
            )
            for t in written
        ]

    def saved(self, tenants: Iterable[str]) -> None:
        self.unsaved.difference_update(tenants)

    def ensure_nodes(self, tenants: Iterable[str]) -> None:
        """Create the counter nodes of tenants that have none (once each, before a multi first
        writes them)."""
        for tenant in set(tenants) - self.stored:
            path = self.layout.tenant_service(self.queue, tenant)
            with contextlib.suppress(NodeExistsError):
                self.zk.create(path, json.dumps({"service": 0.0}).encode(), makepath=True)
            self.stored.add(tenant)

    def merge(self, lanes: list[tuple[str, Iterator[EntryName]]]) -> Iterator[EntryName]:
        """The entries of several tenants' lanes of one band, in fair-share order: each next
        from the tenant with the least virtual service, charged its average cost as it goes
        (a simulation: only ``charge`` changes the counters). Ties go to the lane listed first."""
        virtual = {t: self.service.get(t, 0.0) for t, _ in lanes}
        heads: dict[str, EntryName] = {}
        order = [t for t, _ in lanes]
        iters = dict(lanes)
        for tenant in order:
            first = next(iters[tenant], None)
            if first is not None:
                heads[tenant] = first
        while heads:
            tenant = min(heads, key=lambda t: (virtual[t], order.index(t)))
            yield heads[tenant]
            virtual[tenant] += self.cost.get(tenant, 1.0) / self.weight(tenant)
            following = next(iters[tenant], None)
            if following is None:
                del heads[tenant]
            else:
                heads[tenant] = following


def _read_counter(data: bytes | None) -> tuple[float, float | None, float]:
    """(service, cost per job or None, service as a signed number) from a counter node's
    data; 0 for anything unreadable."""
    try:
        raw = json.loads(data or b"{}")
        value = float(raw.get("service", 0.0))
        cost = raw.get("cost")
        cost = float(cost) if isinstance(cost, int | float) and cost > 0 else None
    except (ValueError, TypeError, AttributeError):
        return 0.0, None, 0.0
    if not math.isfinite(value):
        return 0.0, cost, 0.0
    return max(0.0, value), cost, value


class Corrections:
    """What the jobs a worker ran really cost (prompt and output tokens, as its runner counted
    them) less the estimates the head charged, weighted, per tenant; written a few times a minute
    (``flush``, one versioned update per tenant) into ``service/<tenant>/corrections``."""

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
        """Add what accumulated to each tenant's corrections (a versioned update, retried on a
        concurrent one; what cannot be written now stays for the next flush)."""
        for tenant, delta in list(self.pending.items()):
            path = f"{self.layout.tenant_service(self.queue, tenant)}/{CORRECTIONS}"
            for _ in range(8):
                try:
                    data, stat = self.zk.get(path)
                except NoNodeError:
                    try:
                        self.zk.create(path, _corrections(delta), makepath=True)
                    except NodeExistsError:
                        continue
                    break
                value = _read_counter(data)[2] + delta
                try:
                    self.zk.set(path, _corrections(value), version=stat.version)
                except BadVersionError:
                    continue
                break
            else:
                continue
            del self.pending[tenant]


def _corrections(value: float) -> bytes:
    return json.dumps({"service": round(value, 3)}).encode()
