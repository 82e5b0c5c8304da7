"""What one worker did so far: the counters ``Worker.stats`` reads together from its parts."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    failed: int = 0
    fenced: int = 0
    released: int = 0
    dead_lettered: int = 0
    rejected: int = 0
    #: Jobs the runner gave back because its engine failed (out of memory, a dead loop).
    out_of_memory: int = 0
    #: Jobs given back for a more urgent one (workers.preemption).
    preempted: int = 0
    #: Watch notifications this worker's session received (line, view, running entries).
    watch_events: int = 0

    def __str__(self) -> str:
        shown = {k: v for k, v in asdict(self).items() if v and k != "watch_events"}
        return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in shown.items()) or "no jobs"
