"""The runner interface: one job in, one outcome out, as soon as that job ends.

The worker hands each job to its runner the moment it is claimed (``submit``, which returns at
once) and the runner reports the job's ``Outcome`` through the ``done`` callback given to
``start`` (from any thread; the worker only posts it to its loop). A runner must watch each job's
``cancelled`` event (or register ``on_cancel``) and stop that job's work soon after it is set,
still reporting an outcome for it.

``ThreadedRunner`` is the simple base for runners that run one job per thread (echo, test
runners); engines that batch continuously (the HF runner) implement ``submit`` themselves.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from zkqueue.protocol.spec import JobSpec

if TYPE_CHECKING:
    from zkqueue.protocol.claims import Claim

log = logging.getLogger("zkq.runner")


class CancelReason(enum.StrEnum):
    """Why a running job was stopped; the value is what logs and metrics say."""

    #: The entry was deleted: cancelled by a user or withdrawn by its caller.
    CANCELLED = "cancelled"
    #: Another claim replaced ours (the entry's version moved).
    FENCED = "fenced"
    #: Our lease was reclaimed by the janitor.
    LEASE = "lease"
    #: We give the job back (drain, shutdown, engine failure).
    RELEASED = "released"
    #: We gave the job back for a more urgent one (already pending again: nothing to write).
    PREEMPTED = "preempted"
    #: The session that held the claim is gone.
    LOST = "lost"


@dataclass
class RunningJob:
    """A job this worker holds a claim on, as handed to a runner."""

    id: str
    spec: JobSpec
    priority: str
    queue: str
    attempts: int
    claimed_at: float = field(default_factory=time.time)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: CancelReason | None = None
    #: Runner-reported progress (tokens so far); the lease renewal reads it.
    progress: int = 0
    #: Output so far, for jobs that stream: runners append token ids (decoded with ``decode``)
    #: or set ``partial`` directly.
    partial_ids: list[int] = field(default_factory=list)
    partial: str = ""
    decode: Callable[[list[int]], str] | None = None
    #: Called once (on the canceller's thread) when the job is cancelled: runners whose engine
    #: must be told (abort a request) set it in ``submit``.
    on_cancel: Callable[[RunningJob], None] | None = None
    #: Called (on the runner's thread) each time the output so far grows: the worker's stream
    #: server (``workers.streams``) sets it to wake the job's direct readers.
    on_output: Callable[[], None] | None = None

    # -- the worker's bookkeeping (runners ignore these) ---------------------------------------
    #: The claim this worker holds on the job's entry (None for a runner tested alone).
    claim: Claim | None = None
    #: KV-cache pages admission promised the job.
    pages: int = 0
    #: Partial output last written to the claim (streaming jobs).
    published: str = ""
    #: Whether the watch on its entry is set (connection trouble can prevent it).
    watched: bool = False
    #: When its claim was last written (claimed, renewed or published), monotonic seconds.
    renewed_at: float = field(default_factory=time.monotonic)
    #: The spec its entry gets if the worker preempts it (the preemption counted), made
    #: when the job is chosen as a victim (``workers.preemption``).
    given_back: bytes | None = None
    #: When the worker first tried to write its result (unix seconds): the record's
    #: ``finished_at``, the same on a retry.
    ended_at: float | None = None

    @classmethod
    def from_claim(cls, claim: Claim, pages: int = 0) -> RunningJob:
        return cls(
            id=claim.id,
            spec=claim.spec,
            priority=claim.priority,
            queue=claim.queue,
            attempts=claim.spec.attempts(claim.token),
            claimed_at=claim.claimed_at,
            claim=claim,
            pages=pages,
        )

    def cancel(self, reason: CancelReason) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        first = not self.cancelled.is_set()
        self.cancelled.set()
        if first and self.on_cancel is not None:
            try:
                self.on_cancel(self)
            except Exception:  # the engine's trouble must not reach the worker's loop
                log.exception("job %s: the runner's cancel hook failed", self.id)

    def add_tokens(self, tokens: list[int]) -> None:
        """A runner reports the job's output token ids so far (the new ones are appended)."""
        if len(tokens) > len(self.partial_ids):
            self.partial_ids.extend(tokens[len(self.partial_ids) :])
            self._output_grew()

    def add_text(self, text: str) -> None:
        """A runner reports the job's output text so far (runners that get text, not ids)."""
        if text != self.partial:
            self.partial = text
            self._output_grew()

    def _output_grew(self) -> None:
        hook = self.on_output
        if hook is not None:
            try:
                hook()
            except Exception:  # a reader's trouble must never reach the runner
                log.exception("job %s: the output hook failed", self.id)

    def partial_text(self) -> str:
        """The output generated so far (what a streaming caller sees)."""
        if self.decode is not None and self.partial_ids:
            # A token may end inside a multi-byte character: hold its half back for now.
            return self.decode(list(self.partial_ids)).rstrip("\ufffd")
        return self.partial


@dataclass
class Outcome:
    """What a runner made of one job; ``status`` is a result status (succeeded, failed...)."""

    status: str
    output: str = ""
    error: str | None = None
    #: Runner-specific figures copied into the result record (prompt_tokens, output_tokens, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    #: The job did not fail on its own account (the engine died, the device ran out of memory):
    #: the worker gives it back to the queue for another try instead of writing a result.
    release: bool = False


#: How a runner reports an outcome: ``done(job, outcome)``, from any thread, once per job.
Done = Callable[[RunningJob, Outcome], None]


class Runner(Protocol):
    """Takes jobs one at a time and reports each one's outcome as soon as it ends."""

    #: Shown in the worker registration (for example "echo" or the model directory).
    name: str

    def describe(self) -> dict[str, Any]:
        """Figures for the worker registration (model, device, dtype, cache pages...)."""
        ...

    def start(self, done: Done) -> None:
        """Begin serving; every job later given to ``submit`` ends with one ``done`` call."""
        ...

    def submit(self, job: RunningJob) -> None:
        """Take one job and return at once. Never raise for one bad job: report it."""
        ...

    def close(self) -> None:
        """Stop serving and free what the runner holds (model weights, threads)."""
        ...


class ThreadedRunner:
    """A runner that runs each job on a thread of its own pool: subclasses write ``run_one``."""

    name = "threaded"

    def __init__(self, threads: int = 64) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._done: Done | None = None

    def describe(self) -> dict[str, Any]:
        return {"runner": self.name}

    def start(self, done: Done) -> None:
        self._done = done
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"zkq-{self.name}")

    def submit(self, job: RunningJob) -> None:
        assert self._pool is not None, "start() the runner first"
        self._pool.submit(self._run, job)

    def _run(self, job: RunningJob) -> None:
        try:
            outcome = self.run_one(job)
        except Exception as exc:  # a runner bug must fail its job, never kill the worker
            log.exception("runner failed job %s", job.id)
            outcome = Outcome("failed", error=f"runner error: {exc!r}")
        assert self._done is not None
        self._done(job, outcome)

    def run_one(self, job: RunningJob) -> Outcome:
        """Run one job to its end; return its outcome (watch ``job.cancelled``)."""
        raise NotImplementedError

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
