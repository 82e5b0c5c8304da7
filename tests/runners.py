"""Runners for tests: they record what ran, or hold jobs until the test lets them go."""

from __future__ import annotations

import threading
from typing import Any

from workers.runners.base import Outcome, RunningJob
from workers.runners.echo import EchoRunner
from zkqueue import result


class RecordingRunner(EchoRunner):
    """Echo, remembering the order in which jobs were handed to it."""

    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        with self._lock:
            self.seen.extend(j.spec.prompt for j in jobs)
        return super().run(jobs)


class GateRunner:
    """Holds every job until ``gate`` is set (or the job is cancelled), then echoes it."""

    name = "gate"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.running: list[RunningJob] = []
        self.finished: list[tuple[str, str]] = []

    def describe(self) -> dict[str, Any]:
        return {"runner": "gate"}

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        self.running.extend(jobs)
        self.started.set()
        outcomes = []
        for job in jobs:
            while not self.gate.wait(0.01):
                if job.cancelled.is_set():
                    break
            status = result.CANCELLED if job.cancelled.is_set() else result.SUCCEEDED
            self.finished.append((job.id, status))
            outcomes.append(Outcome(status, output=job.spec.prompt))
        return outcomes

    def close(self) -> None:
        pass


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
