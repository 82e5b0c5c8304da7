"""Completion: write each finished job's end, fenced by its claim's token, as soon as it ends.

Jobs that end together (reported in the same pass of the loop) complete in one multi, each still
fenced by its own token; a multi stays well under ZooKeeper's 1 MB request limit. A job whose
claim was lost ends without a result (someone else owns it now), a released job goes back to the
queue, and a cancelled one only drops its claim. On connection trouble the rest stays queued and
is retried after the reconnect.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kazoo.protocol.states import ZnodeStat

from workers.admission import Admission
from workers.metrics import WorkerMetrics
from workers.runners.base import CancelReason, Outcome, RunningJob
from zkqueue.dispatch.line import Line
from zkqueue.plumbing.connection import TRANSIENT
from zkqueue.plumbing.logs import job_context
from zkqueue.protocol.claims import Claim, Claims
from zkqueue.protocol.layout import is_generated_id
from zkqueue.protocol.records import DeadLetter
from zkqueue.protocol.result import Result, Status

log = logging.getLogger("zkq.worker")

#: Bytes of result records one completion multi carries at most (ZooKeeper refuses requests
#: over 1 MB by default).
_MULTI_BYTES = 512 * 1024
#: Jobs one completion multi carries at most.
_MULTI_JOBS = 64
#: A claim lost before completion, by cancel reason, as the claims-lost metric names it.
_LOST_REASON = {
    CancelReason.FENCED: "fenced",
    CancelReason.LOST: "session",
    CancelReason.LEASE: "lease",
}


@dataclass
class CompletionStats:
    completed: int = 0
    failed: int = 0
    fenced: int = 0
    released: int = 0
    #: Entries whose generated id turned out to have a result already (a producer reused it).
    dead_lettered: int = 0
    #: Jobs the runner gave back because its engine failed (released, counted apart).
    engine_failures: int = 0


class Completer:
    """Queues finished jobs and writes their ends. ``rejoin`` says whether the last completion
    of a pass should put this worker back in the line."""

    def __init__(
        self,
        claims: Claims,
        line: Line,
        admission: Admission,
        metrics: WorkerMetrics,
        worker_id: str,
        forget: Callable[[RunningJob], None],
        unwatch: Callable[[list[RunningJob]], None] | None = None,
        corrections: Callable[[Claim, dict[str, Any]], None] | None = None,
    ) -> None:
        self.claims = claims
        self.line = line
        self.admission = admission
        self.metrics = metrics
        self.worker_id = worker_id
        self.forget = forget
        #: Called with the jobs of a completion just before its multi (drops entry watches).
        self.unwatch = unwatch
        #: Called with each job written and its runner's figures (fair share's corrections).
        self.corrections = corrections
        self.stats = CompletionStats()
        self.queued: deque[tuple[RunningJob, Outcome]] = deque()

    def __len__(self) -> int:
        return len(self.queued)

    def add(self, job: RunningJob, outcome: Outcome) -> None:
        self.queued.append((job, outcome))

    def cancel_all(self, reason: CancelReason) -> None:
        for job, _ in self.queued:
            job.cancel(reason)

    def flush(self, rejoin: bool) -> None:
        """Write everything queued. Raises on connection trouble (the rest stays queued)."""
        while self.queued:
            job, outcome = self.queued[0]
            if not self._is_result(job, outcome):
                self._end_without_result(job, outcome)
                self.queued.popleft()
                self._done(job)
                continue
            group = self._next_group()
            self._complete(group, rejoin and len(group) == len(self.queued))

    def _next_group(self) -> list[tuple[RunningJob, Outcome]]:
        """The results at the front of the queue that fit one multi."""
        group: list[tuple[RunningJob, Outcome]] = []
        size = 0
        for job, outcome in self.queued:
            size += len(outcome.output) * 4 + 1024
            if not self._is_result(job, outcome) or (
                group and (size > _MULTI_BYTES or len(group) >= _MULTI_JOBS)
            ):
                break
            group.append((job, outcome))
        return group

    @staticmethod
    def _is_result(job: RunningJob, outcome: Outcome) -> bool:
        return job.cancel_reason is None and not outcome.release

    def _end_without_result(self, job: RunningJob, outcome: Outcome) -> None:
        claim, reason = job.claim, job.cancel_reason
        assert claim is not None
        context = job_context(job.id, job.queue, job.priority, self.worker_id)
        if reason == CancelReason.CANCELLED:
            self.claims.drop(claim)
            log.info("stopped: cancelled or withdrawn", extra=context)
        elif reason == CancelReason.PREEMPTED:
            # Given back in the multi that claimed the more urgent job: pending again, and
            # this claim's token can no longer complete it.
            log.info("stopped: preempted, pending again", extra=context)
        elif reason in _LOST_REASON:
            self.stats.fenced += 1
            self.metrics.claim_lost(_LOST_REASON[CancelReason(reason)])
            log.warning("stopped without a result: claim %s", reason, extra=context)
        else:  # released: drain, shutdown, or the engine gave the job back
            self.stats.released += self.claims.release(claim)
            if outcome.release:
                self.stats.engine_failures += 1
                log.warning("released to other workers: %s", outcome.error, extra=context)
            else:
                log.info("released to other workers", extra=context)

    def _complete(self, group: list[tuple[RunningJob, Outcome]], rejoin: bool) -> None:
        now = time.time()
        records = []
        for job, outcome in group:
            job.ended_at = job.ended_at or now  # a retry after a lost reply: the same record
            records.append((job.claim, self._record(job, outcome, job.ended_at)))
        if self.unwatch is not None:
            self.unwatch([job for job, _ in group])
        # On connection trouble this raises and the group stays queued: the multi may have
        # committed, and the retry after the reconnect finds out (its creates then fail).
        written = self.claims.complete_many(
            [(c, r) for c, r in records if c is not None], self.line if rejoin else None
        )
        for (job, outcome), ok in zip(group, written, strict=True):
            self._account(job, outcome, ok, job.ended_at or now)
            self._done(job)
            # Out of the queue once accounted: should the next one's accounting fail with
            # the connection, the retry neither counts this one again nor frees its pages
            # twice.
            self.queued.popleft()

    def _record(self, job: RunningJob, outcome: Outcome, finished: float) -> Result:
        claim = job.claim
        assert claim is not None
        return Result(
            id=claim.id,
            queue=claim.queue,
            priority=claim.priority,
            status=outcome.status,
            output=outcome.output,
            error=outcome.error,
            worker=self.worker_id,
            attempts=claim.spec.attempts(claim.token),
            submitted_at=claim.submitted_at,
            started_at=claim.claimed_at,
            finished_at=finished,
            extra=_with_tenant(
                _with_preemptions(outcome.extra, claim.spec.preemptions), claim.entry.tenant
            ),
        )

    def _account(self, job: RunningJob, outcome: Outcome, ok: bool, finished: float) -> None:
        claim = job.claim
        assert claim is not None
        context = job_context(job.id, job.queue, job.priority, self.worker_id)
        how, entry = ("", None) if ok else self.claims.failed_completion(claim, finished)
        if how == "gone":
            # Cancelled or withdrawn before its entry watch was set (a short job's completion
            # is what finds out): our claim goes, nothing else to do.
            job.cancel_reason = CancelReason.CANCELLED
            self.claims.drop(claim)
            log.info("stopped: cancelled or withdrawn", extra=context)
            return
        if how in ("lost", "duplicate"):
            if entry is not None and is_generated_id(claim.id) and self._letter(claim, *entry):
                self.stats.dead_lettered += 1
                job.cancel_reason = CancelReason.CANCELLED  # its entry is gone
                log.warning("a duplicate of a finished job: dead-lettered", extra=context)
                return
            # Released or dropped before it is counted: should that lose the connection, the
            # retry (the job still queued, as a result) completes, finds out and counts once.
            if not self.claims.release(claim):
                self.claims.drop(claim)  # the entry is gone (cancelled meanwhile): our claim too
            self.stats.fenced += 1
            self.metrics.claim_lost("fenced")
            # The entry may be pending again (a reclaimed lease): keep it in the head's view.
            job.cancel_reason = CancelReason.FENCED
            return
        # Written (``ours``: by an earlier try of this multi whose reply was lost).
        self.stats.completed += 1
        self.stats.failed += outcome.status != Status.SUCCEEDED
        self.metrics.job_finished(
            claim.queue,
            claim.priority,
            outcome.status,
            claim.claimed_at - claim.submitted_at,
            finished - claim.claimed_at,
            outcome.extra.get("output_tokens"),
            claim.entry.tenant or None,
        )
        log.info("%s in %.2fs", outcome.status, finished - claim.claimed_at, extra=context)
        if self.corrections is not None:
            # Best effort (it may read the queue's weights): the job is complete, and counted.
            with contextlib.suppress(*TRANSIENT):
                self.corrections(claim, outcome.extra)

    def _letter(self, claim: Claim, data: bytes, stat: ZnodeStat) -> bool:
        """A generated id's duplicate (its check is left to the completion, which found it):
        letter the entry without a result (the first one stands) and drop our claim."""
        reason = DeadLetter.duplicate(claim.id)
        name = claim.entry.name
        if not self.claims.dead_letter(
            claim.priority, name, data, stat, reason, claim.id, with_result=False
        ):
            return False
        self.claims.drop(claim)
        return True

    def _done(self, job: RunningJob) -> None:
        self.admission.release(job.pages)
        self.forget(job)


def _with_tenant(extra: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The record's ``tenant``, for a job of any tenant but the default one."""
    return {**extra, "tenant": tenant} if tenant else extra


def _with_preemptions(extra: dict[str, Any], preemptions: int) -> dict[str, Any]:
    """The runner's figures, plus how often the job was preempted when it was (the result
    record's ``preemptions``)."""
    return {**extra, "preemptions": preemptions} if preemptions else extra
