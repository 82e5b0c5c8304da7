"""Runners for tests: they record what ran, or hold jobs until the test lets them go."""

from __future__ import annotations

import threading
from typing import Any

from workers.runners.base import Outcome, RunningJob, ThreadedRunner
from workers.runners.echo import EchoRunner
from zkqueue.protocol.result import Status


class RecordingRunner(EchoRunner):
    """Echo, remembering the order in which jobs were handed to it."""

    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def submit(self, job: RunningJob) -> None:
        with self._lock:
            self.seen.append(job.spec.prompt)
        super().submit(job)


class GateRunner(ThreadedRunner):
    """Holds every job (or those whose prompt is ``only``) until ``gate`` is set (or the job is
    cancelled), then echoes it."""

    name = "gate"

    def __init__(self, only: str | None = None) -> None:
        super().__init__()
        self.only = only
        self.gate = threading.Event()
        self.started = threading.Event()
        self.running: list[RunningJob] = []
        self.finished: list[tuple[str, str]] = []
        #: Every job's prompt, in the order the runner got them.
        self.seen: list[str] = []

    def run_one(self, job: RunningJob) -> Outcome:
        self.seen.append(job.spec.prompt)
        if self.only is not None and job.spec.prompt != self.only:
            return Outcome(Status.SUCCEEDED, output=job.spec.prompt)
        self.running.append(job)
        self.started.set()
        while not self.gate.wait(0.01):
            if job.cancelled.is_set():
                break
        status = Status.CANCELLED if job.cancelled.is_set() else Status.SUCCEEDED
        self.finished.append((job.id, status))
        return Outcome(status, output=job.spec.prompt)


def generate_directly(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> str:
    """Plain ``model.generate`` on one prompt, decoded up to the first eos."""
    enc = tokenizer(prompt, return_tensors="pt")
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return str(tokenizer.decode(new, skip_special_tokens=True))


class HoldRunner(ThreadedRunner):
    """Holds each job until the test releases its prompt (``release``) or the job is cancelled
    (preempted, withdrawn...), then echoes it."""

    name = "hold"

    def __init__(self) -> None:
        super().__init__()
        self._released: set[str] = set()
        self._all = False
        self._changed = threading.Condition()
        #: Every job handed in, in order (a preempted and re-claimed job appears twice).
        self.jobs: list[RunningJob] = []

    def release(self, *prompts: str) -> None:
        with self._changed:
            self._released.update(prompts)
            self._changed.notify_all()

    def release_all(self) -> None:
        with self._changed:
            self._all = True
            self._changed.notify_all()

    def running(self) -> list[str]:
        """Prompts of the jobs held now (not cancelled, not released)."""
        with self._changed:
            return [
                j.spec.prompt
                for j in self.jobs
                if not j.cancelled.is_set()
                and not self._all
                and j.spec.prompt not in self._released
                and j.progress == 0
            ]

    def run_one(self, job: RunningJob) -> Outcome:
        with self._changed:
            self.jobs.append(job)
            while not (self._all or job.spec.prompt in self._released):
                if job.cancelled.is_set():
                    return Outcome(Status.CANCELLED, error=f"stopped: {job.cancel_reason}")
                self._changed.wait(0.01)
        job.progress = 1
        return Outcome(Status.SUCCEEDED, output=job.spec.prompt)
