"""The head's view of a queue: pending entries in dispatch order and the set of claimed ones,
kept current by child watches that only the head of the line sets."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import WatchedEvent

from zkqueue import defaults
from zkqueue.errors import InvalidJob
from zkqueue.layout import EntryName, Layout

log = logging.getLogger("zkq.view")
CLAIMS = "claims"


@dataclass(eq=False)
class _Watch:
    """A stable callable per watched path: kazoo keeps watchers in a set, so re-arming the same
    object never stacks duplicate callbacks."""

    part: str
    view: PendingView

    def __call__(self, event: WatchedEvent) -> None:
        self.view.events += 1
        self.view.on_change(self.part)


@dataclass(eq=False)
class PendingView:
    zk: KazooClient
    layout: Layout
    queue: str
    on_change: Callable[[str], None]
    entries: dict[str, list[EntryName]] = field(default_factory=dict)
    malformed: dict[str, list[str]] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)
    events: int = 0

    def __post_init__(self) -> None:
        self._dirty: set[str] = {*defaults.PRIORITIES, CLAIMS}
        self._watches = {p: _Watch(p, self) for p in (*defaults.PRIORITIES, CLAIMS)}

    def invalidate(self, part: str | None = None) -> None:
        """Mark one part (a priority or "claims"), or everything, to be re-read."""
        if part is None:
            self._dirty = {*defaults.PRIORITIES, CLAIMS}
        else:
            self._dirty.add(part)

    def refresh(self) -> None:
        """Re-list what changed since the last refresh, re-arming each part's watch."""
        dirty, self._dirty = self._dirty, set()
        calls = {
            part: self.zk.get_children_async(self._path(part), watch=self._watches[part])
            for part in dirty
        }
        for part, call in calls.items():
            try:
                names = call.get()
            except NoNodeError:
                names = []
            if part == CLAIMS:
                self.claimed = set(names)
            else:
                self._store(part, names)

    def candidates(self, exclude: set[str]) -> Iterator[tuple[str, EntryName]]:
        """Unclaimed entries in dispatch order: priority rank, then sequence as a number."""
        for priority in defaults.PRIORITIES:
            for entry in self.entries.get(priority, []):
                if entry.name not in self.claimed and entry.name not in exclude:
                    yield priority, entry

    def drop(self, priority: str, entry: EntryName) -> None:
        """Forget an entry we just claimed or removed (its watch event will confirm it)."""
        entries = self.entries.get(priority, [])
        if entry in entries:
            entries.remove(entry)

    def _store(self, priority: str, names: list[str]) -> None:
        parsed, bad = [], []
        for name in names:
            try:
                parsed.append(EntryName.parse(name))
            except InvalidJob:
                bad.append(name)
        parsed.sort(key=lambda e: e.order)
        self.entries[priority] = parsed
        self.malformed[priority] = bad

    def _path(self, part: str) -> str:
        if part == CLAIMS:
            return self.layout.claims(self.queue)
        return self.layout.pending(self.queue, part)
