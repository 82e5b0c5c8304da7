"""The echo runner: returns each prompt as its output after a delay. It exists for smoke tests and
benchmarks and goes through every code path of the model runner except generation."""

from __future__ import annotations

import time
from typing import Any

from workers.runners.base import Outcome, RunningJob
from zkqueue import defaults, result

#: Seconds between the echo runner's progress ticks.
_TICK = 0.25


class EchoRunner:
    def __init__(self, delay: float = defaults.ECHO_DELAY, fail_marker: str | None = None) -> None:
        self.name = "echo"
        self.delay = delay
        #: A prompt containing this text fails (for exercising failure paths).
        self.fail_marker = fail_marker

    def describe(self) -> dict[str, Any]:
        return {"runner": "echo", "delay": self.delay}

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        start = time.monotonic()
        return [self._one(job, start) for job in jobs]

    def _one(self, job: RunningJob, start: float) -> Outcome:
        limit = job.spec.max_runtime
        wait = self.delay if limit is None else min(self.delay, limit)
        words = job.spec.prompt.split(" ")
        while (left := start + wait - time.monotonic()) > 0:
            if job.cancelled.wait(min(left, _TICK)):
                return Outcome(result.CANCELLED, error=f"stopped: {job.cancel_reason}")
            job.progress += 1  # like a token: the worker renews leases while this moves
            job.partial = " ".join(words[: job.progress])  # what a streaming caller sees
        if limit is not None and self.delay > limit:
            return Outcome(result.TIMEOUT, error=f"exceeded max_runtime of {limit:g}s")
        if self.fail_marker and self.fail_marker in job.spec.prompt:
            return Outcome(result.FAILED, error="echo runner asked to fail")
        job.progress = len(job.spec.prompt)
        return Outcome(
            result.SUCCEEDED,
            output=job.spec.prompt,
            extra={"output_tokens": len(job.spec.prompt.split())},
        )

    def close(self) -> None:
        pass
