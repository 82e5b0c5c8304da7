"""The runner bridge: hands each claimed job to the runner at once, watches its entry while it
runs (a cancel, a withdrawal or a reclaim stops it), hands streaming output to the job's readers
(through the worker's stream server, ``workers.streams``, or else through the job's claim), and
turns the runner's reports into loop events.

Watches and the runner's ``done`` calls arrive on other threads; they only post events to the
loop. Everything that touches ZooKeeper state runs on the loop's thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.states import EventType, WatchedEvent

from workers.events import Event
from workers.runners.base import CancelReason, Outcome, Runner, RunningJob
from workers.streams import StreamServer, visible
from zkqueue import defaults
from zkqueue.plumbing.logs import job_context
from zkqueue.plumbing.watches import remove_data_watch
from zkqueue.protocol.claims import Claims

log = logging.getLogger("zkq.worker")
_RANK = {p: i for i, p in enumerate(defaults.PRIORITIES)}


class RunnerBridge:
    """Between the loop's held jobs and the runner. ``post`` puts an event on the loop."""

    def __init__(
        self,
        zk: KazooClient,
        runner: Runner,
        claims: Claims,
        held: dict[str, RunningJob],
        post: Callable[..., None],
        worker_id: str,
        streams: StreamServer | None = None,
    ) -> None:
        self.zk = zk
        #: Serves streaming jobs' output to their readers directly (None: claims only).
        self.streams = streams
        self.runner = runner
        self.claims = claims
        self.held = held
        self.post = post
        self.worker_id = worker_id
        self.next_publish = float("inf")
        #: When the oldest unwatched job's entry watch is due (monotonic seconds).
        self.next_watch = float("inf")
        #: Jobs handed in whose entry watch is not set yet, with when it is due, oldest first.
        self._unwatched: deque[tuple[float, RunningJob]] = deque()
        #: The entry watch of each held job, by entry name (to remove it before completing).
        self._watches: dict[str, Callable[[WatchedEvent], None]] = {}

    def start(self) -> None:
        self.runner.start(lambda job, outcome: self.post(Event.DONE, job, outcome))

    def hand_in(self, jobs: list[RunningJob]) -> None:
        """Start the jobs. Their entries are watched once they have run ENTRY_WATCH_DELAY
        (``watch_due``): a job that ends sooner never pays the two requests of a watch (set and
        removed), and its completion, fenced by its token, fails if it was cancelled or
        reclaimed meanwhile. So a cancel reaches a running job within that delay at most."""
        now = time.monotonic()
        # The most urgent first: an engine that queues what it cannot start at once (its
        # prefill budget per step) serves its waiting list in arrival order.
        jobs = sorted(jobs, key=lambda job: _RANK[job.priority])
        for job in jobs:
            self.held[self.key(job)] = job
            if self.streams is not None and job.spec.stream:
                self.streams.open(job)
            self.runner.submit(job)
            log.info("claimed (attempt %d)", job.attempts, extra=self.context(job))
            self._unwatched.append((now + defaults.ENTRY_WATCH_DELAY, job))
        if any(job.spec.stream for job in jobs):
            self.next_publish = min(self.next_publish, now + defaults.STREAM_INTERVAL)
        self._advance()

    def watch_due(self) -> None:
        """Watch the entries of the held jobs that have run ENTRY_WATCH_DELAY (pipelined)."""
        now = time.monotonic()
        due = []
        while self._unwatched and self._unwatched[0][0] <= now:
            job = self._unwatched.popleft()[1]
            if self._unfinished(job):
                due.append(job)
        self._advance()
        if due:
            self.watch(due)

    def _unfinished(self, job: RunningJob) -> bool:
        return not job.watched and job.claim is not None and self.held.get(self.key(job)) is job

    def _advance(self) -> None:
        """Forget the jobs at the front that ended unwatched: the loop wakes for the next due."""
        while self._unwatched and not self._unfinished(self._unwatched[0][1]):
            self._unwatched.popleft()
        self.next_watch = self._unwatched[0][0] if self._unwatched else float("inf")

    def watch(self, jobs: list[RunningJob]) -> None:
        """Watch each running job's entry (cancel, withdrawal, reclaim), pipelined."""
        calls = [
            (job, self.zk.exists_async(self._entry(job), watch=self._watch(job))) for job in jobs
        ]
        for job, call in calls:
            stat = call.get()
            job.watched = True
            if stat is None:
                job.cancel(CancelReason.CANCELLED)
            elif job.claim is not None and stat.version != job.claim.token:
                job.cancel(CancelReason.FENCED)

    def entry_changed(self, key: str, event_type: str, watched: RunningJob) -> None:
        job = self.held.get(key)
        if job is not watched:
            return  # a watch from an earlier claim of this entry (our own re-claim fired it)
        if event_type == EventType.DELETED:
            job.cancel(CancelReason.CANCELLED)
        elif event_type == EventType.CHANGED:
            job.cancel(CancelReason.FENCED)

    def publish(self) -> list[RunningJob]:
        """Write the output so far of streaming jobs no direct reader takes into their claims'
        bodies, at most every STREAM_INTERVAL seconds and only when it changed; returns the
        jobs to renew (the renewal writes the bodies)."""
        streaming = [
            j for j in self.held.values() if j.spec.stream and j.cancel_reason is None and j.claim
        ]
        now = time.monotonic()
        if not streaming:
            self.next_publish = float("inf")
            return []
        if now < self.next_publish:
            return []
        self.next_publish = now + defaults.STREAM_INTERVAL
        if self.streams is not None:
            streams = self.streams
            streaming = [j for j in streaming if not streams.served(j)]
        changed = []
        for job in streaming:
            text = visible(job.partial_text(), job.spec.stop)  # never text a stop string cuts
            if text != job.published and job.claim is not None:
                job.published = text
                self.claims.set_partial(job.claim, text)
                changed.append(job)
        return changed

    def cancel_all(self, reason: CancelReason) -> None:
        for job in self.held.values():
            job.cancel(reason)

    @staticmethod
    def key(job: RunningJob) -> str:
        assert job.claim is not None
        return job.claim.entry.name

    def context(self, job: RunningJob) -> dict[str, str]:
        return job_context(job.id, job.queue, job.priority, self.worker_id)

    def _entry(self, job: RunningJob) -> str:
        assert job.claim is not None
        return self.claims.entry_path(job.claim.priority, job.claim.entry)

    def unwatch(self, jobs: list[RunningJob]) -> None:
        """Remove the entry watches of jobs about to complete (sent, not awaited: the
        completion multi follows in the same flush), so their own end notifies nobody."""
        for job in jobs:
            watch = self._watches.pop(self.key(job), None)
            if watch is not None:
                remove_data_watch(self.zk, self._entry(job), watch)

    def ended(self, job: RunningJob, outcome: Outcome) -> None:
        """The runner reported the job's outcome: its readers get the end of its output."""
        if self.streams is not None:
            self.streams.end(job, outcome)

    def forget(self, job: RunningJob) -> None:
        """The job ended (the loop no longer holds it)."""
        self._watches.pop(self.key(job), None)
        if self.streams is not None:
            self.streams.end(job)  # stopped without an outcome (lost, released): say so
        self._advance()

    def _watch(self, job: RunningJob) -> Callable[[WatchedEvent], None]:
        key = self.key(job)

        def watch(event: WatchedEvent) -> None:
            self.post(Event.ENTRY, key, event.type, job)

        self._watches[key] = watch
        return watch


def describe(runner: Runner) -> dict[str, Any]:
    """The runner's figures for the registration (never fails the worker)."""
    try:
        return dict(runner.describe())
    except Exception as exc:  # a describe bug must not stop a worker from registering
        return {"error": repr(exc)}
