"""Admission: may this worker take this job now (a slot is free and its memory need fits), later
(it fits an idle worker like this one), or never (it is bigger than this worker can ever hold)?"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from zkqueue.spec import JobSpec


class Verdict(enum.Enum):
    ADMIT = "admit"
    WAIT = "wait"
    NEVER = "never"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    need: int = 0
    reason: str = ""


class Admission:
    """Slot counting is the worker's; this judges memory. Without an estimator every job fits."""

    def __init__(
        self,
        estimate: Callable[[JobSpec], int] | None = None,
        free: Callable[[], int] | None = None,
        capacity: int | None = None,
        validate: Callable[[JobSpec], str | None] | None = None,
    ) -> None:
        self._estimate = estimate
        self._free = free
        #: The largest need this worker could ever hold (idle, weights resident, reserve kept).
        self.capacity = capacity
        self._validate = validate

    def judge(self, spec: JobSpec, planned: int = 0) -> Decision:
        """``planned`` is memory already promised to jobs picked earlier in this turn."""
        if self._validate is not None:
            problem = self._validate(spec)
            if problem:
                return Decision(Verdict.NEVER, 0, problem)
        if self._estimate is None:
            return Decision(Verdict.ADMIT)
        need = self._estimate(spec)
        if self.capacity is not None and need > self.capacity:
            return Decision(
                Verdict.NEVER,
                need,
                f"needs {need} bytes; this worker holds at most {self.capacity}",
            )
        free = self._free() - planned if self._free is not None else need
        if need > free:
            return Decision(Verdict.WAIT, need, f"needs {need} bytes; {free} free")
        return Decision(Verdict.ADMIT, need)
