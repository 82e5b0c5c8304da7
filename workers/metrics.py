"""A worker's Prometheus metrics: what it ran, how long jobs waited and ran, its memory, slots,
leases and ZooKeeper connection, served over HTTP for scraping (``zkq worker --metrics-port``).

Each ``WorkerMetrics`` owns its own CollectorRegistry (not prometheus_client's global one), so
several workers in one process, and tests, never collide. The methods are the worker loop's hooks;
each is cheap and thread safe. Cluster-wide figures (queue depth, oldest pending job) come from
``zkq metrics`` (zkqueue/operations/exporter.py) instead, since no single worker sees the whole
queue.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from zkqueue import defaults
from zkqueue.operations.janitor import PassReport
from zkqueue.operations.serving import serve_registry
from zkqueue.protocol import result as results

#: Seconds a job waited in the queue: a fraction of a second when workers are idle, up to hours
#: in a backlog.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
#: Seconds a job ran: from an echo job's milliseconds to a long generation's minutes.
RUN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
#: Jobs claimed in one head turn.
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: KV-cache pages promised per job: powers of two from 1 to 64k.
PAGE_BUCKETS = tuple(float(2**n) for n in range(17))
#: The connection states kazoo reports (kazoo.protocol.states.KazooState values).
CONNECTION_STATES = ("CONNECTED", "SUSPENDED", "LOST")
#: Tenants with a label of their own in zkq_tenant_wait_seconds, per worker (the rest: "other").
MAX_TENANT_LABELS = 32


class WorkerMetrics:
    """One worker's metrics, in a registry of its own. Call ``serve`` to expose them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.jobs = Counter(
            "zkq_jobs",
            "Jobs this worker ended, by result status.",
            ["queue", "priority", "status"],
            registry=reg,
        )
        self.wait = Histogram(
            "zkq_queue_wait_seconds",
            "Seconds from submission to claim.",
            ["queue", "priority"],
            buckets=WAIT_BUCKETS,
            registry=reg,
        )
        self.tenant_wait = Histogram(
            "zkq_tenant_wait_seconds",
            "Seconds from submission to claim, by tenant (jobs of tenants other than the default "
            f"one; the first {MAX_TENANT_LABELS} tenants by name, the rest as 'other').",
            ["queue", "priority", "tenant"],
            buckets=WAIT_BUCKETS,
            registry=reg,
        )
        #: The tenants with a label of their own (bounded: MAX_TENANT_LABELS).
        self._tenants: set[str] = set()
        self.run = Histogram(
            "zkq_run_seconds",
            "Seconds from claim to end.",
            ["queue", "priority"],
            buckets=RUN_BUCKETS,
            registry=reg,
        )
        self.tokens = Counter(
            "zkq_tokens_generated", "Output tokens generated.", ["queue"], registry=reg
        )
        self.batch_size = Histogram(
            "zkq_batch_size",
            "Jobs claimed in one head turn.",
            ["queue"],
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self.cache_pages = Gauge(
            "zkq_kv_cache_pages",
            "The worker's KV cache: pages in all, promised to jobs in flight.",
            ["kind"],
            registry=reg,
        )
        self.need = Histogram(
            "zkq_job_kv_pages",
            "KV-cache pages promised to each admitted job.",
            ["queue"],
            buckets=PAGE_BUCKETS,
            registry=reg,
        )
        self.slot_gauge = Gauge(
            "zkq_slots", "Slots busy and slots in all.", ["state"], registry=reg
        )
        self.renewals = Counter("zkq_lease_renewals", "Claim leases renewed.", registry=reg)
        self.lost = Counter(
            "zkq_claims_lost",
            "Claims this worker lost before completing.",
            ["reason"],
            registry=reg,
        )
        self.connected = Gauge(
            "zkq_zookeeper_connected", "1 while the ZooKeeper session is connected.", registry=reg
        )
        self.state = Gauge(
            "zkq_zookeeper_state",
            "1 for the current ZooKeeper connection state, 0 for the others.",
            ["state"],
            registry=reg,
        )
        self.results_stored = Gauge(
            "zkq_results_stored",
            "Results a queue stores (set by the elected janitor after each pass).",
            ["queue"],
            registry=reg,
        )
        self.results_bytes = Gauge(
            "zkq_results_stored_bytes",
            "Estimated bytes of a queue's stored result records (set by the elected janitor).",
            ["queue"],
            registry=reg,
        )
        self.preemptions = Counter(
            "zkq_preemptions",
            "Jobs this worker gave back for a more urgent one, by the given-back job's priority.",
            ["queue", "priority"],
            registry=reg,
        )
        self.stream_readers = Gauge(
            "zkq_stream_readers",
            "Readers connected to the streams of this worker's jobs (the data plane).",
            registry=reg,
        )
        self.stream_partials = Counter(
            "zkq_stream_claim_writes",
            "Streaming output written into claims, for jobs no direct reader takes.",
            registry=reg,
        )
        self._queues: set[str] = set()
        self.connection("LOST")

    # -- the worker loop's hooks -------------------------------------------------------------

    def job_finished(
        self,
        queue: str,
        priority: str,
        status: str,
        wait_s: float | None,
        run_s: float | None,
        tokens: int | None,
        tenant: str | None = None,
    ) -> None:
        """A job ended with a result. ``wait_s``/``run_s`` are None for a job that never ran
        (expired, rejected, dead-lettered): it is counted but left out of that histogram.
        ``tenant``: a job of a tenant other than the default one (its wait is also observed by
        tenant)."""
        self._know(queue)
        self.jobs.labels(queue, priority, status).inc()
        if wait_s is not None:
            self.wait.labels(queue, priority).observe(max(0.0, wait_s))
            if tenant:
                label = self._tenant_label(tenant)
                self.tenant_wait.labels(queue, priority, label).observe(max(0.0, wait_s))
        if run_s is not None:
            self.run.labels(queue, priority).observe(max(0.0, run_s))
        if tokens:
            self.tokens.labels(queue).inc(tokens)

    def _tenant_label(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) >= MAX_TENANT_LABELS:
            return "other"
        self._tenants.add(tenant)
        return tenant

    def batch(self, queue: str, size: int) -> None:
        """One head turn claimed ``size`` jobs."""
        self.batch_size.labels(queue).observe(size)

    def preempted(self, queue: str, priority: str) -> None:
        """A job of ``priority`` was given back for a more urgent one."""
        self.preemptions.labels(queue, priority).inc()

    def cache(self, total: int, promised: int) -> None:
        """The worker's KV cache, in pages: its size and what jobs in flight were promised."""
        self.cache_pages.labels("total").set(total)
        self.cache_pages.labels("promised").set(promised)

    def job_pages(self, queue: str, pages: int) -> None:
        """Admission promised a job this worker claimed ``pages`` KV-cache pages."""
        self.need.labels(queue).observe(pages)

    def slots(self, busy: int, max: int) -> None:
        """Slots running a job now, and the worker's slots in all."""
        self.slot_gauge.labels("busy").set(busy)
        self.slot_gauge.labels("max").set(max)

    def lease_renewed(self, n: int) -> None:
        """``n`` leases were renewed in one round."""
        if n > 0:
            self.renewals.inc(n)

    def claim_lost(self, reason: str) -> None:
        """A claim went away under the worker: ``lease`` (reclaimed by the janitor), ``session``
        (session lost) or ``fenced`` (the entry changed or the completion's check failed)."""
        self.lost.labels(reason).inc()

    def connection(self, state: str) -> None:
        """The ZooKeeper connection changed state (a KazooState value, e.g. "SUSPENDED")."""
        state = str(state).upper()
        self.connected.set(1 if state == "CONNECTED" else 0)
        for known in CONNECTION_STATES:
            self.state.labels(known).set(1 if known == state else 0)

    # -- exposing ----------------------------------------------------------------------------

    def janitor_pass(self, report: PassReport) -> None:
        """The stored results per queue after a janitor pass (compare with the bounds)."""
        for queue, stored in report.results_stored.items():
            self.results_stored.labels(queue).set(stored)
            self.results_bytes.labels(queue).set(report.results_bytes.get(queue, 0))

    def janitor_resigned(self) -> None:
        """Another process is the janitor now: its gauges are the ones to read (two series
        per queue would add up to twice the results)."""
        self.results_stored.clear()
        self.results_bytes.clear()

    def serve(self, port: int, addr: str = "0.0.0.0") -> WSGIServer:
        """Serve /metrics on ``addr:port`` from a daemon thread (port 0: any free port, read it
        back from ``server.server_port``). Stop it with ``server.shutdown()``."""
        return serve_registry(self.registry, port, addr)

    def _know(self, queue: str) -> None:
        """Create a queue's job counters at zero the first time it is seen, so that rate() and
        increase() see the first failure of a kind instead of a series that starts at 1."""
        if queue in self._queues:
            return
        self._queues.add(queue)
        for priority in defaults.PRIORITIES:
            self.preemptions.labels(queue, priority)
            for status in results.STATUSES:
                self.jobs.labels(queue, priority, status)
        self.tokens.labels(queue)
