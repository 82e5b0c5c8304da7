"""Cluster-wide metrics read from ZooKeeper on each scrape: ``zkq metrics --port PORT``.

Workers export what they did (workers/metrics.py); the queue as a whole (depth, waiting, the
oldest waiting job, dead letters, workers per queue) is read here on demand by a custom Collector,
so one exporter per cluster answers it and nothing is cached between scrapes.

Each scrape reads, pipelined under one deadline, only stats and short listings (bucket names, each
priority's first bucket, or the first few when running jobs fill the first, ``claims``, the worker
records): nothing it lists grows with the depth or the results stored. It writes nothing
(read-only credentials do). A scrape never raises: when ZooKeeper is unreachable or too slow it
counts an error (``zkq_exporter_scrape_errors_total``), sets ``zkq_exporter_zookeeper_up`` to 0 and
returns what it could read.

Ages (``zkq_queue_oldest_pending_seconds``) compare an entry's ``ctime`` (ZooKeeper's clock) with
the exporter host's clock (reading ZooKeeper's clock would need a write); with NTP the skew is
milliseconds, and a negative age is reported as 0.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from kazoo.exceptions import NoNodeError
from kazoo.interfaces import IAsyncResult
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from zkqueue import defaults
from zkqueue.errors import ZkqError
from zkqueue.operations.serving import serve_registry
from zkqueue.plumbing.deadline import READ_ERRORS, Deadline
from zkqueue.producer.client import Client
from zkqueue.protocol import counts
from zkqueue.protocol.layout import RESULT_BUCKETS, EntryName, bucket_name, in_lane, lane_parts
from zkqueue.protocol.limits import QueueSettings

log = logging.getLogger("zkq.exporter")

#: Seconds one scrape may spend reading ZooKeeper (Prometheus' default scrape timeout is 10 s).
READ_TIMEOUT = 5.0
#: Unclaimed entries per priority whose stat is read to find the oldest (the first ones may be
#: claimed or finished while we look), from the first of at most OLDEST_BUCKETS buckets.
OLDEST_PROBES, OLDEST_BUCKETS = 4, 4
#: Worker records read per scrape at most.
MAX_WORKERS = 1000


@dataclass
class QueueState:
    """One queue as read in one pass. Counts are children of the queue's directories."""

    name: str
    #: Entries per priority, running ones included.
    depth: dict[str, int]
    #: Entries per priority less the claims found in the buckets listed (an estimate).
    waiting: dict[str, int]
    running: int
    idle_workers: int
    dead: int
    results: int
    #: The queue-wide running cap (``zkq queue-limit Q --max-running N``), None without one.
    max_running: int | None = None
    #: ZooKeeper ctime (unix seconds) of the first unclaimed entry per priority; a priority with
    #: nothing waiting (or whose first entries went away while we read) is absent.
    oldest: dict[str, float] = field(default_factory=dict)
    #: Waiting entries per (priority, tenant), estimated as ``waiting`` is.
    tenants: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def total_depth(self) -> int:
        return sum(self.depth.values())

    @property
    def total_waiting(self) -> int:
        """Depth less running jobs, wherever their buckets (as backpressure counts them)."""
        return max(0, self.total_depth - self.running)

    def oldest_age(self, priority: str, now: float) -> float | None:
        """Seconds the first waiting job of ``priority`` has waited at ``now`` (host clock)."""
        ctime = self.oldest.get(priority)
        return None if ctime is None else max(0.0, now - ctime)


@dataclass
class ClusterState:
    """Everything one pass read; ``errors`` says what could not be read."""

    queues: list[QueueState] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    read_at: float = field(default_factory=time.time)


# -- reading -------------------------------------------------------------------------------------


def read_cluster(client: Client, timeout: float = READ_TIMEOUT) -> ClusterState:
    """Read every queue and the worker registry in a few pipelined rounds. Never raises for
    ZooKeeper trouble: what failed is listed in ``errors`` and left out."""
    state = ClusterState()
    zk = client.zk
    if not zk.connected:
        state.errors.append(f"not connected to ZooKeeper at {client.settings.hosts}")
        return state
    deadline = Deadline(timeout)
    layout = client.layout
    try:
        names = sorted(deadline.children(zk.get_children_async(layout.queues())))
    except READ_ERRORS as exc:
        state.errors.append(f"queues: {exc!r}")
        return state
    workers_call = zk.get_children_async(layout.workers())
    started = {q: _start_queue(client, q) for q in names}
    lists = {}
    for queue, calls in started.items():
        try:
            lists[queue] = _finish_queue(client, queue, calls, deadline)
        except READ_ERRORS as exc:
            state.errors.append(f"queue {queue}: {exc!r}")
    probes = {q: _start_oldest(client, q, probe) for q, (_, probe) in lists.items()}
    for queue, (queue_state, _) in lists.items():
        try:
            queue_state.oldest = _finish_oldest(probes[queue], deadline)
        except READ_ERRORS as exc:
            state.errors.append(f"oldest entry of {queue}: {exc!r}")
        state.queues.append(queue_state)
    _read_workers(client, workers_call, deadline, state)
    return state


def _start_queue(client: Client, queue: str) -> dict[str, IAsyncResult]:
    zk, layout = client.zk, client.layout
    calls = {"claims": zk.get_children_async(layout.claims(queue))}
    calls.update(line=zk.exists_async(layout.line(queue)), dead=zk.exists_async(layout.dead(queue)))
    for bucket in RESULT_BUCKETS:
        calls[f"results/{bucket}"] = zk.exists_async(layout.result_dir(queue, bucket))
    calls["settings"] = zk.get_async(layout.queue(queue))
    return calls


def _finish_queue(
    client: Client, queue: str, calls: dict[str, IAsyncResult], deadline: Deadline
) -> tuple[QueueState, dict[str, list[str]]]:
    """The queue's counts (from its buckets' stats) and per lane its first unclaimed names."""
    zk, layout = client.zk, client.layout
    claimed = set(deadline.children(calls["claims"]))
    pairs = counts.bucket_counts(zk, layout, queue, deadline.get)
    firsts = {
        path: zk.get_children_async(layout.bucket(queue, path, ps[0][0]))
        for path, ps in pairs.items()
        if ps
    }
    depth = counts.by_priority(pairs)
    waiting = dict.fromkeys(defaults.PRIORITIES, 0)
    tenants: dict[tuple[str, str], int] = {}
    probe = {}
    for path, lane_pairs in pairs.items():
        held, unclaimed = 0, []
        # The first bucket holding an unclaimed entry has the oldest waiting job; long jobs
        # may pin earlier ones (the first few are listed, one round trip each after the first).
        for i, (bucket, _) in enumerate(lane_pairs[:OLDEST_BUCKETS]):
            call = (
                firsts[path]
                if i == 0
                else zk.get_children_async(layout.bucket(queue, path, bucket))
            )
            names = deadline.children(call)
            leaf = in_lane(path, bucket_name(bucket))
            unclaimed = [f"{leaf}/{n}" for n in names if n.split("-")[0] not in claimed]
            held += len(names) - len(unclaimed)
            if unclaimed:
                break
        count = max(0, sum(n for _, n in lane_pairs) - held)
        priority, tenant = lane_parts(path)
        waiting[priority] += count
        tenants[(priority, tenant)] = count
        probe[path] = first_in_order(unclaimed, OLDEST_PROBES)
    state = QueueState(
        name=queue,
        depth=depth,
        waiting=waiting,
        running=len(claimed),
        idle_workers=deadline.count(calls["line"]),
        dead=deadline.count(calls["dead"]),
        results=sum(deadline.count(calls[f"results/{b}"]) for b in RESULT_BUCKETS),
        max_running=QueueSettings.from_bytes(deadline.get(calls["settings"])[0]).max_running,
        tenants=tenants,
    )
    return state, probe


def first_in_order(names: Iterable[str], limit: int) -> list[str]:
    """The first ``limit`` entry names in dispatch order (malformed names are skipped)."""
    parsed = []
    for name in names:
        try:
            parsed.append(EntryName.parse(name))
        except ZkqError:
            continue
    parsed.sort(key=lambda e: e.order)
    return [e.name for e in parsed[:limit]]


def _start_oldest(
    client: Client, queue: str, probe: dict[str, list[str]]
) -> dict[str, list[IAsyncResult]]:
    zk, layout = client.zk, client.layout
    return {
        path: [zk.exists_async(layout.entry(queue, lane_parts(path)[0], name)) for name in names]
        for path, names in probe.items()
    }


def _finish_oldest(probes: dict[str, list[IAsyncResult]], deadline: Deadline) -> dict[str, float]:
    """The ctime of the oldest first probed entry per priority (over its lanes) that still
    exists."""
    oldest: dict[str, float] = {}
    for path, calls in probes.items():
        stats = [deadline.get(c) for c in calls]
        first = next((s for s in stats if s is not None), None)
        if first is not None:
            priority = lane_parts(path)[0]
            oldest[priority] = min(oldest.get(priority, first.ctime / 1000), first.ctime / 1000)
    return oldest


def _read_workers(
    client: Client, names_call: IAsyncResult, deadline: Deadline, state: ClusterState
) -> None:
    zk, layout = client.zk, client.layout
    try:
        names = sorted(deadline.children(names_call))[:MAX_WORKERS]
    except READ_ERRORS as exc:
        state.errors.append(f"workers: {exc!r}")
        return
    calls = [zk.get_async(layout.worker(n)) for n in names]
    for name, call in zip(names, calls, strict=True):
        try:
            record = json.loads(deadline.get(call)[0])
        except NoNodeError:
            continue  # the worker left while we read
        except READ_ERRORS as exc:
            state.errors.append(f"worker {name}: {exc!r}")
            continue
        if isinstance(record, dict):
            state.workers.append(record)


# -- exposing ------------------------------------------------------------------------------------


class ClusterCollector:
    """A prometheus_client Collector that reads the cluster from ZooKeeper on every scrape."""

    def __init__(self, client: Client, timeout: float = READ_TIMEOUT) -> None:
        self.client = client
        self.timeout = timeout
        #: Scrapes that could not read everything, since this collector was made.
        self.errors = 0
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        """The metric names, without reading ZooKeeper (the registry checks them for clashes)."""
        return _families(ClusterState(), 0.0, errors=0, duration=0.0)

    def collect(self) -> Iterable[Metric]:
        started = time.monotonic()
        try:
            state = read_cluster(self.client, self.timeout)
        except Exception as exc:  # a scrape must answer whatever went wrong; say what it was
            log.exception("reading the cluster failed")
            state = ClusterState(errors=[repr(exc)])
        if state.errors:
            log.warning("scrape incomplete: %s", "; ".join(state.errors[:5]))
            with self._lock:
                self.errors += 1
        return _families(state, time.time(), self.errors, time.monotonic() - started)


def _families(state: ClusterState, now: float, errors: int, duration: float) -> list[Metric]:
    queues = [q.name for q in state.queues]
    return [
        *_queue_families(state.queues, now),
        _workers_family(state.workers, queues),
        CounterMetricFamily(
            "zkq_exporter_scrape_errors",
            "Scrapes that could not read everything from ZooKeeper.",
            value=errors,
        ),
        GaugeMetricFamily(
            "zkq_exporter_zookeeper_up",
            "1 if the last scrape read everything from ZooKeeper.",
            value=0 if state.errors else 1,
        ),
        GaugeMetricFamily(
            "zkq_exporter_scrape_duration_seconds",
            "Seconds the last scrape spent reading ZooKeeper.",
            value=duration,
        ),
    ]


def _queue_families(queues: list[QueueState], now: float) -> list[Metric]:
    depth = GaugeMetricFamily(
        "zkq_queue_depth", "Entries (running included).", labels=["queue", "priority"]
    )
    oldest = GaugeMetricFamily(
        "zkq_queue_oldest_pending_seconds",
        "Age of the first unclaimed entry (0: none waiting).",
        labels=["queue", "priority"],
    )
    per_queue = {
        "waiting": GaugeMetricFamily("zkq_queue_waiting", "Unclaimed entries.", labels=["queue"]),
        "running": GaugeMetricFamily("zkq_queue_running", "Claimed entries.", labels=["queue"]),
        "dead": GaugeMetricFamily("zkq_queue_dead", "Dead letters.", labels=["queue"]),
        "results": GaugeMetricFamily("zkq_queue_results", "Stored results.", labels=["queue"]),
        "idle_workers": GaugeMetricFamily(
            "zkq_queue_idle_workers", "Workers in the line (a slot free).", labels=["queue"]
        ),
    }
    tenants = GaugeMetricFamily(
        "zkq_tenant_waiting",
        "Unclaimed entries per tenant (tenants with a lane in the queue).",
        labels=["queue", "priority", "tenant"],
    )
    for q in queues:
        for (priority, tenant), n in sorted(q.tenants.items()):
            tenants.add_metric([q.name, priority, tenant], n)
        for priority in defaults.PRIORITIES:
            depth.add_metric([q.name, priority], q.depth[priority])
            age = q.oldest_age(priority, now)
            if age is not None or not q.waiting[priority]:
                oldest.add_metric([q.name, priority], age or 0.0)
        per_queue["waiting"].add_metric([q.name], q.total_waiting)
        for key in ("running", "dead", "results", "idle_workers"):
            per_queue[key].add_metric([q.name], getattr(q, key))
    return [depth, *per_queue.values(), oldest, tenants]


def _workers_family(workers: list[dict[str, Any]], queues: list[str]) -> Metric:
    counts = dict.fromkeys(queues, 0)
    for record in workers:
        queue = str(record.get("queue", ""))
        counts[queue] = counts.get(queue, 0) + 1
    family = GaugeMetricFamily("zkq_workers", "Registered workers.", labels=["queue"])
    for queue, n in sorted(counts.items()):
        family.add_metric([queue], n)
    return family


def cluster_registry(client: Client, timeout: float = READ_TIMEOUT) -> CollectorRegistry:
    """A registry holding only the cluster collector."""
    registry = CollectorRegistry()
    registry.register(ClusterCollector(client, timeout))
    return registry


def collect_once(client: Client, timeout: float = READ_TIMEOUT) -> str:
    """One scrape's text exposition (what ``curl host:port/metrics`` would print)."""
    return generate_latest(cluster_registry(client, timeout)).decode()


def serve_cluster_metrics(
    client: Client, port: int, addr: str = "0.0.0.0", timeout: float = READ_TIMEOUT
) -> WSGIServer:
    """Serve the cluster metrics on ``addr:port`` from a daemon thread (port 0: any free port,
    see ``server.server_port``). ``client`` must be started; stop with ``server.shutdown()``."""
    return serve_registry(cluster_registry(client, timeout), port, addr)


def run_exporter(
    client: Client, port: int, addr: str = "0.0.0.0", stop: threading.Event | None = None
) -> None:
    """Serve until ``stop`` is set, SIGTERM or Ctrl-C (the body of ``zkq metrics``)."""
    stop = stop or threading.Event()
    server = serve_cluster_metrics(client, port, addr)
    log.info("serving cluster metrics on %s:%d/metrics", addr, server.server_port)
    try:
        with _stop_on_sigterm(stop):
            while not stop.wait(1.0):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def _stop_on_sigterm(stop: threading.Event) -> Iterator[None]:
    """Make SIGTERM set ``stop`` while inside (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
