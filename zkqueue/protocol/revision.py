"""The protocol revision of a root (the version of its znode layout): ``<root>/protocol`` holds
it (``"3"``). A root without the marker and without queues is new (the marker is written); one
with queues but no marker was written by revision 1 (flat pending and results directories), one
marked ``2`` by revision 2 (no tenants' lanes, whose ``@<tenant>`` directories its workers would
take for garbage). Both are refused, never misread: ``zkq migrate`` moves them."""

from __future__ import annotations

from contextlib import suppress

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from zkqueue.errors import ProtocolMismatch
from zkqueue.protocol.layout import PROTOCOL_VERSION, Layout


def read_version(zk: KazooClient, layout: Layout) -> int | None:
    """The root's layout version: None for an empty root, 1 for an unmarked one with queues."""
    try:
        data, _ = zk.get(layout.protocol())
    except NoNodeError:
        has_queues = zk.exists(layout.queues())
        return 1 if has_queues is not None and has_queues.numChildren else None
    # A node created without data (zkCli.sh's create with no value) reads as None.
    text = (data or b"").decode("utf-8", "replace").strip()
    return int(text) if text.isdigit() else -1


def ensure(zk: KazooClient, layout: Layout) -> None:
    """Check the root speaks this layout (marking a new root); ProtocolMismatch otherwise."""
    version = read_version(zk, layout)
    if version is None:
        with suppress(NodeExistsError):
            zk.create(layout.protocol(), str(PROTOCOL_VERSION).encode(), makepath=True)
        version = read_version(zk, layout)
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(mismatch(layout, version))


def mismatch(layout: Layout, version: int | None) -> str:
    root = layout.root or "/"
    if version == 2:
        return (
            f"root {root} was written by zkq protocol version 2 (before tenants); stop its "
            f"workers and run `zkq migrate --root {root}` to move it to version "
            f"{PROTOCOL_VERSION}"
        )
    if version == 1:
        return (
            f"root {root} was written by zkq protocol version 1 (flat pending and results "
            f"directories); stop its workers and run `zkq migrate --root {root}` to move it "
            f"to version {PROTOCOL_VERSION}"
        )
    return (
        f"root {root} holds protocol version {version}; this zkq speaks version "
        f"{PROTOCOL_VERSION} only"
    )


def ensure_dirs(zk: KazooClient, layout: Layout, queue: str, *, all_of: bool = False) -> None:
    """Create a queue's directories (pipelined) unless its last one exists (``all_of``: each
    one missing, whatever exists)."""
    dirs = layout.queue_dirs(queue)
    if not all_of and zk.exists(dirs[-1]) is not None:
        return
    with suppress(NodeExistsError):
        zk.create(layout.queue(queue), makepath=True)
    calls = [zk.create_async(path) for path in dirs]
    for call in calls:
        with suppress(NodeExistsError):
            call.get()
