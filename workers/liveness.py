"""Liveness: the ZooKeeper session's states, the leases of running jobs, and the registration.

- SUSPENDED: claim nothing until the connection is back. LOST: every claim is gone with the
  session, so every held job stops (no result may be written), and the worker registers and
  rejoins the line again. CONNECTED: re-read what the watches covered (they are hints).
- Leases: a running job's claim is rewritten (renewed) every third of the lease while the runner
  makes progress; a runner that makes none (hung) lets them lapse and the janitor hands its jobs
  to other workers. A renewal that finds its claim gone stops that job.
- The registration says the worker is alive by existing (it is ephemeral: it goes with the
  session). Every heartbeat the worker recomputes it (state, slots, running jobs, counts, cache)
  and rewrites it only when something changed, so an idle fleet writes nothing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from kazoo.protocol.states import KazooState

from workers.admission import Admission
from workers.metrics import WorkerMetrics
from workers.runners.base import CancelReason, RunningJob
from zkqueue.plumbing.connection import TRANSIENT
from zkqueue.protocol.claims import Claim, Claims
from zkqueue.protocol.registry import Registry, WorkerRecord

#: Seconds over which the registration's ``rate`` counts finished jobs.
RATE_WINDOW = 60.0

log = logging.getLogger("zkq.worker")


class Liveness:
    """Connection flags, lease renewal and heartbeats for one worker (loop thread only)."""

    def __init__(
        self,
        claims: Claims,
        registry: Registry,
        admission: Admission,
        metrics: WorkerMetrics,
        held: dict[str, RunningJob],
        *,
        lease: float,
        heartbeat_interval: float,
        runner_figures: Callable[[WorkerRecord], None] | None = None,
    ) -> None:
        """``runner_figures`` fills the record's runner figures before each heartbeat (a worker
        in front of an inference server: its gate and the server's figures)."""
        self.claims = claims
        self.registry = registry
        self.admission = admission
        self.metrics = metrics
        self.held = held
        self.lease = lease
        self.heartbeat_interval = heartbeat_interval
        self.runner_figures = runner_figures
        #: The connection is suspended (or a call just failed with it): claim nothing.
        self.suspended = False
        #: The session is gone until the next CONNECTED.
        self.lost = False
        #: A call failed with the connection, so what it wrote may exist unseen (the loop sweeps).
        self.unsure = False
        self.next_heartbeat = 0.0
        #: (monotonic seconds, jobs finished) at each heartbeat of the last RATE_WINDOW.
        self._finished: deque[tuple[float, int]] = deque()
        self.next_renewal = 0.0
        self._progress_mark: tuple[int, ...] = ()

    @property
    def paused(self) -> bool:
        return self.suspended or self.lost

    def trouble(self) -> None:
        """A ZooKeeper call failed with the connection."""
        self.suspended = True
        self.unsure = True

    def state_changed(self, state: KazooState, on_lost: Callable[[], None]) -> bool:
        """Apply a session state. Returns True when the worker must register again (a new
        session after a lost one)."""
        self.metrics.connection(str(state))
        if state == KazooState.SUSPENDED:
            log.warning("ZooKeeper connection suspended: not claiming until it is back")
            self.suspended = True
        elif state == KazooState.LOST:
            log.error("ZooKeeper session lost: dropping %d claim(s)", len(self.held))
            self.lost = True
            on_lost()
        elif state == KazooState.CONNECTED:
            self.suspended = False
            if self.lost:
                self.lost = False
                return True
        return False

    def maybe_renew(self, claimed: int, finishing: int) -> None:
        """Renew the leases of running jobs while the runner makes progress."""
        now = time.monotonic()
        if now < self.next_renewal:
            return
        self.next_renewal = now + self.lease / 3
        running = [j for j in self.held.values() if j.cancel_reason is None]
        mark = (claimed, finishing, sum(j.progress for j in self.held.values()))
        if not running or self.suspended or mark == self._progress_mark:
            if running:
                log.warning(
                    "no progress on %d running job(s) for %.0fs: not renewing leases",
                    len(running),
                    self.lease / 3,
                )
            return
        self._progress_mark = mark
        # A claim written less than a third of a lease ago (just claimed, or just published)
        # needs no renewal yet: the next round comes before its lease could lapse.
        due = [j for j in running if now - j.renewed_at >= self.lease / 3 - 0.5]
        if due:
            self.renew(due)

    def renew(self, jobs: list[RunningJob]) -> None:
        """Rewrite these jobs' claims (renewing their leases); stop the jobs whose claim is gone."""
        claims: list[Claim] = [j.claim for j in jobs if j.claim is not None]
        try:
            lost = self.claims.renew(claims)
        except TRANSIENT:
            self.suspended = True
            return
        now = time.monotonic()
        for job in jobs:
            job.renewed_at = now
        self.metrics.lease_renewed(len(claims) - len(lost))
        for claim in lost:
            log.warning("job %s: claim gone (lease reclaimed or session lost); stopping", claim.id)
            gone = self.held.get(claim.entry.name)
            if gone is not None:
                gone.cancel(CancelReason.LEASE)

    def maybe_heartbeat(self, state: str, stats: tuple[int, int, int], slots: int) -> bool:
        """Rewrite the registration when due; returns whether a heartbeat was due."""
        now = time.monotonic()
        if now < self.next_heartbeat:
            return False
        self.next_heartbeat = now + self.heartbeat_interval
        if self.suspended:
            return True
        record = self.registry.record
        record.state = state
        record.slots_busy = len(self.held)
        record.running = [j.id for j in self.held.values()]
        record.completed, record.failed, record.preempted = stats
        record.rate = self._rate(now, record.completed)
        record.memory = self.cache_figures()
        if self.runner_figures is not None:
            self.runner_figures(record)
        self.metrics.slots(len(self.held), slots)
        if self.admission.pages_total is not None:
            self.metrics.cache(self.admission.pages_total, self.admission.promised)
        try:
            self.registry.update_if_changed()
        except TRANSIENT:
            self.suspended = True
        return True

    def _rate(self, now: float, completed: int) -> float:
        """Jobs finished a second over the last RATE_WINDOW seconds (from heartbeats)."""
        samples = self._finished
        samples.append((now, completed))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW:
            samples.popleft()  # keep one sample at least RATE_WINDOW old as the base
        since, base = samples[0]
        return round((completed - base) / (now - since), 3) if now > since else 0.0

    def cache_figures(self) -> dict[str, int | None] | None:
        """The KV cache as the registration shows it (None without a cache)."""
        admission = self.admission
        if admission.pages_total is None:
            return None
        return {
            "pages_total": admission.pages_total,
            "pages_promised": admission.promised,
            "pages_in_use": admission.in_use(),
            "page_tokens": admission.page_tokens,
            "capacity_tokens": admission.capacity_tokens,
        }
