"""The echo runner: returns each prompt (a chat's messages in the plain format) as its output
after a delay, a word per token, cut at ``max_new_tokens``. It exists for smoke tests and
benchmarks and goes through every code path of the model runner except generation."""

from __future__ import annotations

import time
from typing import Any

from workers.runners.base import Outcome, RunningJob, ThreadedRunner
from zkqueue import defaults
from zkqueue.protocol.result import Status

#: Seconds between the echo runner's progress ticks.
_TICK = 0.25


class EchoRunner(ThreadedRunner):
    name = "echo"

    def __init__(self, delay: float = defaults.ECHO_DELAY, fail_marker: str | None = None) -> None:
        super().__init__()
        self.delay = delay
        #: A prompt containing this text fails (for exercising failure paths).
        self.fail_marker = fail_marker

    def describe(self) -> dict[str, Any]:
        return {"runner": "echo", "delay": self.delay}

    def run_one(self, job: RunningJob) -> Outcome:
        start = time.monotonic()
        limit = job.spec.max_runtime
        wait = self.delay if limit is None else min(self.delay, limit)
        text = job.spec.text
        words = text.split(" ")
        while (left := start + wait - time.monotonic()) > 0:
            if job.cancelled.wait(min(left, _TICK)):
                return Outcome(Status.CANCELLED, error=f"stopped: {job.cancel_reason}")
            job.progress += 1  # like a token: the worker renews leases while this moves
            job.add_text(" ".join(words[: job.progress]))  # what a streaming caller sees
        if limit is not None and self.delay > limit:
            return Outcome(Status.TIMEOUT, error=f"exceeded max_runtime of {limit:g}s")
        if self.fail_marker and self.fail_marker in text:
            return Outcome(Status.FAILED, error="echo runner asked to fail")
        job.progress = len(text)
        # Like a model: a word is a token, and max_new_tokens cuts the output.
        limit = job.spec.max_new_tokens
        cut = len(words) > limit
        return Outcome(
            Status.SUCCEEDED,
            output=" ".join(words[:limit]) if cut else text,
            extra={
                "prompt_tokens": len(text.split()),
                "output_tokens": min(len(text.split()), limit),
                "finish_reason": "length" if cut else "stop",
            },
        )
