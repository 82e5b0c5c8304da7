"""Removing a watch before the change it would report: ZooKeeper's removeWatches (3.5+), which
kazoo 2.11 does not expose. A worker drops the watch on a running job's entry just before its own
completion deletes that entry, so a job's own end notifies nobody; the request goes in the same
flush as the completion (one session's requests are served in order), costing no round trip."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.serialization import int_struct, write_string

#: ZooKeeper's opcode of removeWatches, and its watcher types (children; data: exists, get).
_REMOVE_WATCHES = 18
_CHILDREN = 1
_DATA = 2


class _RemoveWatches(namedtuple("_RemoveWatches", "path watcher_type")):
    type = _REMOVE_WATCHES

    def serialize(self) -> bytearray:
        b = bytearray()
        b.extend(write_string(self.path))
        b.extend(int_struct.pack(self.watcher_type))
        return b

    @classmethod
    def deserialize(cls, _bytes: bytes, _offset: int) -> bool:
        return True


def remove_data_watch(zk: KazooClient, path: str, watch: Callable[..., Any]) -> Any:
    """Drop this session's data watches on ``path`` on the server, and ``watch`` from kazoo's
    own table (else it would stay there until the path changes again). Returns the async
    result; a NoWatcherError from it means the watch had already fired."""
    return _remove(zk, zk._data_watchers, path, watch, _DATA)


def remove_child_watch(zk: KazooClient, path: str, watch: Callable[..., Any]) -> Any:
    """The same for a child watch (``get_children`` with a watch)."""
    return _remove(zk, zk._child_watchers, path, watch, _CHILDREN)


def forget_data_watch(zk: KazooClient, path: str, watch: Callable[..., Any]) -> None:
    """Drop ``watch`` from kazoo's table only (without a connection: a reconnect then does not
    set it again on the server)."""
    _forget(zk._data_watchers, path, watch)


def _forget(table: Any, path: str, watch: Any) -> None:
    watchers = table.get(path)
    if watchers is not None:
        watchers.discard(watch)
        if not watchers:
            table.pop(path, None)


def _remove(zk: KazooClient, table: Any, path: str, watch: Any, kind: int) -> Any:
    _forget(table, path, watch)
    result = zk.handler.async_result()
    zk._call(_RemoveWatches(path, kind), result)
    return result
