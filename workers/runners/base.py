"""The runner interface: what a worker calls to turn claimed jobs into outcomes.

A runner executes one batch at a time on a worker thread (never on ZooKeeper's threads). It must
watch each job's ``cancelled`` event and stop that job's work soon after it is set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from zkqueue.spec import JobSpec


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
    #: Why ``cancelled`` was set: "cancelled" (or withdrawn), "fenced", "lease", "released",
    #: "lost".
    cancel_reason: str | None = None
    #: Runner-reported progress (tokens so far); the lease renewal reads it.
    progress: int = 0
    #: Output so far, for jobs that stream: runners append token ids (decoded with ``decode``)
    #: or set ``partial`` directly.
    partial_ids: list[int] = field(default_factory=list)
    partial: str = ""
    decode: Callable[[list[int]], str] | None = None

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancelled.set()

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


class OutOfMemory(Exception):
    """A batch did not fit the device. ``outcomes`` lines up with the batch's jobs: the outcome of
    each job that finished before the failure, None for the others (the worker releases those and
    retries them in smaller batches)."""

    def __init__(self, message: str, outcomes: list[Outcome | None], batch_size: int) -> None:
        super().__init__(message)
        self.outcomes = outcomes
        self.batch_size = batch_size


class Runner(Protocol):
    """Turns a batch of jobs into one outcome per job, in the same order."""

    #: Shown in the worker registration (for example "echo" or the model directory).
    name: str

    def describe(self) -> dict[str, Any]:
        """Figures for the worker registration (model, device, dtype, weight bytes...)."""
        ...

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        """Run ``jobs`` together; return their outcomes in order. Never raise for one bad job."""
        ...

    def close(self) -> None:
        """Free what the runner holds (model weights, threads)."""
        ...
