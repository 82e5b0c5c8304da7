"""Counting what crosses the wire, per process: ZooKeeper requests by type (each one round trip),
the operations inside each multi, and watch notifications received. kazoo is patched once per
process (``install``); the library itself is untouched. Also per-thread CPU and method timers."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Watch

#: Request types that change state: each is one write round trip (a multi is one transaction).
WRITES = frozenset(
    {"Create", "Create2", "Delete", "SetData", "Transaction", "CheckVersion", "SetACL"}
)
#: Request types that only read (sync is a read barrier; it writes nothing).
READS = frozenset(
    {"Exists", "GetData", "GetChildren", "GetChildren2", "GetACL", "Sync", "GetEphemerals"}
)
_WATCH_TYPES = {1: "created", 2: "deleted", 3: "changed", 4: "child"}

_lock = threading.Lock()
_requests: Counter[str] = Counter()
_multi_ops: Counter[str] = Counter()
_watches: Counter[str] = Counter()
_installed = False


def install() -> None:
    """Patch KazooClient._call and the watch reader of this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    call = KazooClient._call
    read_watch = ConnectionHandler._read_watch_event

    def counting_call(self: KazooClient, request: Any, async_object: Any) -> Any:
        kind = type(request).__name__
        with _lock:
            _requests[kind] += 1
            if kind == "Transaction":
                _multi_ops.update(type(op).__name__ for op in request.operations)
        return call(self, request, async_object)

    def counting_watch(self: ConnectionHandler, buffer: bytes, offset: int) -> Any:
        watch, _ = Watch.deserialize(buffer, offset)
        key = f"{_WATCH_TYPES.get(watch.type, str(watch.type))} {_path_kind(watch.path)}"
        with _lock:
            _watches[key] += 1
        return read_watch(self, buffer, offset)

    KazooClient._call = counting_call
    ConnectionHandler._read_watch_event = counting_watch


def _path_kind(path: str) -> str:
    """What a watched path is, in zkq's layout (or kazoo LockingQueue's)."""
    parts = path.rsplit("/", 4)
    if len(parts) >= 2 and parts[-2] == "line":
        return "line node"
    if parts[-1] in ("claims", "taken", "entries", "line"):
        return f"{parts[-1]}/"
    if parts[-1] in ("high", "normal", "low") and len(parts) >= 2 and parts[-2] == "pending":
        return "pending/<priority>/"
    if len(parts) >= 3 and parts[-3] == "pending":
        return "pending/<priority>/<bucket>/"
    if len(parts) >= 4 and parts[-4] == "pending":
        return "entry"
    if len(parts) >= 3 and parts[-3] == "results":
        return "result"
    if len(parts) >= 2 and parts[-2] == "claims":
        return "claim"
    return "other"


def snapshot() -> dict[str, Any]:
    """Absolute counters of this process so far (subtract two snapshots for a window)."""
    with _lock:
        return {
            "requests": dict(_requests),
            "multi_ops": dict(_multi_ops),
            "watches": dict(_watches),
        }


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """after - before, recursively for dicts of numbers."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = delta(value, before.get(key, {}))
        elif isinstance(value, int | float):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    return out


def add(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """total + part, recursively for dicts of numbers (returns a new dict)."""
    out = dict(total)
    for key, value in part.items():
        if isinstance(value, dict):
            out[key] = add(out.get(key, {}), value)
        elif isinstance(value, int | float):
            out[key] = out.get(key, 0) + value
    return out


def split_requests(requests: dict[str, int]) -> tuple[int, int]:
    """(reads, writes) round trips."""
    reads = sum(n for k, n in requests.items() if k in READS)
    writes = sum(n for k, n in requests.items() if k in WRITES)
    return reads, writes


# -- CPU ------------------------------------------------------------------------------------


def _thread_role(name: str) -> str:
    if "zk_loop" in name:
        return "kazoo_io"
    if "_thread_worker" in name:
        return "kazoo_callbacks"
    if name.startswith("zkq-run"):
        return "executor"
    if name.startswith("bench-"):
        return name[len("bench-") :]
    return "other"


def thread_cpu() -> dict[str, float]:
    """CPU seconds by thread role (kazoo I/O, kazoo callbacks, loop, executor...) and total.
    Threads that ended are only in the total."""
    tick = os.sysconf("SC_CLK_TCK")
    roles: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = _thread_role(thread.name)
        roles[role] = roles.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    times = os.times()
    return {**roles, "total": times.user + times.system}


# -- timers ---------------------------------------------------------------------------------


class Timers:
    """Durations of wrapped calls, by name (count, total and a capped list of samples)."""

    def __init__(self, cap: int = 20000) -> None:
        self.cap = cap
        self.samples: dict[str, list[float]] = {}
        self.totals: dict[str, float] = {}
        self.counts: Counter[str] = Counter()

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.counts[name] += 1
        bucket = self.samples.setdefault(name, [])
        if len(bucket) < self.cap:
            bucket.append(seconds)

    def wrap(self, obj: Any, method: str, name: str | None = None) -> None:
        """Replace ``obj.method`` by a timed wrapper (on this instance only); a method the
        library no longer has is left out."""
        original: Callable[..., Any] | None = getattr(obj, method, None)
        if original is None:
            return
        key = name or method

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)

        setattr(obj, method, timed)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "count": self.counts[name],
                "total_s": self.totals.get(name, 0.0),
                "p50_ms": _median(self.samples.get(name, [])) * 1e3,
            }
            for name in self.counts
        }


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
