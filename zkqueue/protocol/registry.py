"""The worker registry: one EPHEMERAL node per live worker, refreshed every few seconds."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from zkqueue.errors import ConfigurationError, CorruptRecord
from zkqueue.protocol.layout import Layout
from zkqueue.protocol.result import read_json

log = logging.getLogger("zkq.registry")


@dataclass
class WorkerRecord:
    """What a worker tells the cluster about itself (JSON at <root>/workers/<id>)."""

    id: str
    queue: str
    runner: str
    slots_max: int
    #: Jobs it holds at most while it runs a high-priority job (None: ``slots_max``).
    high_width: int | None = None
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    state: str = "starting"
    slots_busy: int = 0
    #: Jobs this worker finished since it started, and how many of those did not succeed.
    completed: int = 0
    failed: int = 0
    #: Jobs this worker gave back to the queue for a more urgent one since it started.
    preempted: int = 0
    #: Jobs it finished a second over about the last minute (a producer's start estimate).
    rate: float = 0.0
    #: Where it serves its jobs' streams (the base of the claims' ``stream`` URLs), or None.
    streams: str | None = None
    running: list[str] = field(default_factory=list)
    #: Runner figures: model, device, dtype, weight_bytes...
    runner_info: dict[str, Any] = field(default_factory=dict)
    #: A worker in front of an inference server: its dispatch gate ("open", "busy" or "down")
    #: and the server's figures where it publishes them (engine, waiting, running, kv_use).
    engine: dict[str, Any] | None = None
    #: Memory figures in bytes when known: total, free, reserved, capacity.
    memory: dict[str, Any] | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


class Registry:
    """Registers one worker and keeps its record current."""

    def __init__(self, zk: KazooClient, layout: Layout, record: WorkerRecord) -> None:
        self.zk = zk
        self.layout = layout
        self.record = record
        #: The record as last written, ``updated_at`` aside.
        self._written = b""

    @property
    def path(self) -> str:
        return self.layout.worker(self.record.id)

    def session_lifetime(self) -> float:
        """Seconds a crashed predecessor's ephemeral nodes may linger (a session's timeout)."""
        return float(getattr(self.zk, "_session_timeout", 10000)) / 1000 + 1

    def register(self, wait: float = 0.0) -> None:
        """Create the node. A node left by an earlier session with this worker's name (a crashed
        process restarted by systemd) is waited out for up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            self.record.updated_at = time.time()
            self._written = self._content()
            try:
                self.zk.create(self.path, self.record.to_bytes(), ephemeral=True, makepath=True)
                return
            except NodeExistsError:
                stat = self.zk.exists(self.path)
                if stat is not None and stat.ephemeralOwner == self.zk.client_id[0]:
                    self.zk.set(self.path, self.record.to_bytes())
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConfigurationError(
                        f"worker name {self.record.id!r} is in use by a live worker"
                    ) from None
                log.info(
                    "worker name %s is held by a previous session; waiting up to %.0fs for it "
                    "to expire",
                    self.record.id,
                    left,
                )
                _wait_gone(self.zk, self.path, left)

    def update(self) -> None:
        self.record.updated_at = time.time()
        self._written = self._content()
        try:
            self.zk.set(self.path, self.record.to_bytes())
        except NoNodeError:
            self.register()

    def update_if_changed(self) -> bool:
        """Rewrite the record only if it changed since the last write (``updated_at`` aside):
        the node's existence already says the worker is alive. Returns whether it wrote."""
        if self._content() == self._written:
            return False
        self.update()
        return True

    def _content(self) -> bytes:
        return replace(self.record, updated_at=0.0).to_bytes()

    def unregister(self) -> None:
        with contextlib.suppress(NoNodeError):
            self.zk.delete(self.path)


def _wait_gone(zk: KazooClient, path: str, timeout: float) -> None:
    gone = threading.Event()
    if zk.exists(path, watch=lambda _e: gone.set()) is None:
        return
    gone.wait(max(timeout, 0.0))


def read_records(zk: KazooClient, layout: Layout) -> list[dict[str, Any]]:
    """Every live worker's registration, by worker id (pipelined reads). A node that vanished
    meanwhile, or whose data is not JSON, is left out."""
    try:
        names = sorted(zk.get_children(layout.workers()))
    except NoNodeError:
        return []
    calls = [zk.get_async(layout.worker(n)) for n in names]
    records = []
    for call in calls:
        try:
            records.append(read_json(call.get()[0], "worker registration"))
        except (NoNodeError, CorruptRecord):
            continue
    return records
