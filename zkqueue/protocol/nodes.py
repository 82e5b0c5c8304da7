"""Small reads and plain writes the transitions need: this session's own ephemeral nodes, the
expiry index's tick buckets, a node's children or the nodes below it, a priority's tail bucket,
a pipelined read's data."""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from zkqueue.protocol.layout import Layout, child, expiry_tick


def data_of(call: Any) -> bytes | None:
    """A pipelined read's data (None: no such node)."""
    try:
        data, _ = call.get()
    except NoNodeError:
        return None
    return data or b""


def own_untracked(zk: KazooClient, directory: str, known: set[str]) -> list[str]:
    """Names of the ephemeral nodes in ``directory`` owned by this session but not in
    ``known``: what a create or multi left behind when its reply was lost."""
    try:
        names = zk.get_children(directory)
    except NoNodeError:
        return []
    session = zk.client_id[0]
    calls = [(n, zk.exists_async(child(directory, n))) for n in names if n not in known]
    return [n for n, call in calls if (s := call.get()) is not None and s.ephemeralOwner == session]


def children(zk: KazooClient, path: str) -> list[str]:
    """The names of ``path``'s children; none when ``path`` does not exist."""
    try:
        return list(zk.get_children(path))
    except NoNodeError:
        return []


def descendants(zk: KazooClient, path: str, limit: int) -> list[str]:
    """Every node below ``path``, deepest first (at most ``limit``): delete order."""
    found: list[str] = []
    stack = [path]
    while stack and len(found) < limit:
        parent = stack.pop()
        try:
            kids = [child(parent, k) for k in zk.get_children(parent)]
        except NoNodeError:
            continue
        found.extend(kids)
        stack.extend(kids)
    return sorted(found[:limit], key=lambda p: p.count("/"), reverse=True)


class Ticks:
    """The expiry index's buckets this client knows exist (one create per tick, ~10 s)."""

    def __init__(self) -> None:
        self._known: set[str] = set()

    def ensure(self, zk: KazooClient, layout: Layout, queue: str, finished_at: float) -> None:
        path = layout.expiry_bucket(queue, expiry_tick(finished_at))
        if path in self._known:
            return
        with suppress(NodeExistsError):
            zk.create(path, b"", makepath=True)
        self._known.add(path)
        if len(self._known) > 64:
            self._known = {path}

    def forget(self) -> None:
        """A write failed: a bucket may be gone (expired); create them again."""
        self._known.clear()


def read_tail(zk: KazooClient, layout: Layout, queue: str, priority: str) -> tuple[int, int]:
    """A priority's tail bucket and the version of the node that names it."""
    data, stat = zk.get(layout.pending(queue, priority))
    # A node created without data (zkCli.sh's create with no value) reads as None.
    text = (data or b"").decode("ascii", "replace").strip()
    return (int(text) if text.isdigit() else 0), stat.version
