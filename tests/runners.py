"""Runners for tests: they record what ran, or hold jobs until the test lets them go."""

from __future__ import annotations

import threading
from typing import Any

from workers.runners.base import Outcome, RunningJob, ThreadedRunner
from workers.runners.echo import EchoRunner
from zkqueue.result import Status


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
