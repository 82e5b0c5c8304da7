"""Every default zkq uses, in one place. Constructors take these as keyword arguments; the CLI maps
its options (with ``ZKQ_*`` environment fallbacks) onto the same names."""

from __future__ import annotations

import enum


class Priority(enum.StrEnum):
    """A job's priority; the value is the wire string (a pending/<priority> directory)."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


HOSTS = "127.0.0.1:2181"
ROOT = "/zkq"
QUEUE = "default"
PRIORITY: str = Priority.NORMAL.value
#: Dispatch order: a lower rank is served first.
PRIORITIES: tuple[str, ...] = tuple(p.value for p in Priority)

SESSION_TIMEOUT = 10.0
CONNECT_TIMEOUT = 10.0

MAX_NEW_TOKENS = 64
MAX_NEW_TOKENS_LIMIT = 65536
#: A job spec's JSON may be at most this many bytes (ZooKeeper's own limit is about 1 MB).
MAX_SPEC_BYTES = 64 * 1024
#: A result record's JSON may be at most this many bytes.
MAX_RESULT_BYTES = 256 * 1024
#: A job claimed this many times (each claim bumps the entry's version) is dead-lettered.
MAX_ATTEMPTS = 3

#: Seconds a running job's claim stays valid without progress; workers renew it while their runner
#: makes progress, and the janitor reclaims a claim whose lease ran out (a hung worker).
LEASE = 60.0
#: Seconds between janitor passes, and how long finished results are kept.
JANITOR_INTERVAL = 5.0
RESULT_TTL = 24 * 3600.0

#: Seconds between writes of a streaming job's partial output (at most a few a second).
STREAM_INTERVAL = 0.25

WORKER_SLOTS = 1
HEARTBEAT_INTERVAL = 2.0
DRAIN_TIMEOUT = 60.0
ECHO_DELAY = 0.0
