"""A line of ephemeral-sequential nodes, each member watching only its predecessor.

Idle workers stand in a queue's line, so a new job wakes the head alone and a departing head
wakes one successor. The janitor's leader election is the same line under another directory."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import WatchedEvent

from zkqueue.protocol.claims import step_aside
from zkqueue.protocol.layout import child, is_line_member, line_order, member_prefix

log = logging.getLogger("zkq.line")


class Line:
    """One member's place in a line. Not thread safe: one thread (the worker loop) owns it."""

    def __init__(
        self,
        zk: KazooClient,
        directory: str,
        worker_id: str,
        on_change: Callable[[], None],
        on_missing: Callable[[], None] | None = None,
    ) -> None:
        self.zk = zk
        #: Makes the line's directory again when a join finds it gone (its queue was deleted).
        self._on_missing = on_missing
        self.directory = directory
        self.worker_id = worker_id
        self.node: str | None = None
        self._on_change = on_change
        self._watching: str | None = None
        #: Cached answer of is_head(); None means ask ZooKeeper again.
        self._head: bool | None = None
        #: Whether we are likely head when that is unknown: the predecessor left, or we
        #: (re)joined a line we were alone in at the last look.
        self._likely = False
        self._alone = False

    @property
    def joined(self) -> bool:
        return self.node is not None

    def join(self) -> None:
        try:
            path = self._create()
        except NoNodeError:
            if self._on_missing is None:
                raise
            self._on_missing()
            path = self._create()
        self.node = path.rsplit("/", 1)[1]
        self._head = None
        self._likely = self._alone

    def _create(self) -> str:
        prefix, me = member_prefix(self.directory), self.worker_id.encode()
        return str(self.zk.create(prefix, me, ephemeral=True, sequence=True))

    def leave(self) -> None:
        if self.node is None:
            return
        with contextlib.suppress(NoNodeError):
            self.zk.delete(child(self.directory, self.node))
        self.node = None
        self._head = None

    def step_aside(self) -> None:
        """Go to the back of the line in one multi (leave and join again): the head does when
        it leaves a job for a bigger worker standing behind it, which would otherwise never
        be head while this one keeps a free slot."""
        if self.node is None:
            return
        if not step_aside(self.zk, self):  # our node went meanwhile (a lost session)
            self.node = None
            self.join()

    def members(self) -> list[str]:
        """The worker ids standing in the line, in order (each member's data)."""
        names = _ordered(self._names(self.zk.get_children_async(self.directory)))
        calls = [self.zk.get_async(child(self.directory, n)) for n in names]
        ids = []
        for call in calls:
            with contextlib.suppress(NoNodeError):
                ids.append(call.get()[0].decode(errors="replace"))
        return ids

    def forget(self) -> None:
        """The session is gone, and the node with it."""
        self.node = None
        self._watching = None
        self._head = None

    # -- inside claim/complete transactions -------------------------------------------------

    def add_leave(self, txn: TransactionRequest) -> None:
        if self.node is not None:
            txn.delete(child(self.directory, self.node))

    def add_join(self, txn: TransactionRequest) -> None:
        txn.create(
            member_prefix(self.directory),
            self.worker_id.encode(),
            ephemeral=True,
            sequence=True,
        )

    def committed(self, left: bool, joined_path: Any) -> None:
        """Record what a committed transaction did to our place in the line."""
        if left:
            self.node = None
            self._head = None
        if isinstance(joined_path, str):
            self.node = joined_path.rsplit("/", 1)[1]
            self._head = None
            self._likely = self._alone

    # -- head ---------------------------------------------------------------------------------

    def is_head(self) -> bool:
        """True when our node is first; otherwise watch the predecessor and return False."""
        if self._head is None:
            self._head = self._ask_head()
        return self._head

    @property
    def known(self) -> bool | None:
        """The cached answer of is_head(), None when it must be asked again."""
        return self._head

    def ask_async(self) -> Any:
        """Start listing the line when whether we are head is unknown but likely, so that the
        caller can send its own reads in the same round trip; ``settle`` takes the answer.
        None otherwise: then is_head() answers first."""
        if self._head is not None or self.node is None or not self._likely:
            return None
        return self.zk.get_children_async(self.directory)

    def settle(self, call: Any) -> bool:
        """is_head() from a listing started by ``ask_async``."""
        if call is not None and self._head is None:
            place = self._place(self._names(call))
            self._head = self._ask_head() if place is None else place
        return self.is_head()

    def _ask_head(self) -> bool:
        while self.node is not None:
            place = self._place(self._names(self.zk.get_children_async(self.directory)))
            if place is not None:
                return place
        return False

    def _names(self, call: Any) -> list[str]:
        """The line's members from a listing; none when the line itself is gone (its queue was
        deleted: our node went with it, and the caller makes the line again to rejoin)."""
        try:
            names: list[str] = call.get()
        except NoNodeError:
            return []
        return names

    def _place(self, names: list[str]) -> bool | None:
        """Whether we are first among ``names``; if not, watch the predecessor (None: it left
        meanwhile, list again)."""
        ordered = _ordered(names)
        self._alone = len(ordered) == 1
        self._likely = False
        if self.node not in ordered:
            self.node = None  # deleted behind our back (session loss); the loop rejoins
            return False
        index = ordered.index(self.node)
        if index == 0:
            return True
        predecessor = ordered[index - 1]
        if predecessor == self._watching:
            return False  # already watching it: a watch is set once per node
        path = child(self.directory, predecessor)
        if self.zk.exists(path, watch=self._predecessor_gone) is not None:
            self._watching = predecessor
            return False
        return None

    def recheck(self) -> bool:
        """Whether we were head at the last look; if so, ask again at the next is_head(). A
        head watches no one, so its place can go unnoticed (an expired session, a deleted
        queue) while another member becomes head: its owner calls this now and then."""
        if not self._head:
            return False
        self.invalidate()
        return True

    def invalidate(self) -> None:
        """Called by the loop (never from a watch thread) after a line event: ask again."""
        self._watching = None
        self._head = None
        self._likely = True

    def _predecessor_gone(self, event: WatchedEvent) -> None:
        self._on_change()


def _ordered(names: list[str]) -> list[str]:
    """The line's members among a listing's ``names``, first first."""
    return sorted((c for c in names if is_line_member(c)), key=line_order)
