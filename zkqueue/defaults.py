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
#: A spec at most this long also goes into the tail bucket's data with its enqueue (the arrival
#: signal, zkqueue.protocol.arrival), so an idle head claims it without reading the entry.
SIGNAL_SPEC_BYTES = 8 * 1024
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
#: Seconds of finishing times one bucket of the results' expiry index covers.
EXPIRY_TICK = 10.0
#: Stored results per queue at most (count and bytes of records): beyond either, the janitor
#: expires the oldest first. 100,000 results of ~2 KiB hold ~0.5 GiB of ZooKeeper heap.
MAX_RESULTS = 100_000
MAX_RESULT_STORE_BYTES = 256 * 1024 * 1024
#: Dead letters per queue at most; the janitor removes the oldest beyond it.
MAX_DEAD = 10_000
#: Nodes one janitor pass deletes at most per queue, and deletes it has in flight at once.
JANITOR_PAGE = 2000
JANITOR_IN_FLIGHT = 64
#: Entries one pending bucket holds (producers open the next one past it).
PENDING_BUCKET = 1000
#: Seconds a tenant's lane may stay empty and unchanged before the janitor removes it (and the
#: tenant's fair-share counters with its last lane): a lane per name a gateway's callers chose
#: (OpenAI's ``user``) must not pile up. The tenant's next job makes the lane again.
LANE_IDLE = 600.0
#: Tenants' lanes one priority of a queue holds at most: a producer refuses a new tenant's
#: first job beyond it ("queue full"; the janitor frees lanes left empty). Each lane costs every
#: head turn a little (the view walks the lanes of a band), so this bounds a burst of tenant
#: names (a gateway taking them from its callers) before the janitor prunes them.
MAX_LANES = 1000

#: Seconds between writes of a streaming job's partial output (at most a few a second).
STREAM_INTERVAL = 0.25
#: Seconds a claimed job runs before its worker watches its entry (to stop it when it is
#: cancelled, withdrawn or reclaimed): shorter jobs end first and never pay for the watch.
ENTRY_WATCH_DELAY = 0.05

WORKER_SLOTS = 1
#: Preemption (workers.preemption): a full worker gives back its newest job of a lower priority
#: for a more urgent one that waits; a job preempted less than PREEMPT_PROTECT seconds ago is
#: left alone, and a worker preempts at most PREEMPT_PER_MINUTE jobs in any minute.
PREEMPT = True
PREEMPT_PROTECT = 30.0
PREEMPT_PER_MINUTE = 60
HEARTBEAT_INTERVAL = 2.0
DRAIN_TIMEOUT = 60.0
ECHO_DELAY = 0.0
#: A worker in front of an inference server (workers.runners.gate) claims while the server's
#: waiting queue holds at most UPSTREAM_MAX_WAITING requests and its KV-cache use is below
#: UPSTREAM_MAX_KV_USE; a request with no byte from the server for UPSTREAM_TIMEOUT seconds
#: counts as the server's failure.
UPSTREAM_MAX_WAITING = 0
UPSTREAM_MAX_KV_USE = 0.9
UPSTREAM_TIMEOUT = 120.0
