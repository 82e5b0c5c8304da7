"""The worker loop's vocabulary: the events it handles (watches, the session listener, the runner
and signals post them from their own threads; only the loop's thread acts on them) and the states
it goes through."""

from __future__ import annotations

import enum


class Event(enum.StrEnum):
    """What the loop's queue carries (posted by watches, the listener, the runner, signals)."""

    LINE = "line"  # our predecessor in the line left
    PENDING = "pending"  # a pending priority or the claims changed (the head's view)
    ENTRY = "entry"  # a running job's entry changed or went (cancel, withdrawal, reclaim)
    DONE = "done"  # the runner reported a job's outcome
    STATE = "state"  # the session's state changed
    STOP = "stop"  # stop() was called (a signal)
    WAKE = "wake"  # look again (after a lost race or a reconnect)
    BUSY = "busy"  # our predecessor in a busy line left, or a line ahead of it changed
    URGENT = "urgent"  # a pending priority above our busy line's floor changed


#: Events that are watch notifications (counted in the stats).
WATCHES = (Event.LINE, Event.PENDING, Event.ENTRY, Event.BUSY, Event.URGENT)


class State(enum.StrEnum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
