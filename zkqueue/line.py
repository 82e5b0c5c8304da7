"""The worker line: idle workers stand in a line of ephemeral-sequential nodes, each watching only
its predecessor, so a new job wakes the head alone and a departing head wakes one successor."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import WatchedEvent

from zkqueue.layout import LINE_PREFIX, Layout, line_order

log = logging.getLogger("zkq.line")


class Line:
    """This worker's place in one queue's line. Not thread safe: the worker loop owns it."""

    def __init__(
        self,
        zk: KazooClient,
        layout: Layout,
        queue: str,
        worker_id: str,
        on_change: Callable[[], None],
    ) -> None:
        self.zk = zk
        self.layout = layout
        self.queue = queue
        self.worker_id = worker_id
        self.node: str | None = None
        self._on_change = on_change
        self._watching: str | None = None
        #: Cached answer of is_head(); None means ask ZooKeeper again.
        self._head: bool | None = None

    @property
    def joined(self) -> bool:
        return self.node is not None

    def join(self) -> None:
        path = self.zk.create(
            self.layout.line_prefix(self.queue),
            self.worker_id.encode(),
            ephemeral=True,
            sequence=True,
        )
        self.node = path.rsplit("/", 1)[1]
        self._head = None

    def leave(self) -> None:
        if self.node is None:
            return
        with contextlib.suppress(NoNodeError):
            self.zk.delete(self.layout.line_node(self.queue, self.node))
        self.node = None
        self._head = None

    def forget(self) -> None:
        """The session is gone, and the node with it."""
        self.node = None
        self._watching = None
        self._head = None

    # -- inside claim/complete transactions -------------------------------------------------

    def add_leave(self, txn: TransactionRequest) -> None:
        if self.node is not None:
            txn.delete(self.layout.line_node(self.queue, self.node))

    def add_join(self, txn: TransactionRequest) -> None:
        txn.create(
            self.layout.line_prefix(self.queue),
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

    # -- head ---------------------------------------------------------------------------------

    def is_head(self) -> bool:
        """True when our node is first; otherwise watch the predecessor and return False."""
        if self._head is None:
            self._head = self._ask_head()
        return self._head

    def _ask_head(self) -> bool:
        while self.node is not None:
            children = [
                c
                for c in self.zk.get_children(self.layout.line(self.queue))
                if c.startswith(LINE_PREFIX)
            ]
            ordered = sorted(children, key=line_order)
            if self.node not in ordered:
                self.node = None  # deleted behind our back (session loss); the loop rejoins
                return False
            index = ordered.index(self.node)
            if index == 0:
                return True
            predecessor = ordered[index - 1]
            if predecessor == self._watching:
                return False  # already watching it: a watch is set once per node
            path = self.layout.line_node(self.queue, predecessor)
            if self.zk.exists(path, watch=self._predecessor_gone) is not None:
                self._watching = predecessor
                return False
        return False

    def invalidate(self) -> None:
        """Called by the loop (never from a watch thread) after a line event: ask again."""
        self._watching = None
        self._head = None

    def _predecessor_gone(self, event: WatchedEvent) -> None:
        self._on_change()
