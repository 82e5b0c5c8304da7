"""The worker loop: stand in the line, claim what fits when at its head, hand each job to the
runner at once, complete each as soon as it ends, and survive connection trouble. It wires the
head turn (``workers.head``), the runner bridge (``workers.bridge``: jobs in, outcomes out, entry
watches, streaming), completion (``workers.completion``: fenced, coalesced writes) and liveness
(``workers.liveness``: session states, leases, heartbeats). All ZooKeeper state is touched from
the loop's thread only (at the end, by the goodbye thread it waits for); watches, the connection
listener and the runner just post events.
"""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import KazooState

from workers.admission import Admission
from workers.bridge import RunnerBridge, describe
from workers.completion import Completer
from workers.events import WATCHES, Event, State
from workers.head import HeadTurn
from workers.liveness import Liveness
from workers.metrics import WorkerMetrics
from workers.options import WorkerOptions, default_worker_id, high_width_for, slots_for
from workers.preemption import Preemption, PreemptionPolicy
from workers.runners.base import CancelReason, Outcome, Runner, RunningJob
from workers.runners.gate import Gate
from workers.stats import WorkerStats
from workers.streams import StreamServer
from zkqueue.defaults import Priority
from zkqueue.dispatch.line import Line
from zkqueue.dispatch.share import Corrections
from zkqueue.dispatch.view import PendingView
from zkqueue.plumbing.connection import TRANSIENT
from zkqueue.protocol import revision
from zkqueue.protocol.claims import Claim, Claims
from zkqueue.protocol.layout import Layout, check_queue
from zkqueue.protocol.registry import Registry, WorkerRecord

log = logging.getLogger("zkq.worker")

#: After a drain times out, how long released jobs get to stop before the worker exits anyway.
_RELEASE_GRACE = 5.0
#: How long a stopping worker waits for ZooKeeper to take back its place in the line and its
#: registration; then it stops without: they are ephemeral, and go with its session.
GOODBYE_TIMEOUT = 5.0


class Worker:
    """One worker process's loop on one queue; ``options`` is its configuration.

    ``zk`` is a started client of zkq's (``connect``, ``ConnectionSettings.make_client``): a
    plain KazooClient holds a request made while ZooKeeper is away until it comes back, and
    the loop with it, deaf to stop."""

    def __init__(
        self,
        zk: KazooClient,
        runner: Runner,
        options: WorkerOptions | None = None,
        *,
        admission: Admission | None = None,
        metrics: WorkerMetrics | None = None,
        on_heartbeat: Callable[[Worker], None] | None = None,
    ) -> None:
        opts = options or WorkerOptions()
        self.opts = opts
        self.zk = zk
        self.runner = runner
        self.queue = check_queue(opts.queue)
        self.layout = Layout(opts.root)
        self.admission = admission or Admission()
        self.slots = slots_for(opts, self.admission.pages_total, runner)
        #: Jobs held at most while a high-priority job runs (None: the slots).
        self.high_width = high_width_for(opts, runner, self.slots)
        self.id = opts.name or default_worker_id()
        #: Prometheus metrics (served by the daemon's --metrics-port).
        self.metrics = metrics or WorkerMetrics()
        self.on_heartbeat = on_heartbeat
        self.state = State.NEW
        self.ready = threading.Event()
        self._stats = WorkerStats()
        self._events: queue_mod.Queue[tuple[Any, ...]] = queue_mod.Queue()
        #: Jobs this worker holds a claim on, by entry name.
        self.held: dict[str, RunningJob] = {}
        on_line = lambda: self._post(Event.LINE)  # noqa: E731
        self.line = Line(zk, self.layout.line(self.queue), self.id, on_line, self._queue_gone)
        self.view = PendingView(zk, self.layout, self.queue, lambda p: self._post(Event.PENDING, p))
        self.claims = Claims(zk, self.layout, self.queue, self.id, lease=opts.lease)
        record = WorkerRecord(
            id=self.id,
            queue=self.queue,
            runner=runner.name,
            slots_max=self.slots,
            high_width=self.high_width,
            runner_info=describe(runner),
        )
        self.registry = Registry(zk, self.layout, record)
        self.head = HeadTurn(
            zk,
            self.claims,
            self.view,
            self.line,
            self.admission,
            self.metrics,
            self.layout,
            self.queue,
            opts.max_attempts,
        )
        #: The data plane: streaming jobs' output straight to their readers (None: claims only).
        self.streams = (
            StreamServer(
                opts.stream_bind,
                opts.stream_advertise,
                zk.hosts,
                opts.stream_tls,
                self.metrics.stream_readers,
            )
            if opts.stream
            else None
        )
        self.bridge = RunnerBridge(
            zk, runner, self.claims, self.held, self._post, self.id, self.streams
        )
        policy = PreemptionPolicy(opts.preempt, opts.preempt_protect, opts.preempt_per_minute)
        self.preemption = Preemption(
            zk,
            self.layout,
            self.queue,
            self.id,
            self.claims,
            self.admission,
            self.metrics,
            opts.max_attempts,
            policy,
            self._post,
        )
        self.completer = Completer(
            self.claims,
            self.line,
            self.admission,
            self.metrics,
            self.id,
            self._forget,
            self.bridge.unwatch,
            self._correct,
        )
        self.corrections = Corrections(zk, self.layout, self.queue)
        self.liveness = Liveness(
            self.claims,
            self.registry,
            self.admission,
            self.metrics,
            self.held,
            lease=opts.lease,
            heartbeat_interval=opts.heartbeat_interval,
            runner_figures=self._runner_figures,
        )
        #: The dispatch gate of a runner in front of an inference server (None: slots alone).
        gate = getattr(runner, "gate", None)
        self.gate: Gate | None = gate if isinstance(gate, Gate) else None
        if self.gate is not None:
            self.gate.on_change = lambda: self._post(Event.WAKE)
        self._drain_deadline: float | None = None
        self._release_deadline: float | None = None
        #: The session was lost: register again once connected (``_register_again``).
        self._rejoin = False
        self._queue_empty = False

    @property
    def busy(self) -> int:
        return len(self.held)

    @property
    def stats(self) -> WorkerStats:
        """What this worker did so far (the parts' figures, read together)."""
        s, head, done = self._stats, self.head.stats, self.completer.stats
        s.dead_lettered, s.rejected = head.dead_lettered + done.dead_lettered, head.rejected
        s.completed, s.failed, s.fenced = done.completed, done.failed, done.fenced
        s.released, s.out_of_memory = done.released, done.engine_failures
        s.preempted = self.preemption.preempted
        return s

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
        revision.ensure(self.zk, self.layout)
        revision.ensure_dirs(self.zk, self.layout, self.queue)
        self.zk.add_listener(self._on_state)
        self.metrics.connection("CONNECTED")
        self.registry.record.memory = self.liveness.cache_figures()
        self._runner_figures(self.registry.record)
        if self.streams is not None:
            self.claims.streams = self.registry.record.streams = self.streams.start()
        self.registry.register(wait=self.registry.session_lifetime())
        self.bridge.start()
        self.state = State.RUNNING
        self.registry.record.state = self.state
        self._post(Event.WAKE)

    def stop(self, drain: bool = True) -> None:
        """Ask the loop to stop (thread safe). With drain, running jobs get drain_timeout to
        finish; without, or on a second call, they are released at once."""
        self._post(Event.STOP, drain)

    # -- the loop ----------------------------------------------------------------------------

    def _post(self, *event: Any) -> None:
        if event[0] in WATCHES:
            self._stats.watch_events += 1
        self._events.put(event)

    def _step(self) -> bool:
        # Events touch ZooKeeper too (a finished job completes, a lost session registers
        # again): trouble there must suspend the loop like trouble in dispatch, never end it.
        # What failed is retried after the reconnect (completions stay queued).
        try:
            self._register_again()
            self._complete()
            self._dispatch()
            self._wait_events()
            self._complete()
            if not self.liveness.suspended:
                self.bridge.watch_due()
        except TRANSIENT as exc:
            log.warning("ZooKeeper trouble, waiting for the connection: %s", type(exc).__name__)
            self.liveness.trouble()
        self._periodic()
        return not self._should_exit()

    def _register_again(self) -> None:
        """After a lost session, register under the new one. Until that succeeds it stays
        due (the connection may go again before it is sent: it is tried at the next step once
        connected, and no record change is needed to bring it back)."""
        if self._rejoin and self.zk.connected:
            self.registry.record.state = self.state  # draining, maybe, since the last beat
            self.registry.register(wait=self.registry.session_lifetime())
            self._rejoin = False

    def _correct(self, claim: Claim, figures: dict[str, Any]) -> None:
        """Count what a job of a queue with tenants really cost against its estimate."""
        if not claim.entry.tenant and not any(self.view.tenants.values()):
            return  # one tenant: nobody to be fair to
        used = [figures.get(k) for k in ("prompt_tokens", "output_tokens")]
        tokens = sum(u for u in used if isinstance(u, int)) if any(used) else None
        weight = self.head.cap.settings.weight(claim.entry.tenant_name)
        self.corrections.add(claim.entry.tenant_name, claim.spec, tokens, weight)

    def _periodic(self) -> None:
        live = self.liveness
        counts = (self.stats.completed, self.stats.failed, self.stats.preempted)
        beat = live.maybe_heartbeat(self.state, counts, self.slots)
        if beat and self.line.recheck():  # the head: is its place still there?
            self.view.poll()  # entries created without the arrival signal
        if beat:
            self.preemption.recheck()  # the same for a busy line's head
        if beat and self.corrections.pending and not self.liveness.suspended:
            try:
                self.corrections.flush()
            except TRANSIENT as exc:  # kept for the next heartbeat
                log.warning("fair share corrections not written: %s", type(exc).__name__)
        if beat and self.on_heartbeat is not None:
            self.on_heartbeat(self)
        live.maybe_renew(self._stats.claimed, len(self.completer))
        changed = self.bridge.publish()
        if changed:
            self.metrics.stream_partials.inc(len(changed))
        if changed and not live.suspended:
            live.renew(changed)

    def _wait_events(self) -> None:
        live = self.liveness
        bridge = self.bridge
        # Entry watches wait for the connection (watch_due is skipped while suspended).
        watch_at = float("inf") if live.suspended else bridge.next_watch
        wake_at = min(live.next_heartbeat, live.next_renewal, bridge.next_publish, watch_at)
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
        if kind == Event.LINE:
            self.line.invalidate()
        elif kind == Event.PENDING:
            self.view.invalidate(event[1])
            self._queue_empty = False
        elif kind == Event.ENTRY:
            self.bridge.entry_changed(event[1], event[2], event[3])
        elif kind == Event.DONE:
            self._job_done(event[1], event[2])
        elif kind == Event.STATE:
            self._state_changed(event[1])
        elif kind == Event.STOP:
            self._begin_stop(event[1])
        elif kind == Event.BUSY:
            self.preemption.line_changed()
        elif kind == Event.URGENT:
            self.preemption.view_changed(event[1])

    def _should_exit(self) -> bool:
        if self.state == State.STOPPED:
            return True
        idle = not self.held
        if self.state == State.DRAINING:
            self._check_drain_deadline()
            return idle or (
                self._release_deadline is not None and time.monotonic() > self._release_deadline
            )
        limit = self.opts.max_jobs
        if limit is not None and self._stats.claimed >= limit and idle:
            return True
        return self.opts.burst and self._queue_empty and idle

    # -- dispatch ----------------------------------------------------------------------------

    def _room(self, ending: frozenset[str] = frozenset()) -> int:
        """Slots free for a job of any priority once the held jobs named in ``ending`` are
        gone: the slots, or while a high-priority job runs, the narrower ``high_width``
        (lower-priority jobs that end are not replaced beyond it, so the urgent job's steps
        stay short; a high job may still take any free slot: ``_high_room``)."""
        staying = [job for name, job in self.held.items() if name not in ending]
        free = self.slots - len(staying)
        if self.high_width is not None and any(j.priority == Priority.HIGH for j in staying):
            free = min(free, self.high_width - len(staying))
        return free

    def _high_room(self) -> int:
        """Slots a narrowed worker (``_room``) has free for high-priority jobs alone; it takes
        them as a busy line's head (``workers.preemption``), not from the line."""
        if self._room() > 0 or self.slots - self.busy <= 0:
            return 0
        return self._free_slots(self.slots - self.busy)

    def _free_slots(self, free: int | None = None) -> int:
        free = self._room() if free is None else free
        room = None if self.gate is None else self.gate.room()
        if room is not None:  # the server's room (0 when it is full or down)
            free = min(free, room)
        if self.opts.max_jobs is not None:
            free = min(free, self.opts.max_jobs - self._stats.claimed)
        return free

    def _dispatch(self) -> None:
        if self.liveness.paused:
            return
        if self.liveness.unsure:
            self._sweep()
        free = self._free_slots()
        if self.state != State.RUNNING or free <= 0:
            self.head.drop_watches()
            if self.line.joined and self.state == State.RUNNING:
                self._leave_line()  # the gate shut while we stood in the line: let others by
            if self.state == State.RUNNING and self._room_after() and self._may_preempt():
                # Every slot busy, or every slot a lower job may take (narrowed).
                self._hand_in(self.preemption.turn(self.held, room=self._high_room()))
            else:
                self.preemption.leave()
            return
        self.preemption.leave()  # a free slot: this worker stands in the line instead
        if not self.line.joined:
            try:
                self.line.join()
            except NoNodeError:  # the queue is being deleted under us: again at the next step
                return
        if self.line.known is False:
            self.head.drop_watches()
            return  # waiting for the predecessor to leave
        claimed = self.head.turn(free, set(self.held), rejoin_if_room=True)
        if claimed is None:
            self._post(Event.WAKE)  # lost a race: re-read and try again
            return
        if not claimed:
            if self.line.known:  # the head found nothing it may claim (capped: jobs wait)
                self._queue_empty = not self.head.capped
                if self.head.step_aside:  # a bigger worker stands behind us: let it be head
                    self.head.drop_watches_soon()
                    self.line.step_aside()
            return
        self._hand_in(claimed)

    def _hand_in(self, claimed: list[tuple[Claim, int]]) -> None:
        """Start the jobs a turn claimed, with the pages admission promised each."""
        if not claimed:
            return
        self._stats.claimed += len(claimed)
        if self.gate is not None:
            self.gate.claimed(len(claimed))
        self.metrics.batch(self.queue, len(claimed))
        jobs = []
        for claim, pages in claimed:
            self.admission.reserve(pages)
            self.metrics.job_pages(self.queue, pages)
            jobs.append(RunningJob.from_claim(claim, pages))
        self.bridge.hand_in(jobs)

    def _queue_gone(self) -> None:
        """The queue was deleted under us: make it again, re-read all (the watches went too)."""
        log.warning("queue %s was deleted under this worker: creating it again", self.queue)
        # Every directory missing (a delete under way may have left the completeness marker).
        revision.ensure_dirs(self.zk, self.layout, self.queue, all_of=True)
        self.view.forget_watches()

    def _sweep(self) -> None:
        """A call failed with the connection, so its writes may have committed unseen: remove
        our unknown claims and line places, set the entry watches that could not be set."""
        # Claims are named by job id (``held`` is keyed by entry name).
        running = {job.id for job in self.held.values()}
        stray = self.claims.sweep([self.line, *self.preemption.lines], running)
        self.bridge.watch([j for j in self.held.values() if not j.watched])
        self.liveness.unsure = False
        if stray:
            log.warning("removed %d node(s) left by replies lost with the connection", len(stray))
            self.head.drop_watches_soon()  # a lost claim's reply: it may have left the line
            self.line.invalidate()
            self.view.invalidate()

    # -- completion --------------------------------------------------------------------------

    def _job_done(self, job: RunningJob, outcome: Outcome) -> None:
        if job.claim is None or self.held.get(job.claim.entry.name) is not job:
            return  # already ended (a lost session dropped it)
        if outcome.release and job.cancel_reason is None:
            job.cancel_reason = CancelReason.RELEASED
        self.bridge.ended(job, outcome)
        self.completer.add(job, outcome)

    def _complete(self) -> None:
        if self.completer.queued and not self.liveness.suspended:
            ending = frozenset(
                job.claim.entry.name for job, _ in self.completer.queued if job.claim is not None
            )
            rejoin = (
                self.state == State.RUNNING
                and not self.line.joined
                and self._room_after()
                and self._room(ending) > 0
                and (self.gate is None or self.gate.room() != 0)
            )
            self.completer.flush(rejoin)

    def _forget(self, job: RunningJob) -> None:
        if job.claim is not None:
            self.held.pop(job.claim.entry.name, None)
            self.bridge.forget(job)
            if job.cancel_reason in (None, CancelReason.CANCELLED):  # its entry is gone
                self.view.drop(job.claim.priority, job.claim.entry)

    def _may_preempt(self) -> bool:
        """Behind a server: only while it is up, and full (every slot busy, or its own figures
        say so), not merely waiting for its next reading."""
        gate = self.gate
        if gate is None:
            return True
        return gate.up and (self._room() <= 0 or gate.server_busy)

    def _runner_figures(self, record: WorkerRecord) -> None:
        """The server's figures and the gate's state, for the registration's ``engine``."""
        if self.gate is not None:
            record.engine = self.gate.record()
            record.runner_info = describe(self.runner)  # a late server's model

    def _room_after(self) -> bool:
        return self.opts.max_jobs is None or self._stats.claimed < self.opts.max_jobs

    # -- connection and stopping -------------------------------------------------------------

    def _on_state(self, state: KazooState) -> None:
        self._post(Event.STATE, state)

    def _state_changed(self, state: KazooState) -> None:
        if self.liveness.state_changed(state, self._session_lost):
            self._rejoin = True
        if state == KazooState.CONNECTED:
            self.view.invalidate()
            self.line.invalidate()
            self._post(Event.WAKE)

    def _session_lost(self) -> None:
        self.bridge.cancel_all(CancelReason.LOST)
        self.completer.cancel_all(CancelReason.LOST)
        self.line.forget()
        self.view.forget_watches()
        self.preemption.forget()

    def _say_goodbye(self) -> None:
        """Leave the line and unregister (on a thread of its own: see ``_shutdown``)."""
        try:
            self._leave_line()
            self.registry.unregister()
        except TRANSIENT:  # gone, or closed after the timeout (ConnectionClosedError)
            pass
        except Exception as exc:  # on a thread of its own: said, never a lost traceback
            log.warning("could not leave ZooKeeper cleanly: %s: %s", type(exc).__name__, exc)

    def _begin_stop(self, drain: bool) -> None:
        if self.state == State.DRAINING or not drain:
            self._release_all()
            return
        log.info("draining: %d running job(s), up to %gs", self.busy, self.opts.drain_timeout)
        self.state = State.DRAINING
        self._drain_deadline = time.monotonic() + self.opts.drain_timeout
        self._leave_line()

    def _check_drain_deadline(self) -> None:
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self._drain_deadline = None
            log.warning("drain timeout: releasing %d job(s) to other workers", self.busy)
            self._release_all()

    def _release_all(self) -> None:
        self.state = State.DRAINING
        self._leave_line()
        self.bridge.cancel_all(CancelReason.RELEASED)
        if self._release_deadline is None:
            self._release_deadline = time.monotonic() + _RELEASE_GRACE

    def _leave_line(self) -> None:
        self.head.drop_watches_soon()  # a draining worker is no longer head
        try:
            self.line.leave()
            self.preemption.leave()
            return
        except TRANSIENT:  # at once while ZooKeeper is away (zkq's client waits for nothing)
            self.liveness.trouble()  # claim nothing until the connection is back
        # Forgotten, though the session may live on: the node may still be there (a running
        # loop's next sweep removes it; a stopping worker's session takes it).
        self.line.forget()
        self.preemption.forget()

    def _shutdown(self) -> None:
        self.state = State.STOPPED
        self.zk.remove_listener(self._on_state)
        self.bridge.cancel_all(CancelReason.RELEASED)
        # kazoo's calls have no timeout: a ZooKeeper that is connected but does not answer
        # would hold the goodbye, so it runs on a thread waited for at most GOODBYE_TIMEOUT
        # (disconnected, it is not tried: zkq's client fails every request at once). Either
        # way the worker stops; its nodes are ephemeral and go with its session.
        if not self.zk.connected:
            log.warning(
                "ZooKeeper is unreachable: stopping without removing this worker's place in "
                "the line and its registration (they go with its session)"
            )
        else:
            goodbye = threading.Thread(target=self._say_goodbye, name="zkq-goodbye", daemon=True)
            goodbye.start()
            goodbye.join(GOODBYE_TIMEOUT)
            if goodbye.is_alive():
                log.warning(
                    "ZooKeeper did not answer within %gs: stopping without removing this "
                    "worker's place in the line and its registration (they go with its session)",
                    GOODBYE_TIMEOUT,
                )
        if self.streams is not None:
            self.streams.close()
        log.info("worker %s stopped: %s", self.id, self.stats)
