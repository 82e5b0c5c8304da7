"""A queue's limits, stored on the queue's node so every producer and worker obeys the same ones.

``max_pending`` is backpressure: beyond it, submit fails fast with QueueFull (like an HTTP 429).
``max_running`` caps the jobs of the queue running at once across all workers: the head of the
line (the only claimer) claims no more than the cap leaves room for (``RunningCap``).
``tenants`` gives a tenant its fair-share ``weight`` (default 1) and its own ``max_pending``;
``promote_after`` turns on aging (``zkqueue.dispatch.share``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError

from zkqueue.errors import InvalidJob, QueueFull
from zkqueue.protocol import counts
from zkqueue.protocol.counts import tenant_waiting
from zkqueue.protocol.layout import DEFAULT_TENANT, Layout, check_tenant
from zkqueue.protocol.result import json_number

#: Seconds a producer trusts its copy of a queue's settings.
_CACHE_SECONDS = 5.0


#: The limits a queue may have, by field name.
LIMITS = ("max_pending", "max_running")
#: The largest limit: a signed 32-bit int, which any producer's JSON reader holds.
MAX_LIMIT = 2**31 - 1


#: The largest tenant weight (a weight is a share of service: 1000:1 is already extreme).
MAX_WEIGHT = 1000.0


@dataclass(frozen=True)
class TenantSettings:
    """One tenant's entry in a queue's settings: its fair-share weight and its own cap on
    jobs waiting."""

    weight: float = 1.0
    max_pending: int | None = None

    def to_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"weight": self.weight}
        if self.max_pending is not None:
            found["max_pending"] = self.max_pending
        return found

    @classmethod
    def from_raw(cls, raw: Any) -> TenantSettings:
        if not isinstance(raw, dict):
            return cls()
        weight = _number(raw.get("weight"))
        return cls(
            weight=weight if weight is not None and weight <= MAX_WEIGHT else 1.0,
            max_pending=_limit(raw.get("max_pending")),
        )


#: The settings of a tenant the queue's settings do not name (frozen: one serves all).
_DEFAULTS = TenantSettings()


@dataclass(frozen=True)
class QueueSettings:
    """JSON data of <root>/queues/<queue>: {"max_pending": N, "max_running": M} (absent or
    null: no limit), and optionally ``"promote_after": S`` (aging, seconds) and ``"tenants":
    {"<tenant>": {"weight": W, "max_pending": N}}``."""

    max_pending: int | None = None
    max_running: int | None = None
    promote_after: float | None = None
    tenants: dict[str, TenantSettings] = field(default_factory=dict)

    def tenant(self, name: str | None) -> TenantSettings:
        """A tenant's settings (the defaults for one the settings do not name)."""
        return self.tenants.get(name or DEFAULT_TENANT) or _DEFAULTS

    def weight(self, name: str) -> float:
        return self.tenant(name).weight

    def to_bytes(self) -> bytes:
        record: dict[str, Any] = {"max_pending": self.max_pending, "max_running": self.max_running}
        if self.promote_after is not None:
            record["promote_after"] = self.promote_after
        if self.tenants:
            record["tenants"] = {t: s.to_dict() for t, s in sorted(self.tenants.items())}
        return json.dumps(record).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> QueueSettings:
        try:
            raw = json.loads(data) if data else {}
        except (ValueError, UnicodeDecodeError):
            return cls()
        if not isinstance(raw, dict):
            return cls()
        tenants = raw.get("tenants")
        if not isinstance(tenants, dict):
            tenants = {}
        return cls(
            max_pending=_limit(raw.get("max_pending")),
            max_running=_limit(raw.get("max_running")),
            promote_after=_number(raw.get("promote_after")),
            tenants={str(t): TenantSettings.from_raw(v) for t, v in tenants.items()},
        )


def _number(value: Any) -> float | None:
    """A positive finite number from JSON, at least a millisecond's worth (None for anything
    else, a huge integer included)."""
    number = json_number(value)
    return number if number is not None and number >= 0.001 else None


def _limit(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


class Limits:
    """Reads (with a short cache) and writes queue settings, and checks room before a submit."""

    def __init__(self, zk: KazooClient, layout: Layout) -> None:
        self.zk = zk
        self.layout = layout
        self._cache: dict[str, tuple[float, QueueSettings]] = {}

    def settings(self, queue: str) -> QueueSettings:
        cached = self._cache.get(queue)
        if cached and time.monotonic() - cached[0] < _CACHE_SECONDS:
            return cached[1]
        try:
            data, _ = self.zk.get(self.layout.queue(queue))
            settings = QueueSettings.from_bytes(data)
        except NoNodeError:
            settings = QueueSettings()
        self._cache[queue] = (time.monotonic(), settings)
        return settings

    def set(self, queue: str, **limits: int | None) -> QueueSettings:
        """Change some limits (None removes one), keeping the others; returns the new settings.
        A concurrent change is retried against the new version, never overwritten blindly."""
        for name, value in limits.items():
            if name not in LIMITS:
                raise InvalidJob(f"unknown queue limit {name!r}")
            if value is not None and (isinstance(value, bool) or not 1 <= value <= MAX_LIMIT):
                raise InvalidJob(
                    f"{name.replace('_', ' ')} must be 1 to {MAX_LIMIT} (or none): producers in "
                    "other languages read it as a 32-bit int"
                )
        return self._change(queue, lambda s: replace(s, **limits))  # type: ignore[arg-type]

    def set_max_pending(self, queue: str, max_pending: int | None) -> None:
        self.set(queue, max_pending=max_pending)

    def set_promote_after(self, queue: str, seconds: float | None) -> QueueSettings:
        """Turn aging on (a job that waited ``seconds`` is dispatched a priority up, and one
        more per ``seconds`` more) or off (None)."""
        if seconds is not None and not 0 < seconds <= 86400 * 365:
            raise InvalidJob(f"promote after must be more than 0 seconds, not {seconds:g}")
        return self._change(queue, lambda s: replace(s, promote_after=seconds))

    def set_tenant(
        self,
        queue: str,
        tenant: str,
        weight: float | None = None,
        max_pending: int | None = None,
        *,
        remove: bool = False,
    ) -> QueueSettings:
        """Set a tenant's weight and cap (None keeps it unchanged), or forget its settings."""
        check_tenant(tenant)
        if weight is not None and not 0 < weight <= MAX_WEIGHT:
            raise InvalidJob(f"a tenant's weight must be more than 0 and at most {MAX_WEIGHT:g}")
        if max_pending is not None and not 1 <= max_pending <= MAX_LIMIT:
            raise InvalidJob(f"a tenant's max pending must be 1 to {MAX_LIMIT}")

        def change(settings: QueueSettings) -> QueueSettings:
            tenants = dict(settings.tenants)
            if remove:
                tenants.pop(tenant, None)
            else:
                old = tenants.get(tenant) or TenantSettings()
                tenants[tenant] = TenantSettings(
                    weight=old.weight if weight is None else float(weight),
                    max_pending=old.max_pending if max_pending is None else max_pending,
                )
            return replace(settings, tenants=tenants)

        return self._change(queue, change)

    def _change(
        self, queue: str, change: Callable[[QueueSettings], QueueSettings]
    ) -> QueueSettings:
        """Apply ``change`` to the settings, retried against a concurrent writer's version."""
        path = self.layout.queue(queue)
        while True:
            data, stat = self.zk.get(path)
            settings = change(QueueSettings.from_bytes(data))
            try:
                self.zk.set(path, settings.to_bytes(), version=stat.version)
            except BadVersionError:
                continue
            self._cache.pop(queue, None)
            return settings

    def waiting(self, queue: str) -> int:
        """Jobs not yet started (``counts.waiting``)."""
        return counts.waiting(self.zk, self.layout, queue)

    def check_room(self, queue: str, adding: int = 1, tenant: str | None = None) -> None:
        self.check_room_many(queue, {tenant: adding})

    def check_room_many(self, queue: str, adding: Mapping[str | None, int]) -> None:
        """``check_room`` for jobs of several tenants at once (``adding``: how many each): the
        queue's cap holds them all, each tenant's cap its own."""
        settings = self.settings(queue)
        if settings.max_pending is not None:
            check_counts(queue, settings.max_pending, self.waiting(queue), sum(adding.values()))
        for tenant, count in adding.items():
            cap = settings.tenant(tenant).max_pending
            if cap is not None:
                waiting = tenant_waiting(self.zk, self.layout, queue, tenant)
                check_counts(queue, cap, waiting, count, tenant=tenant or DEFAULT_TENANT)


def check_counts(
    queue: str, limit: int, waiting: int, adding: int = 1, tenant: str | None = None
) -> None:
    """Raise QueueFull when ``adding`` more jobs would put ``waiting`` over ``limit`` (shared by
    the blocking and the asyncio producers); ``tenant``: the limit is that tenant's (the
    default tenant's too: name it), else the queue's."""
    if waiting + adding > limit:
        whose = f"tenant {tenant!r} of queue {queue!r} is" if tenant else f"queue {queue!r} is"
        raise QueueFull(
            f"{whose} full: {waiting} jobs waiting, the limit is {limit}"
            f"{f' (this batch adds {adding})' if adding > 1 else ''}; try again later"
        )


class RunningCap:
    """A queue's ``max_running`` as the head of the line needs it: read once, then kept current
    by a data watch on the queue's node, so a turn costs no read. ``invalidate`` after a
    reconnect (watches may have been lost with the session)."""

    def __init__(self, zk: KazooClient, layout: Layout, queue: str) -> None:
        self.zk = zk
        self.path = layout.queue(queue)
        self._settings = QueueSettings()
        self._stale = True
        zk.add_listener(self.invalidate)  # any connection change: re-read, re-arm the watch

    def invalidate(self, _event: object = None) -> None:
        self._stale = True

    @property
    def value(self) -> int | None:
        return self.settings.max_running

    @property
    def settings(self) -> QueueSettings:
        """The queue's whole settings, as last read (the head's weights and aging too)."""
        if self._stale:
            self._stale = False  # before the read: a change during it fires the watch again
            try:
                data, _ = self.zk.get(self.path, watch=self.invalidate)
            except NoNodeError:
                data = b""
                self.zk.exists(self.path, watch=self.invalidate)
            except BaseException:
                self._stale = True
                raise
            self._settings = QueueSettings.from_bytes(data)
        return self._settings
