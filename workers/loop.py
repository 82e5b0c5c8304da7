"""The worker loop: stand in the line, claim what fits when at its head, run batches off the
ZooKeeper threads, complete them fenced by their tokens, and survive connection trouble.

All ZooKeeper state is touched from the loop's thread only. Watches and the connection listener
run on kazoo's thread; they just post events. Runners run on an executor thread per batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_mod
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
)
from kazoo.protocol.states import EventType, KazooState, WatchedEvent

from workers.admission import Admission, Verdict
from workers.kvcache import format_size
from workers.memory import MemoryProbe
from workers.runners.base import Outcome, OutOfMemory, Runner, RunningJob
from zkqueue import defaults
from zkqueue import result as results
from zkqueue.claims import Candidate, Claim, Claims
from zkqueue.connection import TRANSIENT
from zkqueue.errors import InvalidJob
from zkqueue.layout import EntryName, Layout, check_queue
from zkqueue.line import Line
from zkqueue.logs import job_context
from zkqueue.metrics import WorkerMetrics
from zkqueue.registry import Registry, WorkerRecord, read_records
from zkqueue.result import Result
from zkqueue.spec import JobSpec
from zkqueue.view import PendingView

log = logging.getLogger("zkq.worker")

NEW, RUNNING, DRAINING, STOPPED = "new", "running", "draining", "stopped"
#: Entries the head reads in one turn at most: keeps the serial part of dispatch short.
_SCAN_LIMIT = 64
#: After a drain times out, how long released jobs get to stop before the worker exits anyway.
_RELEASE_GRACE = 5.0
#: After an out-of-memory, full batches that must fit before the batch limit doubles again.
_GROW_AFTER = 16
#: A claim lost before completion, by cancel reason, as the claims-lost metric names it.
_LOST_REASON = {"fenced": "fenced", "lost": "session", "lease": "lease"}


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


@dataclass
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    failed: int = 0
    fenced: int = 0
    released: int = 0
    dead_lettered: int = 0
    rejected: int = 0
    out_of_memory: int = 0
    #: Watch notifications this worker's session received (line, view, running entries).
    watch_events: int = 0


@dataclass
class _Held:
    claim: Claim
    job: RunningJob
    #: Partial output last written to the claim (streaming jobs).
    published: str = ""
    #: Whether the watch on its entry is set (connection trouble can prevent it; see _sweep).
    watched: bool = False


@dataclass
class _Batch:
    held: list[_Held]
    need: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    out_of_memory: bool = False


class Worker:
    """One worker process's loop on one queue. Constructor keywords are the configuration."""

    def __init__(
        self,
        zk: KazooClient,
        runner: Runner,
        *,
        queue: str = defaults.QUEUE,
        root: str = defaults.ROOT,
        slots: int = defaults.WORKER_SLOTS,
        name: str | None = None,
        max_jobs: int | None = None,
        burst: bool = False,
        drain_timeout: float = defaults.DRAIN_TIMEOUT,
        heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL,
        lease: float = defaults.LEASE,
        max_attempts: int = defaults.MAX_ATTEMPTS,
        admission: Admission | None = None,
        max_batch: int | None = None,
        memory: MemoryProbe | None = None,
        metrics: WorkerMetrics | None = None,
        on_heartbeat: Callable[[Worker], None] | None = None,
    ) -> None:
        self.zk = zk
        self.runner = runner
        self.queue = check_queue(queue)
        self.layout = Layout(root)
        self.slots = slots
        self.id = name or default_worker_id()
        self.max_jobs = max_jobs
        self.burst = burst
        self.drain_timeout = drain_timeout
        self.heartbeat_interval = heartbeat_interval
        self.max_attempts = max_attempts
        self.admission = admission or Admission()
        self.max_batch = max_batch or slots
        self._full_batch = self.max_batch
        self._fitting_batches = 0
        self.memory = memory
        #: Prometheus metrics (served by the daemon's --metrics-port).
        self.metrics = metrics or WorkerMetrics()
        self.on_heartbeat = on_heartbeat
        self.state = NEW
        self.stats = WorkerStats()
        self.ready = threading.Event()
        self.line = Line(zk, self.layout.line(self.queue), self.id, lambda: self._post("line"))
        self.view = PendingView(zk, self.layout, self.queue, lambda p: self._post("pending", p))
        self.lease = lease
        self.claims = Claims(zk, self.layout, self.queue, self.id, lease=lease)
        self.registry = Registry(
            zk,
            self.layout,
            WorkerRecord(
                id=self.id,
                queue=self.queue,
                runner=runner.name,
                slots_max=slots,
                runner_info=runner.describe(),
            ),
        )
        self._events: queue_mod.Queue[tuple[Any, ...]] = queue_mod.Queue()
        self._held: dict[str, _Held] = {}
        self._to_complete: deque[tuple[_Held, Outcome]] = deque()
        self._executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="zkq-run")
        self._suspended = False
        self._lost = False
        #: A call failed with the connection, so what it wrote may exist unseen (see _sweep).
        self._unsure = False
        self._drain_deadline: float | None = None
        self._release_deadline: float | None = None
        self._next_heartbeat = 0.0
        self._next_renewal = 0.0
        self._next_publish = float("inf")
        self._progress_mark: tuple[int, ...] = ()
        self._queue_empty = False

    # -- public ------------------------------------------------------------------------------

    @property
    def zk_session_timeout(self) -> float:
        """Seconds a crashed predecessor's ephemeral nodes may linger."""
        return float(getattr(self.zk, "_session_timeout", 10000)) / 1000 + 1

    @property
    def busy(self) -> int:
        return len(self._held)

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Run until stopped (stop(), max_jobs, burst). Safe to call on any thread; ``on_ready``
        is called once the worker is registered and in the line."""
        self.start()
        self.ready.set()
        if on_ready is not None:
            on_ready()
        try:
            while self._step():
                pass
        finally:
            self._shutdown()

    def start(self) -> None:
        for path in self.layout.queue_dirs(self.queue):
            with contextlib.suppress(NodeExistsError):
                self.zk.create(path, makepath=True)
        self.zk.add_listener(self._on_state)
        self.metrics.connection("CONNECTED")
        self.registry.record.memory = self._memory_figures()
        self.registry.register(wait=self.zk_session_timeout)
        self.state = RUNNING
        self.registry.record.state = RUNNING
        self._post("wake")

    def stop(self, drain: bool = True) -> None:
        """Ask the loop to stop (thread safe). With drain, running jobs get drain_timeout to
        finish; without, or on a second call, they are released at once."""
        self._post("stop", drain)

    # -- the loop ----------------------------------------------------------------------------

    def _post(self, *event: Any) -> None:
        if event[0] in ("line", "pending", "entry"):
            self.stats.watch_events += 1
        self._events.put(event)

    def _step(self) -> bool:
        # Events touch ZooKeeper too (a finished batch completes its jobs, a lost session
        # registers again): trouble there must suspend the loop like trouble in dispatch, never
        # end it. What failed is retried after the reconnect (completions stay queued).
        try:
            self._retry_completions()
            self._dispatch()
            self._wait_events()
        except TRANSIENT as exc:
            log.warning("ZooKeeper trouble, waiting for the connection: %s", type(exc).__name__)
            self._suspended = True
            self._unsure = True
        self._maybe_heartbeat()
        self._maybe_renew()
        self._maybe_publish()
        return not self._should_exit()

    def _wait_events(self) -> None:
        wake_at = min(self._next_heartbeat, self._next_renewal, self._next_publish)
        timeout = max(0.0, wake_at - time.monotonic())
        if self._drain_deadline is not None:
            timeout = min(timeout, max(0.0, self._drain_deadline - time.monotonic()))
        try:
            event = self._events.get(timeout=timeout)
        except queue_mod.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self._events.get_nowait()
            except queue_mod.Empty:
                return

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "line":
            self.line.invalidate()
        elif kind == "pending":
            self.view.invalidate(event[1])
            self._queue_empty = False
        elif kind == "entry":
            self._entry_changed(event[1], event[2], event[3])
        elif kind == "done":
            self._batch_done(event[1])
        elif kind == "state":
            self._state_changed(event[1])
        elif kind == "stop":
            self._begin_stop(event[1])
        elif kind == "rejoin":
            self.registry.register(wait=self.zk_session_timeout)

    def _should_exit(self) -> bool:
        if self.state == STOPPED:
            return True
        idle = not self._held and not self._to_complete
        if self.state == DRAINING:
            self._check_drain_deadline()
            return idle or (
                self._release_deadline is not None and time.monotonic() > self._release_deadline
            )
        if self.max_jobs is not None and self.stats.claimed >= self.max_jobs and idle:
            return True
        return self.burst and self._queue_empty and idle

    # -- dispatch ----------------------------------------------------------------------------

    def _free_slots(self) -> int:
        free = self.slots - self.busy - len(self._to_complete)
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        return free

    def _dispatch(self) -> None:
        if self._suspended or self._lost:
            return
        if self._unsure:
            self._sweep()
        if self.state != RUNNING:
            return
        free = self._free_slots()
        if free <= 0:
            return
        if not self.line.joined:
            self.line.join()
        if not self.line.is_head():
            return
        self.view.refresh()
        self._letter_malformed()
        picked = self._pick(free)
        if not picked:
            self._queue_empty = True
            return
        rejoin = free - len(picked) > 0
        claimed = self.claims.claim(picked, self.line, rejoin=rejoin)
        if claimed is None:
            self.view.invalidate()
            self._post("wake")  # lost a race: re-read and try again
            return
        # Claimed entries stay pending until completed; mark them claimed, never forget them:
        # a release or crash makes them claimable again and only the claims watch will say so.
        self.view.claimed.update(c.entry.name for c in picked)
        for c in picked:
            self.metrics.estimated_need(self.queue, c.need)
        self._start(claimed, sum(c.need for c in picked))

    def _sweep(self) -> None:
        """A call failed with the connection: what it wrote may have committed unseen. Remove
        this session's claims and line places the loop does not know about, and set the entry
        watches that could not be set."""
        stray = self.claims.sweep(self.line, set(self._held))
        self._watch_entries([h for h in self._held.values() if not h.watched])
        self._unsure = False
        if stray:
            log.warning("removed %d node(s) left by replies lost with the connection", len(stray))
            self.line.invalidate()
            self.view.invalidate()

    def _pick(self, free: int) -> list[Candidate]:
        picked: list[Candidate] = []
        picked_specs: list[JobSpec] = []
        exclude = set(self._held)
        ordered = list(islice(self.view.candidates(exclude), _SCAN_LIMIT))
        want = min(free, self.max_batch)
        start = 0
        while start < len(ordered):
            # Read only as many entries as could be claimed; more only when some are refused.
            chunk = want if start == 0 else max(want, 4)
            part = ordered[start : start + chunk]
            start += chunk
            calls = [self.zk.get_async(self.claims.entry_path(p, e)) for p, e in part]
            for (priority, entry), call in zip(part, calls, strict=True):
                try:
                    data, stat = call.get()
                except NoNodeError:
                    self.view.drop(priority, entry)
                    continue
                cand = self._judge(priority, entry, data, stat, picked_specs)
                if cand is not None:
                    picked.append(cand)
                    picked_specs.append(cand.spec)
                    if len(picked) >= want:
                        return picked
        return picked

    def _judge(
        self, priority: str, entry: EntryName, data: bytes, stat: Any, picked: list[JobSpec]
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
        if stat.version >= self.max_attempts:
            reason = (
                f"claimed {stat.version} times without finishing "
                f"(max_attempts={self.max_attempts}): a poison job or crashing workers"
            )
            self._letter(priority, entry.name, data, stat, reason, entry.job_id)
            return None
        if spec.queue_timeout is not None and time.time() - stat.ctime / 1000 > spec.queue_timeout:
            self._end_unclaimed(
                priority,
                entry,
                stat,
                results.EXPIRED,
                f"not started within queue_timeout of {spec.queue_timeout:g}s",
            )
            return None
        decision = self.admission.judge(spec, picked)
        if decision.verdict == Verdict.ADMIT:
            return Candidate(priority, entry, data, stat, spec, decision.need)
        if decision.verdict == Verdict.REJECT:
            self._reject(priority, entry, stat, decision.reason)
        elif decision.verdict == Verdict.NEVER:
            self._never_here(priority, entry, stat, decision.need, decision.reason)
        return None

    def _reject(self, priority: str, entry: EntryName, stat: Any, reason: str) -> None:
        self._end_unclaimed(priority, entry, stat, results.REJECTED, reason)
        self.stats.rejected += 1

    def _never_here(
        self, priority: str, entry: EntryName, stat: Any, need: int, reason: str
    ) -> None:
        """Too big for this worker: reject it if no registered worker of the queue could ever
        hold it, else leave it for a bigger one."""
        largest = self._largest_capacity()
        if largest is None or need <= largest:
            log.info("job %s left for a bigger worker: %s", entry.job_id, reason)
            return
        self._reject(
            priority,
            entry,
            stat,
            f"needs {format_size(need)} ({need} bytes) of device memory; the largest "
            f"worker of queue {self.queue!r} can hold {format_size(largest)} ({largest} bytes)",
        )

    def _largest_capacity(self) -> int | None:
        capacities = []
        for record in read_records(self.zk, self.layout):
            memory = record.get("memory") or {}
            if record.get("queue") == self.queue and memory.get("capacity") is not None:
                capacities.append(int(memory["capacity"]))
        return max(capacities) if capacities else None

    def _letter(
        self, priority: str, name: str, data: bytes, stat: Any, reason: str, job_id: str | None
    ) -> None:
        if self.claims.dead_letter(priority, name, data, stat, reason, job_id):
            self.stats.dead_lettered += 1
            self.metrics.job_finished(self.queue, priority, results.DEAD, None, None, None)

    def _letter_malformed(self) -> None:
        for priority, names in self.view.malformed.items():
            for name in names:
                try:
                    data, stat = self.zk.get(self.layout.entry(self.queue, priority, name))
                except NoNodeError:
                    continue
                self._letter(
                    priority, name, data, stat, f"entry name {name!r} is not <id>-<sequence>", None
                )
            names.clear()

    def _end_unclaimed(
        self, priority: str, entry: EntryName, stat: Any, status: str, error: str
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

    # -- running -----------------------------------------------------------------------------

    def _start(self, claimed: list[Claim], need: int) -> None:
        self.stats.claimed += len(claimed)
        if any(c.spec.stream for c in claimed):
            self._next_publish = min(
                self._next_publish, time.monotonic() + defaults.STREAM_INTERVAL
            )
        held = [
            _Held(
                c,
                RunningJob(
                    id=c.id,
                    spec=c.spec,
                    priority=c.priority,
                    queue=self.queue,
                    attempts=c.token,
                    claimed_at=c.claimed_at,
                ),
            )
            for c in claimed
        ]
        for h in held:
            self._held[h.claim.entry.name] = h
        for start in range(0, len(held), self.max_batch):
            part = held[start : start + self.max_batch]
            batch = _Batch(part, need * len(part) // len(held))
            if self.memory is not None:
                self.memory.reserve(batch.need)
            self.metrics.batch(self.queue, len(part))
            self._executor.submit(self._execute, batch)
        for h in held:
            log.info("claimed (attempt %d)", h.claim.token, extra=self._context(h))
        # Watch after the jobs are running: connection trouble here must not leave claimed jobs
        # that never run (the sweep after the reconnect sets the watches that are missing).
        self._watch_entries(held)

    def _watch_entries(self, held: list[_Held]) -> None:
        """Watch each running job's entry (cancel, withdrawal, reclaim), pipelined."""
        calls = [
            (
                h,
                self.zk.exists_async(
                    self.claims.entry_path(h.claim.priority, h.claim.entry),
                    watch=self._entry_watch(h),
                ),
            )
            for h in held
        ]
        for h, call in calls:
            stat = call.get()
            h.watched = True
            if stat is None:
                h.job.cancel("cancelled")
            elif stat.version != h.claim.token:
                h.job.cancel("fenced")

    def _entry_watch(self, held: _Held) -> Callable[[WatchedEvent], None]:
        name = held.claim.entry.name

        def watch(event: WatchedEvent) -> None:
            self._post("entry", name, event.type, held)

        return watch

    def _execute(self, batch: _Batch) -> None:
        jobs = [h.job for h in batch.held]
        try:
            outcomes = self.runner.run(jobs)
        except OutOfMemory as exc:
            # Keep what finished; release the rest for a retry in smaller batches.
            batch.out_of_memory = True
            outcomes = []
            for job, done in zip(jobs, exc.outcomes, strict=True):
                if done is None:
                    job.cancel("released")
                outcomes.append(done or Outcome(results.FAILED, error=f"out of memory: {exc}"))
        except Exception as exc:  # a runner bug must fail its jobs, never kill the worker
            log.exception("runner failed a batch of %d", len(jobs))
            outcomes = [Outcome(results.FAILED, error=f"runner error: {exc!r}") for _ in jobs]
        batch.outcomes = outcomes
        self._post("done", batch)

    def _entry_changed(self, name: str, event_type: str, watched: _Held) -> None:
        held = self._held.get(name)
        if held is not watched:
            return  # a watch from an earlier claim of this entry (our own re-claim fired it)
        if event_type == EventType.DELETED:
            held.job.cancel("cancelled")
        elif event_type == EventType.CHANGED:
            held.job.cancel("fenced")

    def _batch_done(self, batch: _Batch) -> None:
        if self.memory is not None:
            self.memory.release(batch.need)
        if batch.out_of_memory:
            self.stats.out_of_memory += 1
            self.max_batch = max(1, len(batch.held) // 2)
            self._fitting_batches = 0
            log.error(
                "out of memory in a batch of %d: released the unfinished jobs; batches are now "
                "at most %d",
                len(batch.held),
                self.max_batch,
            )
        elif self.max_batch < self._full_batch and len(batch.held) == self.max_batch:
            # Grow back only after a run of full batches that fit, so a batch size that does
            # not fit is not retried (and its jobs' attempts spent) over and over.
            self._fitting_batches += 1
            if self._fitting_batches >= _GROW_AFTER:
                self._fitting_batches = 0
                self.max_batch = min(self._full_batch, self.max_batch * 2)
        for held, outcome in zip(batch.held, batch.outcomes, strict=True):
            self._to_complete.append((held, outcome))
        self._retry_completions()

    def _retry_completions(self) -> None:
        while self._to_complete and not self._suspended:
            held, outcome = self._to_complete[0]
            self._finish(held, outcome)
            self._to_complete.popleft()
            self._held.pop(held.claim.entry.name, None)

    def _finish(self, held: _Held, outcome: Outcome) -> None:
        """Write the job's end, fenced by its token. Raises on connection trouble (retried)."""
        claim, reason = held.claim, held.job.cancel_reason
        context = self._context(held)
        if reason == "cancelled":
            self.claims.drop(claim)
            log.info("stopped: cancelled or withdrawn", extra=context)
        elif reason == "released":
            self.stats.released += self.claims.release(claim)
            log.info("released to other workers", extra=context)
        elif reason in ("fenced", "lost", "lease"):
            self.stats.fenced += 1
            self.metrics.claim_lost(_LOST_REASON[reason])
            log.warning("stopped without a result: claim %s", reason, extra=context)
        elif self._complete(held, outcome):
            self.stats.completed += 1
            self.stats.failed += outcome.status != results.SUCCEEDED
            finished = time.time()
            self.metrics.job_finished(
                self.queue,
                claim.priority,
                outcome.status,
                claim.claimed_at - claim.submitted_at,
                finished - claim.claimed_at,
                outcome.extra.get("output_tokens"),
            )
            log.info("%s in %.2fs", outcome.status, finished - claim.claimed_at, extra=context)
        else:
            self.stats.fenced += 1
            self.metrics.claim_lost("fenced")
            self.claims.release(claim)

    def _context(self, held: _Held) -> dict[str, str]:
        return job_context(held.claim.id, self.queue, held.claim.priority, self.id)

    def _complete(self, held: _Held, outcome: Outcome) -> bool:
        claim = held.claim
        record = Result(
            id=claim.id,
            queue=self.queue,
            priority=claim.priority,
            status=outcome.status,
            output=outcome.output,
            error=outcome.error,
            worker=self.id,
            attempts=claim.token,
            submitted_at=claim.submitted_at,
            started_at=claim.claimed_at,
            finished_at=time.time(),
            extra=outcome.extra,
        )
        last = len(self._to_complete) == 1
        rejoin = last and self.state == RUNNING and not self.line.joined and self._room_after()
        try:
            return self.claims.complete(claim, record, self.line if rejoin else None)
        except ConnectionLoss:
            # The multi may have committed: our result in place means it did.
            self._suspended = True
            raise

    def _room_after(self) -> bool:
        return self.max_jobs is None or self.stats.claimed < self.max_jobs

    # -- connection, heartbeat, stopping -----------------------------------------------------

    def _on_state(self, state: KazooState) -> None:
        self._post("state", state)

    def _state_changed(self, state: KazooState) -> None:
        self.metrics.connection(str(state))
        if state == KazooState.SUSPENDED:
            log.warning("ZooKeeper connection suspended: not claiming until it is back")
            self._suspended = True
        elif state == KazooState.LOST:
            log.error("ZooKeeper session lost: dropping %d claim(s)", len(self._held))
            self._lost = True
            for held in self._held.values():
                held.job.cancel("lost")
            for held, _ in self._to_complete:
                held.job.cancel("lost")
            self.line.forget()
            self.view.invalidate()
        elif state == KazooState.CONNECTED:
            self._suspended = False
            self.view.invalidate()
            self.line.invalidate()
            if self._lost:
                self._lost = False
                self._post("rejoin")
            self._post("wake")

    def _maybe_renew(self) -> None:
        """Renew the leases of running jobs while the runner makes progress. A runner that
        makes none (hung) lets them lapse, and the janitor hands its jobs to other workers."""
        now = time.monotonic()
        if now < self._next_renewal:
            return
        self._next_renewal = now + self.lease / 3
        held = [h for h in self._held.values() if h.job.cancel_reason is None]
        mark = (
            self.stats.claimed,
            len(self._to_complete),
            sum(h.job.progress for h in self._held.values()),
        )
        if not held or self._suspended or mark == self._progress_mark:
            if held:
                log.warning(
                    "no progress on %d running job(s) for %.0fs: not renewing leases",
                    len(held),
                    self.lease / 3,
                )
            return
        self._progress_mark = mark
        self._renew([h.claim for h in held])

    def _renew(self, claims: list[Claim]) -> None:
        """Rewrite these claims (renewing their leases); stop the jobs whose claim is gone."""
        try:
            lost = self.claims.renew(claims)
        except TRANSIENT:
            self._suspended = True
            return
        self.metrics.lease_renewed(len(claims) - len(lost))
        for claim in lost:
            log.warning("job %s: claim gone (lease reclaimed or session lost); stopping", claim.id)
            self._held[claim.entry.name].job.cancel("lease")

    def _maybe_publish(self) -> None:
        """Write streaming jobs' output so far into their claims, at most every
        STREAM_INTERVAL seconds, and only when it changed."""
        streaming = [
            h for h in self._held.values() if h.claim.spec.stream and h.job.cancel_reason is None
        ]
        now = time.monotonic()
        if not streaming:
            self._next_publish = float("inf")
            return
        if now < self._next_publish:
            return
        self._next_publish = now + defaults.STREAM_INTERVAL
        changed = []
        for held in streaming:
            text = held.job.partial_text()
            if text != held.published:
                held.published = text
                self.claims.set_partial(held.claim, text)
                changed.append(held.claim)
        if changed and not self._suspended:
            self._renew(changed)

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_interval
        if self._suspended:
            return
        record = self.registry.record
        record.state = self.state
        record.slots_busy = self.busy
        record.running = [h.claim.id for h in self._held.values()]
        record.completed, record.failed = self.stats.completed, self.stats.failed
        record.memory = self._memory_figures()
        self.metrics.slots(self.busy, self.slots)
        if record.memory is not None:
            m = record.memory
            self.metrics.memory(m["total"], m["free"], m["reserved"])
        if self.on_heartbeat is not None:
            self.on_heartbeat(self)
        try:
            self.registry.update()
        except TRANSIENT:
            self._suspended = True

    def _memory_figures(self) -> dict[str, Any] | None:
        if self.memory is None:
            return None
        snap = self.memory.snapshot()
        return {
            "total": snap.total,
            "free": snap.free,
            "reserved": snap.reserved_by_jobs,
            "keep_free": self.admission.keep_free,
            "capacity": self.admission.capacity,
            "source": snap.source,
        }

    def _begin_stop(self, drain: bool) -> None:
        if self.state == DRAINING or not drain:
            self._release_all()
            return
        log.info("draining: %d running job(s), up to %gs", self.busy, self.drain_timeout)
        self.state = DRAINING
        self._drain_deadline = time.monotonic() + self.drain_timeout
        self._leave_line()

    def _check_drain_deadline(self) -> None:
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self._drain_deadline = None
            log.warning("drain timeout: releasing %d job(s) to other workers", self.busy)
            self._release_all()

    def _release_all(self) -> None:
        self.state = DRAINING
        self._leave_line()
        for held in self._held.values():
            held.job.cancel("released")
        if self._release_deadline is None:
            self._release_deadline = time.monotonic() + _RELEASE_GRACE

    def _leave_line(self) -> None:
        try:
            self.line.leave()
        except TRANSIENT:
            self.line.forget()
            self._unsure = True  # the node may still be there: the next sweep removes it

    def _shutdown(self) -> None:
        self.state = STOPPED
        self.zk.remove_listener(self._on_state)
        for held in self._held.values():
            held.job.cancel("released")
        try:
            self._leave_line()
            self.registry.unregister()
        except TRANSIENT:
            pass
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("worker %s stopped: %s", self.id, self.stats)
