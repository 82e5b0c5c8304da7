"""Admission: may this worker take this job now (a slot is free and its memory need fits), later
(it fits an idle worker like this one), or never (it is bigger than this worker can ever hold)?"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workers.kvcache import format_size
from zkqueue.spec import JobSpec


class Verdict(enum.Enum):
    ADMIT = "admit"
    #: Fits an idle worker like this one: leave it pending.
    WAIT = "wait"
    #: Needs more memory than this worker can ever hold: leave it for a bigger worker.
    NEVER = "never"
    #: Can never run on this queue's model (prompt + max_new_tokens over its context): end it.
    REJECT = "reject"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    need: int = 0
    reason: str = ""


class Admission:
    """Slot counting is the worker's; this judges memory. Without an estimator every job fits."""

    def __init__(
        self,
        estimate: Callable[[Sequence[JobSpec]], int] | None = None,
        free: Callable[[], int] | None = None,
        capacity: int | None = None,
        validate: Callable[[JobSpec], str | None] | None = None,
        keep_free: int = 0,
    ) -> None:
        self._estimate = estimate
        self._free = free
        #: The largest need this worker could ever hold (idle, weights resident, reserve kept).
        self.capacity = capacity
        self._validate = validate
        #: Bytes kept free on the device whatever the estimates say (--vram-reserve).
        self.keep_free = keep_free

    def judge(self, spec: JobSpec, picked: Sequence[JobSpec] = ()) -> Decision:
        """Judge ``spec`` as one more row of a batch with the jobs ``picked`` earlier in this turn.
        ``estimate`` prices a whole batch (padding makes it more than the sum of its rows), and
        the decision's ``need`` is what this job adds to it."""
        if self._validate is not None:
            problem = self._validate(spec)
            if problem:
                return Decision(Verdict.REJECT, 0, problem)
        if self._estimate is None:
            return Decision(Verdict.ADMIT)
        need = self._estimate([spec])
        if self.capacity is not None and need > self.capacity:
            return Decision(
                Verdict.NEVER,
                need,
                f"needs {format_size(need)} ({need} bytes); this worker holds at most "
                f"{format_size(self.capacity)}",
            )
        batch = self._estimate([*picked, spec]) if picked else need
        added = batch - self._estimate(picked) if picked else need
        free = self._free() - self.keep_free if self._free is not None else batch
        if batch > free:
            return Decision(Verdict.WAIT, added, f"batch needs {batch} bytes; {free} free")
        return Decision(Verdict.ADMIT, added)
