"""Aging: a job that has waited long enough is dispatched as the next priority up, so under a
constant load of urgent jobs the others still move (opt-in per queue: ``promote_after``).

Only each lane's first unclaimed entry ages (a tenant's jobs keep their order): every
``promote_after`` seconds it has waited since its ZooKeeper ``ctime`` take it one band up, at
most to the first. The head reads the ctimes it does not know (``unaged``) once a turn; the view
(``zkqueue.dispatch.view``) puts the promoted entries first in the band they reached, oldest
first (``promoted``).
"""

from __future__ import annotations

from collections.abc import Sequence

from zkqueue.protocol.layout import EntryName, lane_parts

#: Each lane's path and its first unclaimed entry (None: none listed).
Firsts = Sequence[tuple[str, EntryName | None]]


def unaged(
    firsts: Firsts, ctimes: dict[tuple[str, str], float], priorities: Sequence[str]
) -> list[tuple[str, EntryName]]:
    """(lane, entry) of each lane's first entry below the first priority whose ctime is not
    known yet (aging needs it)."""
    return [
        (path, first)
        for path, first in firsts
        if first is not None
        and lane_parts(path)[0] != priorities[0]
        and (path, first.name) not in ctimes
    ]


def promoted(
    firsts: Firsts,
    ctimes: dict[tuple[str, str], float],
    priorities: Sequence[str],
    now: float,
    promote_after: float,
) -> list[tuple[int, float, str, EntryName]]:
    """(band reached, ctime, priority, entry) of each lane's first entry that aging takes up
    at least one priority at wall-clock time ``now``."""
    found = []
    for path, first in firsts:
        priority = lane_parts(path)[0]
        rank = priorities.index(priority)
        ctime = ctimes.get((path, first.name)) if first is not None else None
        if rank == 0 or first is None or ctime is None:
            continue
        steps = int(max(0.0, now - ctime) // promote_after)
        if steps > 0:
            found.append((max(0, rank - steps), ctime, priority, first))
    return found
